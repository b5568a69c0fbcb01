"""Resumable training state: `checkpoints/<module>/state.safetensors` + `state.json`.

state.safetensors holds the trainable parameters and AdamW's moments and step counts, and, in its
header metadata, the whole JSON state (step, loss history, config, trunk sha256, format version).
It is written atomically, so it is the single source of truth: a kill at any moment leaves either
the previous checkpoint or the new one. state.json is a readable mirror written after it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mfgguf.errors import MfggufError, retired
from mfgguf.run import atomic_path, write_json

CKPT_FORMAT = "mfgguf-checkpoint"
CKPT_VERSION = 1
_MOMENTS = ("exp_avg", "exp_avg_sq", "step")
_VOLATILE = ("step", "history", "tokens_seen", "format", "version")  # keys that differ between saves


def _files(d: Path) -> tuple[Path, Path]:
    return Path(d) / "state.safetensors", Path(d) / "state.json"


def save(d: Path, named_params: dict[str, torch.Tensor], opt: torch.optim.Optimizer, state: dict,
         extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write the checkpoint atomically (trainable params, AdamW state, JSON state, and `extra` tensors
    other training state needs back: `load_extra`)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in (extra or {}).items()}
    for name, p in named_params.items():
        tensors[f"param.{name}"] = p.detach().to("cpu").contiguous()
        for k in _MOMENTS:
            v = opt.state.get(p, {}).get(k)
            if v is not None:
                tensors[f"{k}.{name}"] = torch.as_tensor(v).detach().to("cpu").reshape(-1).contiguous()
    state = {"format": CKPT_FORMAT, "version": CKPT_VERSION, **state}
    st, js = _files(d)
    with atomic_path(st) as tmp:
        save_file(tensors, str(tmp), metadata={"state": json.dumps(state)})
    write_json(js, state)


def _same(key: str, saved, now) -> bool:
    """A checkpoint's record matches this training's; a TrainConfig field added after the checkpoint was saved
    matches it at its default (an upgrade does not cost a run in progress its steps), and so does one removed since
    at its off value (a removed option at another value: the removal's one line)."""
    if key == "train" and isinstance(saved, dict) and isinstance(now, dict):
        from dataclasses import fields

        from mfgguf.config import TrainConfig
        from mfgguf.run.records import RETIRED_TRAIN

        saved = dict(saved)
        for n, (flag, off) in RETIRED_TRAIN.items():
            if n in saved and saved.pop(n) != off:
                raise retired("this checkpoint was trained", flag, "start it over without it (--restart)")
        defaults = json.loads(json.dumps({f.name: f.default for f in fields(TrainConfig)}))
        now = {n: v for n, v in now.items() if n in saved or v != defaults.get(n, object())}
    return saved == now


def mismatch(state: dict, expect: dict) -> str | None:
    """The first key of `expect` whose value the checkpoint `state` recorded otherwise (None: it is this training's)."""
    for k, v in expect.items():
        if k not in _VOLATILE and not _same(k, state.get(k), json.loads(json.dumps(v))):  # as JSON: tuples -> lists
            return k
    return None


def _restart_hint(d: Path) -> str:
    return f"pass --restart (restart=True) to delete {d} and start over"


def peek(d: Path) -> dict | None:
    """The JSON state of the checkpoint in `d` (None when there is none or it is unreadable)."""
    st, _ = _files(d)
    if not st.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(st), framework="pt") as f:
            return json.loads((f.metadata() or {})["state"])
    except Exception:
        return None


def load(d: Path, named_params: dict[str, torch.Tensor], opt: torch.optim.Optimizer, expect: dict,
         keep: frozenset[str] = frozenset()) -> dict | None:
    """Restore params and optimizer state from `d` if a checkpoint is there; return its JSON state.

    None when there is no checkpoint. A checkpoint that is unreadable, from another mfgguf, or
    from a different config or trunk (the keys of `expect`) raises MfggufError. Parameters named
    in `keep` keep their current values (a sync round's new shared tensors) but get their AdamW
    moments back.
    """
    st, _ = _files(d)
    if not st.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(st), framework="pt") as f:
            state = json.loads((f.metadata() or {})["state"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for a damaged file
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MfggufError(f"checkpoint {st} is corrupted or unreadable ({msg}); {_restart_hint(d)}") from None
    if state.get("format") != CKPT_FORMAT or state.get("version") != CKPT_VERSION:
        raise MfggufError(f"checkpoint {st} was written by an incompatible mfgguf; {_restart_hint(d)}")
    k = mismatch(state, expect)
    if k is not None:
        raise MfggufError(f"checkpoint {st} is from a different {k} than this training; {_restart_hint(d)}")
    missing = [n for n in named_params if f"param.{n}" not in tensors]
    if missing:
        raise MfggufError(f"checkpoint {st} lacks parameter {missing[0]}; {_restart_hint(d)}")
    with torch.no_grad():
        for name, p in named_params.items():
            src = tensors[f"param.{name}"]
            if src.shape != p.shape:
                raise MfggufError(f"checkpoint {st} has shape {tuple(src.shape)} for {name}; {_restart_hint(d)}")
            if name not in keep:
                p.copy_(src)
            if f"exp_avg.{name}" in tensors:
                opt.state[p] = {
                    "step": tensors[f"step.{name}"].reshape(()).clone(),
                    "exp_avg": tensors[f"exp_avg.{name}"].reshape(p.shape).to(p.device, p.dtype),
                    "exp_avg_sq": tensors[f"exp_avg_sq.{name}"].reshape(p.shape).to(p.device, p.dtype),
                }
    return state


def load_extra(d: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's `extra` tensors whose names start with `prefix` (none when there is no checkpoint;
    `load` has already checked that one is readable and this training's)."""
    st, _ = _files(d)
    if not st.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(st), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def remove(d: Path) -> None:
    """Delete a module's checkpoint directory (after its module file is written, or on --restart)."""
    shutil.rmtree(d, ignore_errors=True)
