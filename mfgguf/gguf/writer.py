"""The GGUF header assembly writes: every tensor's slot (type, shape, offset), and the header's bytes.

The header is serialized before any weight is read, so the writers only fill the slots (layout.py
lays them out; extend.py writes a new file's header the same way).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from mfgguf.gguf import schema
from mfgguf.gguf.fileio import pwrite_all
from mfgguf.gguf.schema import VType



@dataclass
class Slot:
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # numpy order (slowest first); ggml dims are reversed
    qtype: str
    why: str | None  # why the type differs from the requested one
    offset: int = 0  # relative to the start of the data section
    nbytes: int = 0
    n_expert: int = 0  # stacked expert tensor: expert p's bytes at offset + p * expert_bytes
    written: int = 0  # bytes written so far (the writer's own accounting)

    @property
    def expert_bytes(self) -> int:
        return self.nbytes // self.n_expert if self.n_expert else 0

    @property
    def row_bytes(self) -> int:
        return schema.QTYPES[self.qtype].row_bytes(self.shape[-1])



# ---- GGUF header serialization -------------------------------------------------------------------

_SCALAR = {VType.UINT8: "<B", VType.INT8: "<b", VType.UINT16: "<H", VType.INT16: "<h", VType.UINT32: "<I",
           VType.INT32: "<i", VType.FLOAT32: "<f", VType.BOOL: "<?", VType.UINT64: "<Q", VType.INT64: "<q",
           VType.FLOAT64: "<d"}


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(vt: VType, v) -> bytes:
    if vt == VType.STRING:
        return _str(v)
    return struct.pack(_SCALAR[vt], v)


def header_bytes(kv: list[tuple[str, str, object]], slots: list[Slot]) -> bytes:
    """GGUF v3 header: key-values and tensor infos (not padded). Array values are (item type, list)."""
    out = [schema.GGUF_MAGIC, struct.pack("<IQQ", schema.GGUF_VERSION, len(slots), len(kv))]
    for key, vt, v in kv:
        vt = VType[vt]
        out += [_str(key), struct.pack("<I", vt)]
        if vt == VType.ARRAY:
            it, items = v
            it = VType[it]
            out.append(struct.pack("<IQ", it, len(items)))
            if it == VType.STRING:
                out += [_str(x) for x in items]
            else:
                out.append(np.asarray(items, dtype=_SCALAR[it]).tobytes())
        else:
            out.append(_value(vt, v))
    for s in slots:
        dims = s.shape[::-1]  # ggml order: fastest first
        out += [_str(s.name), struct.pack("<I", len(dims)), struct.pack(f"<{len(dims)}Q", *dims),
                struct.pack("<IQ", schema.QTYPES[s.qtype].ggml, s.offset)]
    return b"".join(out)


def write_header(fd: int, header: bytes, data_offset: int) -> None:
    """The header at offset 0 of `fd`, zeros up to `data_offset`."""
    at = pwrite_all(fd, np.frombuffer(header, np.uint8), 0)
    pwrite_all(fd, np.zeros(data_offset - at, np.uint8), at)
