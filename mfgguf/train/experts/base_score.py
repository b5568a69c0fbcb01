"""The imported base's own validation loss, scored once per RUN: the "before" of every expert's summary.

A trunk trained here records its validation loss when it finishes; an imported base (`import-base`)
has none, because `prepare` makes the validation split after the import. The first expert trained
against it scores the trunk alone (anchor + seed: the base exactly) on the validation split, with
the expert's own evaluation settings, and keeps the result in RUN/base/validation.json; later experts
read it. The file is keyed by the trunk's sha256, the tokens scored, the precision and the
validation files' sizes, so a new split or another setting scores again.

Example:
    >>> base_validation_loss(rd, trunk_meta, eval_tokens=65_536, dev=torch.device("cpu"), precision="bf16")
    {'code': 1.92, 'docs': 2.41}
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mfgguf.base.runbase import BaseFiles
from mfgguf.config import ModelConfig
from mfgguf.run.legacy import BASE_SCORE, base_score_of, renamed
from mfgguf.run.records import ModuleMeta
from mfgguf.run import RunDir, write_json
from mfgguf.train.engine.loop import validation_losses
from mfgguf.train.engine.weights import trunk_alone


def _record(trunk_meta: ModuleMeta | dict) -> ModuleMeta:
    return trunk_meta if isinstance(trunk_meta, ModuleMeta) else ModuleMeta.from_json(trunk_meta)


def _key(rd: RunDir, trunk_meta: ModuleMeta, eval_tokens: int, precision: str) -> dict:
    return {"trunk_sha256": trunk_meta.sha256, "eval_tokens": int(eval_tokens), "precision": precision,
            "validation_bytes": {f.stem: f.stat().st_size for f in sorted(Path(rd.validation_dir).glob("*.npy"))}}


@torch.no_grad()
def base_validation_loss(rd: RunDir, trunk_meta: ModuleMeta | dict, eval_tokens: int, dev, precision: str) -> dict:
    """{domain: validation loss} of an imported trunk alone, from RUN/base/validation.json or scored now."""
    trunk_meta = _record(trunk_meta)
    path = base_score_of(BaseFiles(rd.root).root)
    key = _key(rd, trunk_meta, eval_tokens, precision)
    try:
        cached = renamed(json.loads(path.read_text()))
        if cached.get("key") == key:
            return cached["validation_loss"]
    except (OSError, ValueError, AttributeError):
        pass  # absent or unreadable: score again
    model, route = trunk_alone(rd.module_file(0), ModelConfig.from_dict(trunk_meta.config), dev)
    held = validation_losses(rd.validation_dir, model, eval_tokens, route, dev, precision)
    write_json(path.with_name(BASE_SCORE), {"key": key, "validation_loss": held})
    return held


def reference_validation_loss(rd: RunDir, trunk_meta: ModuleMeta | dict, eval_tokens: int, dev, precision: str) -> dict:
    """The validation loss an expert's is compared with: the trunk's own, or the imported base's."""
    trunk_meta = _record(trunk_meta)
    if trunk_meta.validation_loss:
        return trunk_meta.validation_loss
    if trunk_meta.source == "base":
        return base_validation_loss(rd, trunk_meta, eval_tokens, dev, precision)
    return {}
