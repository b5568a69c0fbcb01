"""Merge the experts' trained copies of trunk tensors back into the trunk, one row chunk at a time.

An expert trained with `train-expert --shared CHOICE` holds, next to its FFNs, its private
trained copy of some trunk tensors (`shared.<trunk GGUF name>`, listed in its JSON as
`shared_tensors`). For every trunk tensor that at least one included expert has a copy of,
assembly writes the merged tensor instead of the trunk's:

  mean  trunk + sum_i w_i (copy_i - trunk), w_i = tokens_seen_i / sum of tokens_seen over the
        experts that hold this tensor (the token-weighted mean of the copies)
  none  copies ignored: the trunk as trained

Memory: the streaming merge (`merged_chunks`) holds one chunk of MERGE_CHUNK_BYTES of one tensor
from the trunk, one expert and the accumulators at a time, whatever the number of experts; it
preads each expert's rows at offsets known from the safetensors header, every copy once. The whole-array form (`merge_arrays`,
used by the PyTorch reference) runs the very same row functions, so both give the same bits.

Example:
    >>> merge_arrays("mean", trunk, [c1, c2], tokens=[100, 300])  # trunk + .25 (c1-t) + .75 (c2-t)
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator, Sequence

import numpy as np

from mfgguf.errors import MfggufError, retired
from mfgguf.run import SHARED_PREFIX
from mfgguf.gguf.fileio import pread_into, truncated

MERGES = ("none", "mean")
MERGE_CHUNK_BYTES = 1 << 20  # f32 bytes of one tensor per step; the f64 accumulators keep a few times this live


# ---- the arithmetic, on (rows, cols) f32 arrays ----------------------------------------------------


def mean_rows(trunk: np.ndarray, copies: Iterable[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """trunk + sum_i w_i (copy_i - trunk), accumulated in f64 in the order given. (rows, cols) f32."""
    t = trunk.astype(np.float64)
    acc = np.zeros_like(t)  # (rows, cols)
    for c, w in zip(copies, weights, strict=True):
        acc += w * (c - t)
    return (t + acc).astype(np.float32)


def token_weights(tokens: Sequence[int]) -> list[float]:
    s = float(sum(tokens))
    return [t / s for t in tokens]


def merge_rows(method: str, trunk: np.ndarray, copies: Iterable[np.ndarray], tokens: Sequence[int]) -> np.ndarray:
    """Merged (rows, cols) f32 rows; `copies` yields each expert's same rows, in expert order."""
    if method == "mean":
        return mean_rows(trunk, copies, token_weights(tokens))
    raise AssertionError(method)


def merge_arrays(method: str, trunk: np.ndarray, copies: list[np.ndarray], tokens: Sequence[int] = ()) -> np.ndarray:
    """Merge whole tensors (any shape; a 1-D tensor is one row). For the reference and tests.

    Example:
        >>> merge_arrays("mean", trunk, [c1, c2, c3], tokens=[1, 1, 2])
    """
    if method == "none" or not copies:
        return trunk
    shape = trunk.shape
    rows = lambda a: np.asarray(a, np.float32).reshape(-1, shape[-1] if shape else 1)  # noqa: E731
    out = merge_rows(method, rows(trunk), (rows(c) for c in copies), tokens or [1] * len(copies))
    return out.reshape(shape)


# ---- which tensors are merged (plan time: metadata and headers only) -------------------------------


def check_shared(mod, trunk_shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The trunk tensors module `mod` (layout.Module) holds a copy of, checked; raises a one-line error."""
    listed = mod.meta.shared_tensors
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
        raise MfggufError(f"module {mod.name}: shared_tensors in its metadata is not a list of tensor names; retrain it")
    held = {k[len(SHARED_PREFIX):] for k in mod.entries if k.startswith(SHARED_PREFIX)}
    if mod.meta.shared_merged:  # `mfgguf sync` already merged its copies into the trunk
        if held:
            raise MfggufError(f"module {mod.name} says its shared copies are merged but holds {SHARED_PREFIX}{min(held)};"
                              " run `mfgguf sync RUN` again or retrain it")
        return []
    for name in listed:
        if name not in trunk_shapes:
            raise MfggufError(f"module {mod.name} lists shared tensor {name}, which is not a trunk tensor; retrain it")
        e = mod.entries.get(SHARED_PREFIX + name)
        if e is None:
            raise MfggufError(f"module {mod.name} lists shared tensor {name} but holds no {SHARED_PREFIX}{name}; retrain it")
        if e.shape != trunk_shapes[name]:
            raise MfggufError(f"module {mod.name}: tensor {SHARED_PREFIX}{name} has shape {list(e.shape)},"
                              f" the trunk's is {list(trunk_shapes[name])}; retrain it")
    extra = sorted(held - set(listed))
    if extra:
        raise MfggufError(f"module {mod.name} holds {SHARED_PREFIX}{extra[0]} that its metadata does not list"
                          " in shared_tensors; retrain it")
    return listed


def merge_plan(mods: list, trunk_shapes: dict[str, tuple[int, ...]], method: str) -> dict[str, list[int]]:
    """{trunk tensor name: [expert positions holding a copy]} in trunk order; validates every module."""
    if method == "ties":
        raise retired("merging", "--merge ties", "use --merge mean or none")
    if method not in MERGES:
        raise MfggufError(f"unknown merge {method!r}; choose one of {', '.join(MERGES)}")
    by_name: dict[str, list[int]] = {}
    for pos, m in enumerate(mods):
        for name in check_shared(m, trunk_shapes):
            by_name.setdefault(name, []).append(pos)
            if method == "mean" and not (isinstance(m.meta.tokens_seen, int) and m.meta.tokens_seen > 0):
                raise MfggufError(f"module {m.name} records no tokens_seen, which --merge mean weights its copies by;"
                                  " retrain it or use --merge none")
    if method == "none":
        return {}
    return {n: by_name[n] for n in trunk_shapes if n in by_name}


# ---- streaming ------------------------------------------------------------------------------------


def merged_chunks(name: str, trunk, experts: list, chunk_bytes: int = MERGE_CHUNK_BYTES, *,
                  method: str) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (first row, merged (rows, cols) f32) for trunk tensor `name`, reading row chunks with pread.

    `trunk` and `experts` are layout.Modules (experts: only those holding a copy). Each file is
    opened once per tensor and checked to be the file the plan read (size, mtime) before use.
    """
    te = trunk.entries[name]
    cols = te.shape[-1] if te.shape else 1
    rows = (te.end - te.begin) // 4 // cols
    step = max(1, chunk_bytes // (cols * 4))
    tokens = [int(m.meta.tokens_seen or 0) for m in experts]
    fds = []
    try:
        for m in [trunk, *experts]:
            fds.append(open_checked(m))
        buf = np.empty(step * cols, np.float32)  # one expert's rows at a time
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            t = np.empty((n, cols), np.float32)
            pread_into(fds[0], t, te.begin + r0 * cols * 4, truncated(trunk))

            def copies() -> Iterator[np.ndarray]:
                for fd, m in zip(fds[1:], experts):
                    x = buf[: n * cols].reshape(n, cols)
                    pread_into(fd, x, m.entries[SHARED_PREFIX + name].begin + r0 * cols * 4, truncated(m))
                    yield x

            yield r0, merge_rows(method, t, copies(), tokens)
    finally:
        for fd in fds:
            os.close(fd)


def open_checked(mod) -> int:
    """A read-only fd of module `mod` (layout.Module), checked to be the file the plan read and the
    stream pass hashed (same size and mtime)."""
    fd = os.open(mod.path, os.O_RDONLY)
    st = os.fstat(fd)
    if (st.st_size, st.st_mtime_ns) != (mod.size, mod.mtime_ns):
        os.close(fd)
        raise MfggufError(f"module {mod.name} ({mod.path.name}) changed during assembly; assemble again")
    return fd
