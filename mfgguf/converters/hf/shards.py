"""safetensors shards written as a stream: every tensor's shape is known before a byte of data, so each shard's
header is written first and the data follows a chunk of rows at a time.

The format is the `safetensors` library's own: an 8-byte little-endian header length, a JSON header
({name: {dtype, shape, data_offsets}}, `__metadata__` {"format": "pt"}, padded with spaces to a
multiple of 8), then the tensors' bytes back to back in header order. Writing it here rather than with
`safetensors.numpy.save_file` (which takes a whole shard's arrays at once, and copies each) keeps
the export to one chunk in memory; the library reads every shard back (`check_shard`). Several shards
get the index `model.safetensors.index.json`, as transformers' `save_pretrained` writes it.

Example:
    >>> shards = plan_shards(tensors, "bf16", max_bytes=4 << 30)
    >>> weight_map = write_shards(tmp, src, shards, "bf16")
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Iterator

import numpy as np

from mfgguf.converters.hf.source import GGUFSource
from mfgguf.converters.hf.target import HFTensor

CHUNK_BYTES = 16 << 20  # f32 bytes of rows dequantized and written at once
DTYPES = {"f32": ("F32", 4), "f16": ("F16", 2), "bf16": ("BF16", 2)}  # --dtype -> safetensors dtype, bytes per value


def nbytes(t: HFTensor, dtype: str) -> int:
    return math.prod(t.shape) * DTYPES[dtype][1]


def plan_shards(tensors: list[HFTensor], dtype: str, max_bytes: int) -> list[list[HFTensor]]:
    """Tensors in order, a new shard whenever the next would take the current one past `max_bytes`."""
    shards: list[list[HFTensor]] = [[]]
    size = 0
    for t in tensors:
        n = nbytes(t, dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def header(tensors: list[HFTensor], dtype: str) -> bytes:
    """The shard's length-prefixed JSON header."""
    h: dict = {"__metadata__": {"format": "pt"}}
    at = 0
    for t in tensors:
        n = nbytes(t, dtype)
        h[t.name] = {"dtype": DTYPES[dtype][0], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's adjacent RoPE pairs -> Hugging Face's rotate-half order: the inverse of base/source.rope_permute.

    w: (heads * head_dim, cols) -> the same shape, the rows of each head reordered."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def chunks(src: GGUFSource, t: HFTensor) -> Iterator[np.ndarray]:
    """Tensor `t`'s rows in order, f32, a chunk at a time (a RoPE-permuted piece whole)."""
    for p in t.pieces:
        if p.heads:
            yield unpermute(src.rows(p.tensor, p.r0, p.r1), p.heads)
            continue
        step = max(1, CHUNK_BYTES // (4 * src.shape(p.tensor)[-1]))
        for r0 in range(p.r0, p.r1, step):
            yield src.rows(p.tensor, r0, min(p.r1, r0 + step))


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """f32 -> the output type; bf16 rounds to nearest even, as torch's `.to(torch.bfloat16)`."""
    x = np.ascontiguousarray(x, np.float32)
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(np.float16)
    u = x.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def write_shard(path: Path, src: GGUFSource, tensors: list[HFTensor], dtype: str) -> int:
    """One shard: header, then each tensor's chunks; fsynced. Its size back."""
    with open(path, "wb") as f:
        f.write(header(tensors, dtype))
        for t in tensors:
            written = 0
            for x in chunks(src, t):
                written += f.write(memoryview(cast(x, dtype)).cast("B"))
            assert written == nbytes(t, dtype), (t.name, written, nbytes(t, dtype))
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def check_shard(path: Path, tensors: list[HFTensor]) -> None:
    """The safetensors library parses the shard and finds every tensor, with its shape."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    want = {t.name: t.shape for t in tensors}
    assert got == want, f"shard {path.name} reads back differently"


def write_shards(out: Path, src: GGUFSource, shards: list[list[HFTensor]], dtype: str) -> tuple[dict[str, str], int]:
    """Every shard into directory `out` (and the index when there are several); (weight map, bytes) back."""
    names = shard_names(len(shards))
    weight_map, total = {}, 0
    for name, tensors in zip(names, shards):
        write_shard(out / name, src, tensors, dtype)
        check_shard(out / name, tensors)
        for t in tensors:
            weight_map[t.name] = name
            total += nbytes(t, dtype)
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map, total
