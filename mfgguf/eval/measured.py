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
        key_json = json.loads(json.dumps(key))  # compared as stored (tuples become lists)
        if old.get("key") == key_json or (_same_but_mtime(old.get("key"), key_json)
                                          and old.get("blake3") == blake3_file(path)):
            return old["result"]
    result = compute()
    store.parent.mkdir(parents=True, exist_ok=True)
    write_json(store, {"key": key, "blake3": blake3_file(path), "result": result})
    return result


def _same_but_mtime(old: dict | None, new: dict) -> bool:
    # a file key is [name, size, mtime]; every other setting must be equal
    return (isinstance(old, dict) and old.keys() == new.keys() and old["file"][:2] == new["file"][:2]
            and all(old[k] == new[k] for k in new if k != "file"))


def blake3_file(path: Path) -> str:
    """The file's blake3, read through mmap on every core: far cheaper than scoring the model again."""
    from blake3 import blake3

    return blake3(max_threads=blake3.AUTO).update_mmap(str(path)).hexdigest()


__all__ = ["blake3_file", "file_key", "kept"]
