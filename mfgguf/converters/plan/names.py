"""What a file's experts are, written into its metadata: a label each, the tokens it trained on, the trunk it trained
against; and the model's name from its base and its experts.

A user who opens the file (`inspect`, `chat`'s banner, any GGUF reader) sees its experts by name instead of slot
numbers. The keys are arrays in routed-slot order, so `extend` keeps a kept expert's entries and appends an added
one's (extension/newfile.py):
  - mfgguf.expert_labels (STRING): the expert's domain where its shard holds one (`python`; `python 2/3` where
    several shards split it), else its shard's main domains with their shares and, for a `cluster` partition,
    its cluster's top terms (e.g. `cluster 3: python <share>, man <share>; def self return`);
  - mfgguf.expert_tokens (UINT64): the tokens it trained on, every round counted;
  - mfgguf.expert_trunk_sha256 (STRING): the trunk its record says it trained against;
  - mfgguf.base (STRING): the base model's name (an imported base), or `mfgguf <preset>` for a trunk trained here.
`general.name` becomes "<base> + N experts".

Example:
    >>> expert_label({"python": 900, "man": 100}, partition="label")
    'python'
"""

from __future__ import annotations

from pathlib import Path

LABELS, TOKENS, TRUNKS, BASE = "mfgguf.expert_labels", "mfgguf.expert_tokens", "mfgguf.expert_trunk_sha256", "mfgguf.base"
TOP_TERMS = 3  # a cluster's terms in its label
SHOWN_DOMAINS = 2  # a mixed shard's domains in its label


def model_name(base: str, n: int) -> str:
    return f"{base} + {n} expert{'s' * (n != 1)}" if n else base


def base_name(run_root: Path, preset: str) -> str:
    """The imported base's name (its file's or folder's, without extensions), or `mfgguf <preset>`."""
    import json

    info = Path(run_root) / "base" / "base.json"
    if info.is_file():
        source = Path(str(json.loads(info.read_text()).get("source", "")))
        return source.name.split(".")[0] if source.name.endswith(".gguf") else source.name or "base"
    return f"mfgguf {preset}".strip()


def expert_label(domains: dict | None, *, partition: str, part: tuple[int, int] | None = None,
                 cluster: int | None = None, terms: list[str] = ()) -> str:
    """One expert's label from its shard's {domain: tokens} (see the module docstring); `part` = (k, n) where its
    domain is split over n shards, `cluster` and `terms` for a cluster partition's shard."""
    if not domains:
        return f"cluster {cluster}" if cluster is not None else "expert"
    total = sum(domains.values()) or 1
    top = sorted(domains.items(), key=lambda kv: -kv[1])
    if len(domains) == 1 and partition != "cluster":
        return top[0][0] + (f" {part[0]}/{part[1]}" if part and part[1] > 1 else "")
    mix = ", ".join(f"{d} {100 * n / total:.0f}%" for d, n in top[:SHOWN_DOMAINS])
    if cluster is None:
        return mix
    return f"cluster {cluster}: {mix}" + (f"; {' '.join(terms)}" if terms else "")


def labels_for(run, ids: list[int], metas: list, tokens: list[str] | None) -> list[str]:
    """The labels of experts `ids` of RUN (their records `metas`), as `expert_label` makes them."""
    info = run.run_info()
    partition = str(info.partition or "")
    shards = {int(s["id"]): s.get("domains") or {} for s in info.shards or []}
    alone = {}  # domain -> the shards that hold it alone, to number the parts of a split domain
    for i, d in sorted(shards.items()):
        if len(d) == 1:
            alone.setdefault(next(iter(d)), []).append(i)
    terms = _cluster_terms(run, tokens) if partition == "cluster" else {}
    out = []
    for i, meta in zip(ids, metas):
        d = meta.shard_domains or shards.get(i) or {}
        mine = alone.get(next(iter(d)), []) if len(d) == 1 else []
        part = (mine.index(i) + 1, len(mine)) if i in mine else None
        out.append(expert_label(d, partition=partition, part=part, cluster=i if partition == "cluster" else None,
                                terms=terms.get(i, [])))
    return out


def _cluster_terms(run, tokens: list[str] | None) -> dict[int, list[str]]:
    """{expert: its cluster centre's heaviest terms, as words} from data/clusters.safetensors (prepare's k-means)."""
    if tokens is None or not run.clusters.is_file():
        return {}
    import numpy as np
    from safetensors.numpy import load_file

    c = load_file(str(run.clusters))
    centres, ids = c["centres"], c["terms"]  # (k, n_terms), (n_terms,) token ids
    out = {}
    for k in range(centres.shape[0]):
        words = []
        for j in np.argsort(-centres[k]):
            w = _word(tokens[int(ids[j])]) if int(ids[j]) < len(tokens) else ""
            if w and w not in words:
                words.append(w)
            if len(words) == TOP_TERMS:
                break
        out[k + 1] = words
    return out


def _word(token: str) -> str:
    """A token as text: a byte-level BPE token's bytes decoded (Ġ is a space, ĉ a tab), SentencePiece's space marker
    a space; empty where it holds no letter or digit."""
    from tokenizers import decoders

    text = decoders.ByteLevel().decode([token])
    if "\ufffd" not in text or "\ufffd" in token:  # "café" from SentencePiece spells no valid UTF-8: it stays
        token = text
    w = token.replace("▁", " ").strip()
    return w if any(ch.isalnum() for ch in w) else ""


def expert_kv(run, ids: list[int], metas: list, tokens: list[str] | None) -> list[tuple[str, str, object]]:
    """The per-expert keys of the module docstring for experts `ids` (records `metas`), in slot order."""
    return [(LABELS, "ARRAY", ("STRING", labels_for(run, ids, metas, tokens))),
            (TOKENS, "ARRAY", ("UINT64", [int(m.tokens_seen or 0) for m in metas])),
            (TRUNKS, "ARRAY", ("STRING", [str(m.trunk_sha256 or "") for m in metas]))]


__all__ = ["BASE", "LABELS", "TOKENS", "TRUNKS", "base_name", "expert_kv", "expert_label", "labels_for", "model_name"]
