"""The names a RUN made by an earlier mfgguf uses, mapped to the current, so that such a RUN is read as it is.

Earlier, "heldout" meant two things: the test split (data/heldout/, run.json's "heldout" and "heldout_frac")
and the validation loss in records ("heldout_loss", "heldout_history", ...); and "round" meant a round's index
on an expert but the syncs so far on a trunk. Each meaning has its own name now (a trunk's count is "syncs").
A record's JSON is renamed as it is read (`renamed`, called by the typed records of records.py and by the
readers of checkpoint states and the base's score), keeping its key order, and written back with the new names;
the test split is found where the RUN keeps it (`test_dir_of`). Nothing else in mfgguf names the old keys.

Example:
    >>> renamed({"name": "expert_001", "heldout_loss": {"c": 1.5}})
    {'name': 'expert_001', 'validation_loss': {'c': 1.5}}
"""

from __future__ import annotations

from pathlib import Path

TEST_DIR, OLD_TEST_DIR = "test", "heldout"  # data/<name>/: the test split
BASE_SCORE, OLD_BASE_SCORE = "validation.json", "heldout.json"  # base/<name>: the imported base's score

# {old key: new key} in any record's JSON and in the dicts it nests ("premerge", "key", ...)
OLD_KEYS = {
    "heldout_loss": "validation_loss",
    "heldout_loss_mean": "validation_loss_mean",
    "trunk_heldout_loss": "trunk_validation_loss",
    "before_heldout_loss": "before_validation_loss",
    "trained_heldout_loss": "trained_validation_loss",
    "heldout_history": "validation_history",
    "heldout_curve_s": "validation_curve_s",
    "heldout_on": "validation_on",
    "heldout_bytes": "validation_bytes",
    "heldout_loss_trained_domains": "validation_loss_trained_domains",
}
# run.json's own: the test split's sizes and share (at the top level only; elsewhere "heldout" was a timing)
OLD_RUN_KEYS = {"heldout": "test", "heldout_frac": "test_frac"}
OLD_TRUNK_KEYS = {"round": "syncs"}  # a trunk's record: its count of syncs (an expert's "round" is its round)


def _rename(d: dict, keys: dict[str, str]) -> dict:
    if not any(k in keys for k in d):
        return d
    return {keys.get(k, k) if keys.get(k, k) not in d else k: v for k, v in d.items()}


def renamed(d: dict, top: dict[str, str] | None = None) -> dict:
    """`d` with earlier mfgguf's keys given the current names, in its key order, nested dicts too; `top`: more
    {old: new} for the top level alone (a trunk's record takes OLD_TRUNK_KEYS unasked). `d` itself when it
    holds none; a key whose new name is also present keeps its old one (the new one wins when read)."""
    if not isinstance(d, dict):  # a record that is a list (machines.json) has no keys to rename
        return d
    trunk = OLD_TRUNK_KEYS if d.get("kind") == "trunk" else {}
    out = _rename(d, {**OLD_KEYS, **trunk, **(top or {})})
    nested = {k: renamed(v) for k, v in out.items() if isinstance(v, dict)}
    return {**out, **nested} if any(nested[k] is not out[k] for k in nested) else out


def test_dir_of(data: Path) -> Path:
    """A RUN's test split under its data/ directory: data/test/, or data/heldout/ where only that exists."""
    new, old = data / TEST_DIR, data / OLD_TEST_DIR
    return old if old.is_dir() and not new.is_dir() else new


def base_score_of(base: Path) -> Path:
    """The imported base's validation score under RUN/base/, written by an earlier mfgguf under its old name
    where only that exists."""
    new, old = base / BASE_SCORE, base / OLD_BASE_SCORE
    return old if old.is_file() and not new.is_file() else new


__all__ = ["OLD_KEYS", "OLD_RUN_KEYS", "OLD_TRUNK_KEYS", "base_score_of", "renamed", "test_dir_of"]
