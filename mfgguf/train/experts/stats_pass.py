"""The router-statistics pass a layer at a time: one block's weights in memory, never the trunk, never the head.

The pooled second moment (pooled.py) needs, per layer, the FFN inputs of a sample of each expert's
shard: what the model's `hook` sees in Block.forward. Building trunk + expert as one model and
scoring the sample (loop.evaluate) held the whole trunk and computed the head's logits and loss,
which the statistics never use; assembly runs this pass when the statistics are missing or stale,
and assembly streams, never holding a module whole (docs/memory.md).

This pass embeds the sample's windows (evaluate's windows and batches: loop.eval_windows, EVAL_ROWS
positions a forward), then for each layer reads that layer's tensors from the trunk file and from
the expert's (positioned reads, tensor by tensor: no memory map, whose pages would count in the
process's memory), loads them into one Block and runs Block's own forward over every batch, the
hook feeding the statistics; the next layer's tensors replace them. The last layer stops at its
FFN input (Block.ffn_input): its FFN, the final norm and the head are never computed. Only the
sample's hidden states (tokens x dim, f32) stay between layers; a sample larger than HIDDEN_BYTES
is passed in chunks of whole batches, each chunk reading the layers again.

The statistics are those of the in-memory pass: the same windows, the same batches in the same
order per layer, the same weights in the same dtypes under the same autocast (tests/train/experts
compare the two).

The forward is the expert's training forward (route "single"): anchor + the expert.

Example:
    >>> stats = RouterStats(cfg.n_layers, cfg.dim, second_moment=True)
    >>> stream_stats(cfg, rd.module_file(0), load_tokens(rd.shard(1), "shard 1"), 16_384, stats.hook,
    ...              expert_path=rd.module_file(1), precision="bf16")
    16384
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

from mfgguf.config import ModelConfig
from mfgguf.modules.module import read_header
from mfgguf.errors import MfggufError
from mfgguf.gguf.fileio import pread_into
from mfgguf.model import Block, rope_for, trunk_name_map
from mfgguf.train.engine.loop import EVAL_ROWS, autocast, eval_windows
from mfgguf.train.engine.weights import set_param
HIDDEN_BYTES = 128 << 20  # the sample's hidden states (f32) held at once; a larger sample runs in chunks,
#                           each reading every layer again (from the page cache, usually)
EMBED_BYTES = 16 << 20  # rows of the token embedding read at once to gather the sample's rows


@torch.no_grad()
def stream_stats(cfg: ModelConfig, trunk_path: Path, tokens: np.ndarray, max_tokens: int,
                 hook: Callable[[int, torch.Tensor], None], *, expert_path: Path,
                 dev: torch.device = torch.device("cpu"), precision: str = "fp32",
                 hidden_bytes: int = HIDDEN_BYTES) -> int:
    """Call `hook(layer, n)` with the FFN input n (b, win, C) of every layer over evaluate's windows of up to
    `max_tokens` of `tokens`, as `evaluate(model, tokens, max_tokens, route, dev, precision, hook=hook)` would on
    trunk + expert, holding one layer's weights at a time. Returns the tokens measured (0: too short to score)."""
    starts, win = eval_windows(tokens, cfg.ctx_len, max_tokens)
    if not len(starts):
        return 0
    bs = max(1, EVAL_ROWS // win)  # windows a forward, as evaluate batches them
    batches = [starts[b: b + bs] for b in range(0, len(starts), bs)]
    per_chunk = max(1, hidden_bytes // (bs * win * cfg.dim * 4))  # batches whose hidden states are held at once
    cos, sin = rope_for(cfg, win, dev)  # (win, hd/2) each
    trunk = _Tensors(trunk_path, "the trunk")
    expert = _Tensors(expert_path, "the expert")
    try:
        with torch.device("meta"):  # filled layer by layer by _load_layer
            block = Block(cfg, 1)
        for c in range(0, len(batches), per_chunk):
            ids = [np.stack([np.asarray(tokens[s: s + win], dtype=np.int64) for s in b]) for b in batches[c: c + per_chunk]]
            xs = [x.to(dev) for x in _embed(trunk, ids, cfg)]  # each (b, win, C) f32
            for l in range(cfg.n_layers):
                _load_layer(block, l, cfg, trunk, expert, dev, bf16=precision == "bf16")
                for j, x in enumerate(xs):
                    with autocast(precision, dev):
                        if l < cfg.n_layers - 1:
                            xs[j] = block(x, cos, sin, "single", hook, l)  # (b, win, C)
                        else:  # the last layer's FFN feeds nothing the statistics need
                            hook(l, block.ffn_input(x, cos, sin)[1])
            del xs
    finally:
        trunk.close()
        expert.close()
    return sum(len(b) for b in batches) * win


def _load_layer(block: Block, l: int, cfg: ModelConfig, trunk: "_Tensors", expert: "_Tensors", dev: torch.device,
                bf16: bool) -> None:
    """Layer l's tensors into `block`, replacing the previous layer's. Dtypes as expert.build_expert_model gives them:
    the trunk's Linear weights bf16 under bf16, all else f32."""
    linear = {n + ".weight" for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    at = f"layers.{l}."
    names = {n[len(at):]: (trunk, g) for n, g in trunk_name_map(cfg.n_layers, cfg.family).items() if n.startswith(at)}
    names |= {f"experts.0.{f}.weight": (expert, f"blk.{l}.ffn_{f}.weight") for f in ("gate", "up", "down")}
    for name, (src, g) in names.items():
        want = tuple(block.get_parameter(name).shape)
        a = src.get(g)
        if a.shape != want:
            raise MfggufError(f"{src.what} tensor {g} has shape {a.shape}, its config says {want}; retrain it")
        t = to_bf16(a) if bf16 and src is trunk and name in linear else torch.from_numpy(a)
        set_param(block, name, t.to(dev), requires_grad=False)
    if block.router is not None:  # the one expert's row, which a single expert ignores
        set_param(block, "router", torch.zeros(len(block.experts), cfg.dim, device=dev), requires_grad=False)
    if left := [n for n, p in block.named_parameters() if p.is_meta]:
        raise MfggufError(f"no tensor in the module files for layer {l}'s {left[0]}; retrain the modules")


def to_bf16(a: np.ndarray) -> torch.Tensor:
    """f32 `a` rounded to bf16 (nearest, ties to even), bit for bit torch's `.to(torch.bfloat16)` for every number
    (a NaN stays a NaN); in integer ops, where torch's CPU conversion runs an order of magnitude slower."""
    u = a.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    r[np.isnan(a)] = 0x7FC0
    return torch.from_numpy(r).view(torch.bfloat16)


def _embed(trunk: "_Tensors", ids: list[np.ndarray], cfg: ModelConfig) -> list[torch.Tensor]:
    """The token embedding of every batch of `ids` ((b, win) each) as f32 (b, win, C), reading the table a block of
    rows at a time and only the blocks that hold one of the ids."""
    flat = np.concatenate([i.reshape(-1) for i in ids])  # (N,)
    if flat.size and (flat.min() < 0 or flat.max() >= cfg.vocab_size):
        raise MfggufError(f"token id {int(flat.max())} is outside the trunk's vocabulary of {cfg.vocab_size}; re-create"
                          " the run with `mfgguf prepare`")
    out = np.empty((flat.size, cfg.dim), np.float32)  # (N, C)
    rows = max(1, EMBED_BYTES // (cfg.dim * 4))
    for r0 in range(0, cfg.vocab_size, rows):
        sel = (flat >= r0) & (flat < r0 + rows)  # (N,)
        if sel.any():
            out[sel] = trunk.rows("token_embd.weight", r0, min(rows, cfg.vocab_size - r0))[flat[sel] - r0]
    x, at = [], 0
    for i in ids:
        x.append(torch.from_numpy(out[at: at + i.size].reshape(*i.shape, cfg.dim)))  # (b, win, C), a view of out
        at += i.size
    return x


class _Tensors:
    """A module file's f32 tensors by name, each read when asked with positioned reads: no memory map, so the
    process holds what it asked for and nothing of the file beyond."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = Path(path), what
        _, self.entries = read_header(self.path, what)  # checked: every tensor f32, the file as long as its header says
        self.fd = os.open(self.path, os.O_RDONLY)

    def _entry(self, name: str):
        e = self.entries.get(name)
        if e is None:
            raise MfggufError(f"{self.what} ({self.path.name}) lacks tensor {name}; retrain it")
        return e

    def get(self, name: str) -> np.ndarray:
        e = self._entry(name)
        return pread_into(self.fd, np.empty(e.shape, np.float32), e.begin, self._short())

    def rows(self, name: str, r0: int, n: int) -> np.ndarray:  # -> (n, cols) f32: rows r0..r0+n of a matrix
        e = self._entry(name)
        cols = int(np.prod(e.shape[1:]))
        return pread_into(self.fd, np.empty((n, cols), np.float32), e.begin + 4 * r0 * cols, self._short())

    def _short(self) -> str:
        return f"{self.what} ({self.path.name}) is truncated; retrain it"

    def close(self) -> None:
        os.close(self.fd)
