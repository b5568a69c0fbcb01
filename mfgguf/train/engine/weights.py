"""A module file's tensors as torch tensors, one at a time, with plain reads.

Trainers load the trunk and experts with this rather than safetensors' loader: no memory map, so
the process's RSS holds one tensor beyond what the model keeps.

Example:
    >>> ffn = {k: t for k, t in read_safetensors(rd.module_file(1)) if k.startswith("blk.")}
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

import torch

from mfgguf.config import ModelConfig
from mfgguf.errors import MfggufError
from mfgguf.model import Transformer, seed_name_map, trunk_model, trunk_name_map

ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}  # safetensors dtype -> torch


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time with plain reads: no memory map, so RSS holds one tensor."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        for name, h in header.items():
            if name == "__metadata__":
                continue
            b, e = h["data_offsets"]
            dtype = ST_DTYPES[h["dtype"]]
            if e == b:
                yield name, torch.empty(h["shape"], dtype=dtype)
                continue
            f.seek(base + b)
            buf = bytearray(e - b)
            f.readinto(buf)
            yield name, torch.frombuffer(buf, dtype=dtype).reshape(h["shape"])


def set_param(model: torch.nn.Module, name: str, value: torch.Tensor, requires_grad: bool) -> None:
    """Parameter `name` of `model` becomes `value` itself (no copy): how a model built on the meta device is filled."""
    mod, _, pname = name.rpartition(".")
    model.get_submodule(mod)._parameters[pname] = torch.nn.Parameter(value, requires_grad=requires_grad)


def trunk_alone(trunk_path: Path, cfg: ModelConfig, dev) -> tuple[Transformer, str]:
    """(the trunk as it runs alone: anchor, + its seed FFN if it has one, read from `trunk_path`, its route).

    Built on the meta device and filled a tensor at a time as the file is read, so the f32 trunk is held once:
    a randomly initialised model beside a whole state dict held it three times over at the peak."""
    with torch.device("meta"):
        model, route = trunk_model(cfg)
    by_gguf = {g: n for n, g in (trunk_name_map(cfg.n_layers, cfg.family) | seed_name_map(cfg.n_layers)).items()}
    for g, t in read_safetensors(trunk_path):
        if g in by_gguf:
            set_param(model, by_gguf[g], t.to(dev, torch.float32), requires_grad=True)
    for n, p in model.named_parameters():
        if p.is_meta:  # the seed's router row (one expert: its weight is 1 whatever the row) is in no file
            if not n.endswith(".router"):
                raise MfggufError(f"trunk file {trunk_path} lacks tensor {n}; retrain or re-import the trunk")
            set_param(model, n, torch.zeros(p.shape, device=dev), requires_grad=False)
    return model, route
