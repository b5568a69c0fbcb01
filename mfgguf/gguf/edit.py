"""Edit a finished GGUF without re-assembling it: replace or add key-values, overwrite F32 tensors in place.

A GGUF is header (key-values, tensor infos), padding to the alignment, then the data section,
where each tensor's offset is relative to the data section's start. Key-values can therefore be
changed by writing a new header and copying the data section byte for byte: no tensor is decoded
or requantized, so every weight of the copy is bit-identical to the source. F32 tensors of the
same shape (the router, `ffn_gate_inp`) are then overwritten where they lie.

Example:
    >>> copy_with_kv(Path("model.gguf"), Path("out.gguf"), [("granitemoe.expert_used_count", "UINT32", 2)])
    >>> set_f32(Path("out.gguf"), {"blk.0.ffn_gate_inp.weight": R0})
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.gguf import schema
from mfgguf.gguf.writer import header_bytes

KV = tuple[str, str, object]  # (key, gguf value type name, value), as writer.header_bytes takes them


def _reader(path: Path, mode: str = "r"):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path), mode)
    except Exception as e:  # truncated or corrupt: gguf-py raises assorted errors
        raise MfggufError(f"{path} is not a readable GGUF ({type(e).__name__}: {e}); pass a .gguf written by `mfgguf assemble`") from None


def _span(field) -> tuple[int, int]:
    """(start, end) byte offsets of one key-value or tensor-info record in the file."""
    return field.offset, field.offset + sum(int(p.nbytes) for p in field.parts)


def copy_with_kv(src: Path, dst: Path, updates: list[KV]) -> None:
    """Write `dst`: `src` with the key-values in `updates` replaced (in place in the order) or appended.

    The tensor infos and the data section are copied as bytes; only the header is rebuilt.
    """
    r = _reader(src)
    raw = np.asarray(r.data)  # (file bytes,) uint8, memory-mapped
    new = {k: (k, t, v) for k, t, v in updates}
    kvs: list[bytes] = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        if name in new:
            kvs.append(_kv_bytes(new.pop(name)))
        else:
            a, b = _span(f)
            kvs.append(raw[a:b].tobytes())
    kvs += [_kv_bytes(kv) for kv in new.values()]
    infos = b"".join(raw[slice(*_span(t.field))].tobytes() for t in r.tensors)
    head = schema.GGUF_MAGIC + struct.pack("<IQQ", schema.GGUF_VERSION, len(r.tensors), len(kvs)) + b"".join(kvs) + infos
    align = int(r.alignment)
    head += b"\0" * (-len(head) % align)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fo.write(head)
        fi.seek(r.data_offset)
        shutil.copyfileobj(fi, fo, 1 << 22)


def _kv_bytes(kv: KV) -> bytes:
    """One key-value record as bytes (writer.header_bytes's serialisation, without its 24-byte preamble)."""
    return header_bytes([kv], [])[24:]


def read_kv(path: Path) -> dict:
    """{key: value} of every key-value (arrays as lists)."""
    r = _reader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def read_f32(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    """Copies of F32 tensors by name, numpy shape (ggml dims reversed)."""
    r = _reader(path)
    by = {t.name: t for t in r.tensors}
    out = {}
    for n in names:
        t = _f32(by, n, path)
        out[n] = np.array(t.data, np.float32).reshape(tuple(int(d) for d in t.shape[::-1]))
    return out


def set_f32(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Overwrite F32 tensors of `path` in place with arrays of their exact shape."""
    r = _reader(path, "r+")
    by = {t.name: t for t in r.tensors}
    for n, a in tensors.items():
        t = _f32(by, n, path)
        shape = tuple(int(d) for d in t.shape[::-1])
        if tuple(a.shape) != shape:
            raise MfggufError(f"{n} has shape {shape} in {path}, got {tuple(a.shape)}")
        t.data.reshape(-1)[:] = np.ascontiguousarray(a, np.float32).reshape(-1)
    r.data.flush()
    del r


def write_edited(src: Path, dst: Path, updates: list[KV], tensors: dict[str, np.ndarray], what: str = "the file") -> None:
    """Write `dst`: `src` with the key-values in `updates` and the F32 `tensors` replaced, then read the
    tensors back; a mismatch is an error (`what` names the file in it) and the caller's temporary is dropped."""
    copy_with_kv(src, dst, updates)
    set_f32(dst, tensors)
    got = read_f32(dst, list(tensors))
    if any(not np.array_equal(got[n], tensors[n]) for n in tensors):
        raise MfggufError(f"{what} {dst} did not read back as written; check the disk and retry")


def set_scalar(path: Path, key: str, value) -> None:
    """Overwrite a scalar key-value of `path` in place (same type, so the header keeps its size)."""
    r = _reader(path, "r+")
    f = r.get_field(key)
    if f is None or len(f.data) != 1 or f.types[0] in (schema.VType.STRING, schema.VType.ARRAY):
        raise MfggufError(f"{path} has no scalar key {key}")
    f.parts[f.data[0]][0] = value
    r.data.flush()
    del r


def _f32(by: dict, name: str, path: Path):
    t = by.get(name)
    if t is None:
        raise MfggufError(f"{path} has no tensor {name}")
    if int(t.tensor_type) != schema.QTYPES["f32"].ggml:
        raise MfggufError(f"{name} in {path} is not F32; it cannot be edited in place")
    return t
