"""Measurements kept beside eval's report, so an eval stopped part way resumes without scoring again.

Scoring every model on test and validation is most of an eval's time on an imported base (about an hour at
--max-tokens 16384 on 2 cores for a study run's twenty files), and a study spans sittings. Each measurement
is stored as OUT/measured/<file>.<what>.json with the key it was made under: the GGUF's name, size and mtime
(every file eval writes is replaced, never edited, so a rebuilt model has a new mtime), the adapters' the same
way, the split, the domains and every setting of the measurement. A stored result is reused only where the
key is equal, or where only the GGUF's mtime differs and its bytes are those measured (their blake3, stored
beside the key: a model assembled again from the same modules is the same file, and scoring it again costs
minutes); `eval --force` measures again.

Example:
    >>> kept(out, path, {"split": "test", "max_tokens": 16384}, lambda: measure(...))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from mfgguf.run import blake3_file, write_json


def file_key(path: Path | str) -> list:
    """What identifies a file eval wrote: its name, size and mtime."""
    st = Path(path).stat()
    return [Path(path).name, st.st_size, st.st_mtime_ns]


def kept(out: Path, path: Path, settings: dict, compute: Callable[[], dict], *, force: bool = False,
         what: str = "") -> dict:
    """`compute()`'s result for the GGUF `path` under `settings`, from OUT/measured/ where it was stored under the
    same key, else computed and stored (`what` tells two measurements of one file and split apart)."""
    key, digest = {"file": file_key(path), **settings}, None
    store = out / "measured" / f"{path.stem}.{settings.get('split', '')}{'.' + what if what else ''}.json"
    if not force and store.is_file():
        try:
            old = json.loads(store.read_text())
        except ValueError:  # a store cut short by a stop: measured again
            old = {}
        key_json, was = json.loads(json.dumps(key)), old.get("key")  # compared as stored (tuples become lists)
        if was == key_json:
            return old["result"]
        if isinstance(was, dict) and _without_mtime(was) == _without_mtime(key_json):  # the bytes decide
            digest = blake3_file(path)
            if old.get("blake3") == digest:
                return old["result"]
    result = compute()
    store.parent.mkdir(parents=True, exist_ok=True)
    write_json(store, {"key": key, "blake3": digest or blake3_file(path), "result": result})
    return result


def _without_mtime(key: dict) -> dict:
    return {**key, "file": key["file"][:2]}  # a file key is [name, size, mtime]


__all__ = ["file_key", "kept"]
