"""Measurements kept beside eval's report, so an eval stopped part way resumes without scoring again.

Scoring every model on test and validation is most of an eval's time on an imported base (about an hour at
--max-tokens 16384 on 2 cores for a study run's twenty files), and a study spans sittings. Each measurement
is stored as OUT/measured/<file>.<what>.json with the key it was made under: the GGUF's name, size and mtime
(every file eval writes is replaced, never edited, so a rebuilt model has a new mtime), the adapters' the same
way, the split, the domains and every setting of the measurement. A stored result is reused only where the
key is equal; `eval --force` measures again.

Example:
    >>> kept(out, path, {"split": "test", "max_tokens": 16384}, lambda: measure(...))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from mfgguf.run import write_json


def file_key(path: Path | str) -> list:
    """What identifies a file eval wrote: its name, size and mtime."""
    st = Path(path).stat()
    return [Path(path).name, st.st_size, st.st_mtime_ns]


def kept(out: Path, path: Path, settings: dict, compute: Callable[[], dict], *, force: bool = False,
         what: str = "") -> dict:
    """`compute()`'s result for the GGUF `path` under `settings`, from OUT/measured/ where it was stored under the
    same key, else computed and stored (`what` tells two measurements of one file and split apart)."""
    key = {"file": file_key(path), **settings}
    store = out / "measured" / f"{path.stem}.{settings.get('split', '')}{'.' + what if what else ''}.json"
    if not force and store.is_file():
        try:
            old = json.loads(store.read_text())
        except ValueError:  # a store cut short by a stop: measured again
            old = {}
        if old.get("key") == json.loads(json.dumps(key)):  # compared as stored (tuples become lists)
            return old["result"]
    result = compute()
    store.parent.mkdir(parents=True, exist_ok=True)
    write_json(store, {"key": key, "result": result})
    return result


__all__ = ["file_key", "kept"]
