"""An assembled GGUF as the export reads it: its key-values, and any tensor's rows as f32, read when asked for.

Rows are read with `pread` a chunk at a time and dequantized by gguf-py (every type it knows: f32, f16,
bf16, the legacy and K quants), never memory-mapped, so the export holds one chunk (or one attention
tensor) at a time: touched pages of a mapping would count towards its resident memory. A tensor is
seen as a matrix of rows (numpy's last dimension is the row): `blk.0.ffn_gate_exps.weight` of numpy
shape (experts, ff, dim) is experts x ff rows of dim, expert e's rows are e*ff .. (e+1)*ff. A 1-D
tensor is one row.

Example:
    >>> src = GGUFSource(Path("model.gguf"))
    >>> src.arch, src.kv("granitemoe.expert_count"), src.shape("token_embd.weight")
    >>> x = src.rows("token_embd.weight", 0, 16)  # (16, dim) f32
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mfgguf.base.gguf_source import readable
from mfgguf.base.source import bf16_to_f32, pread_exact
from mfgguf.errors import MfggufError
from mfgguf.gguf.header import read_gguf_header

_MISSING = object()


class GGUFSource:
    """One GGUF file, open for reading; `close()` (or a `with` block) releases it."""

    def __init__(self, path: Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise MfggufError(f"{self.path} does not exist; give the path of an assembled .gguf file")
        self.header = read_gguf_header(self.path)  # mfgguf's parser: a large vocabulary in a fraction of gguf-py's time
        self.tensors = {t.name: t for t in self.header.tensors}
        self.arch = str(self.kv("general.architecture", ""))
        self.types: dict[str, gguf.GGMLQuantizationType] = {}
        verdict: dict[int, bool] = {}  # ggml type -> gguf-py dequantizes it
        for name, t in self.tensors.items():
            if t.ggml_type not in verdict:
                known = t.ggml_type in {q.value for q in gguf.GGMLQuantizationType}
                verdict[t.ggml_type] = known and readable(gguf.GGMLQuantizationType(t.ggml_type))
            if not verdict[t.ggml_type]:
                raise MfggufError(f"{self.path}: tensor {name} is of ggml type {t.ggml_type}, which gguf-py cannot"
                                  " dequantize; assemble the model again with --quant f32, f16 or q8_0")
            self.types[name] = gguf.GGMLQuantizationType(t.ggml_type)
        self.fd = os.open(self.path, os.O_RDONLY)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "GGUFSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def kv(self, key: str, default=_MISSING):
        """A key's value (an array's items as a list); a missing key is `default`, or one line naming it."""
        v = self.header.value(key, _MISSING)
        if v is _MISSING:
            if default is _MISSING:
                raise MfggufError(f"{self.path} has no {key} key; is it a complete GGUF?")
            return default
        return v

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy shape (slowest dimension first) of tensor `name`; a missing tensor is one line naming it."""
        if name not in self.tensors:
            raise MfggufError(f"{self.path} ({self.arch}) has no tensor {name}; is it a complete assembled MoE?")
        return self.tensors[name].shape

    def n_rows(self, name: str) -> int:
        s = self.shape(name)
        return int(np.prod(s[:-1], dtype=np.int64)) if len(s) > 1 else 1

    def rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows r0:r1 of tensor `name` as f32, (r1 - r0, row length)."""
        import gguf

        t, q = self.tensors[name], self.types[name]
        cols = self.shape(name)[-1]
        block, type_size = gguf.GGML_QUANT_SIZES[q]
        row_bytes = cols // block * type_size
        at = self.header.data_offset + t.offset + r0 * row_bytes
        raw = np.frombuffer(pread_exact(self.fd, (r1 - r0) * row_bytes, at, str(self.path)), np.uint8)
        kind = q.name
        if kind == "F32":
            x = raw.view(np.float32)
        elif kind == "F16":
            x = raw.view(np.float16).astype(np.float32)
        elif kind == "BF16":
            x = bf16_to_f32(raw.view(np.uint16))
        else:
            x = gguf.quants.dequantize(raw.reshape(r1 - r0, row_bytes), q).astype(np.float32, copy=False)
        return x.reshape(r1 - r0, cols)
