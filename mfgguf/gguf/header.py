"""Parse a GGUF header back into the (key, type, value) list and tensor infos that layout.header_parts writes.

`mfgguf extend` rewrites a finished file's header: every key-value is read back in order, in the
form `layout.header_parts` serializes, so that a header re-serialized unchanged is the same bytes.
A file of mfgguf 0.1, which carried the router statistics as base64 key-values (schema.RS_OLD_BLOBS),
is refused in one line as its header is read (`check_not_v01`).

Example:
    >>> h = read_gguf_header(Path("model.gguf"))
    >>> h.value("general.architecture"), h.tensors[0].name, h.data_offset
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError, Outdated
from mfgguf.gguf.schema import ALIGNMENT, GGUF_MAGIC, RS_OLD_BLOBS, VType

_FMT = {VType.UINT8: "<B", VType.INT8: "<b", VType.UINT16: "<H", VType.INT16: "<h", VType.UINT32: "<I",
        VType.INT32: "<i", VType.FLOAT32: "<f", VType.BOOL: "<?", VType.UINT64: "<Q", VType.INT64: "<q",
        VType.FLOAT64: "<d"}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest first)
    ggml_type: int
    offset: int  # relative to the data section

    @property
    def nbytes(self) -> int:
        """Its bytes in the file, by ggml's block sizes (gguf-py's table: every type ggml has, a foreign base's too).
        A type ggml does not have raises ValueError."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return math.prod(self.shape) // block * size


@dataclass
class Header:
    kv: list[tuple[str, str, object]]  # as layout.header_parts takes them; arrays are (item type, items)
    tensors: list[TensorInfo]
    data_offset: int
    size: int  # the file's size

    def value(self, key: str, default=None):
        return kv_value(self.kv, key, default)

    def tensors_end(self) -> int:
        """The byte where the last tensor ends; past `size`, the file is truncated. ValueError for an unknown type."""
        return max((self.data_offset + t.offset + t.nbytes for t in self.tensors), default=self.data_offset)


def kv_value(kv: list[tuple[str, str, object]], key: str, default=None):
    """The value of `key` in a (key, type, value) list as header_bytes takes it; an array's items; else `default`."""
    for k, _, v in kv:
        if k == key:
            return v[1] if isinstance(v, tuple) else v
    return default


class _Reader:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.at, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.at + n > len(self.buf):
            raise MfggufError(f"{self.path} ends inside its GGUF header; it is truncated")
        b = self.buf[self.at:self.at + n]
        self.at += n
        return b

    def scalar(self, vt: VType):
        fmt = _FMT[vt]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar(VType.UINT64))).decode("utf-8")


def read_gguf_header(path: Path) -> Header:
    """The header of GGUF `path`: key-values (in order), tensor infos, data offset. One line on damage."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise MfggufError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        f.seek(0)
        import mmap

        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                return _parse(_Reader(buf, path), size)
            except (ValueError, UnicodeDecodeError, struct.error) as e:
                raise MfggufError(f"{path} has a damaged GGUF header ({e})") from None
            finally:
                buf.release()


def check_not_v01(path: Path, key: str) -> None:
    """Refuse a GGUF of mfgguf 0.1 at its first key of router statistics in the header (schema.RS_OLD_BLOBS)."""
    if key in RS_OLD_BLOBS:
        raise Outdated(f"{path} was assembled by mfgguf 0.1 (router statistics in its header); re-assemble it with"
                       " `mfgguf assemble`")


def _parse(r: _Reader, size: int) -> Header:
    r.take(4)
    version, n_tensors, n_kv = struct.unpack("<IQQ", r.take(20))
    if version != 3:
        raise MfggufError(f"{r.path} is GGUF version {version}; mfgguf reads version 3")
    kv = []
    for _ in range(n_kv):
        key = r.string()
        check_not_v01(r.path, key)
        vt = VType(r.scalar(VType.UINT32))
        if vt == VType.ARRAY:
            it = VType(r.scalar(VType.UINT32))
            n = r.scalar(VType.UINT64)
            if it == VType.STRING:
                items = [r.string() for _ in range(n)]
            elif it in _FMT:
                items = np.frombuffer(r.take(n * struct.calcsize(_FMT[it])), _FMT[it]).tolist()
            else:
                raise MfggufError(f"{r.path}: key {key} is an array of {it.name}, which mfgguf does not write")
            kv.append((key, "ARRAY", (it.name, items)))
        elif vt == VType.STRING:
            kv.append((key, "STRING", r.string()))
        else:
            kv.append((key, vt.name, r.scalar(vt)))
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        nd = r.scalar(VType.UINT32)
        dims = struct.unpack(f"<{nd}Q", r.take(8 * nd))
        t, off = struct.unpack("<IQ", r.take(12))
        tensors.append(TensorInfo(name, tuple(int(d) for d in dims[::-1]), t, off))
    align = next((v for k, _, v in kv if k == "general.alignment"), ALIGNMENT)
    return Header(kv, tensors, (r.at + align - 1) // align * align, size)
