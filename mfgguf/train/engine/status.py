"""A training job's live status as a small JSON file, for schedulers that watch many jobs at once.

`train-experts` starts each job with MFGGUF_STATUS_FILE set; the training loop then rewrites that
file (atomically, at most every `every` seconds) with its step, tokens/s, ETA and loss, and the
scheduler's live view reads it. Without the variable nothing is written.

Example:
    >>> s = StatusFile.from_env()          # None unless MFGGUF_STATUS_FILE is set
    >>> s and s.update(step=10, steps=40, tokens=5120, total=20480, tokens_per_s=900.0, loss=5.1)
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

ENV = "MFGGUF_STATUS_FILE"


class StatusFile:
    def __init__(self, path: Path, every: float = 1.0):
        self.path, self.every, self.last = Path(path), every, 0.0
        self.base = {"pid": os.getpid(), "host": socket.gethostname()}

    @classmethod
    def from_env(cls) -> "StatusFile | None":
        p = os.environ.get(ENV)
        return cls(Path(p)) if p else None

    def update(self, force: bool = False, **fields) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        tps, left = fields.get("tokens_per_s") or 0.0, fields.get("total", 0) - fields.get("tokens", 0)
        doc = {**self.base, **fields, "eta_s": round(left / tps, 1) if tps > 0 else None, "time": time.time()}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a status file is a convenience; never fail training over it


def read_status(path: Path) -> dict:
    """The last status written at `path`, or {} (absent, or being replaced)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


__all__ = ["ENV", "StatusFile", "read_status"]
