"""Writing f32 safetensors files the way every module file is written: atomically, one metadata key.

`save_f32` holds every tensor; `save_f32_streamed` writes the same bytes holding one tensor at a time,
for a module too large to hold (the layer-streamed trunk).
"""

from __future__ import annotations

import json
from pathlib import Path

from mfgguf.run.files import atomic_path


def save_f32(path: Path, tensors: dict, tag: str) -> dict[str, list[int]]:
    """Write `tensors` (torch or numpy) as f32 safetensors at `path`, atomically; their shapes."""
    import numpy as np
    from safetensors.numpy import save_file

    arrays = {}
    for k, v in tensors.items():
        if hasattr(v, "detach"):
            v = v.detach().to("cpu").float().contiguous().numpy()
        arrays[k] = np.ascontiguousarray(v, dtype=np.float32)
    with atomic_path(path) as tmp:
        # One metadata key: safetensors writes the metadata map in hash order, so two keys would
        # make the sha256 of bit-identical weights differ from run to run.
        save_file(arrays, str(tmp), metadata={"format": tag})
    return {k: list(a.shape) for k, a in arrays.items()}


def save_f32_streamed(path: Path, shapes: dict[str, tuple], read, tag: str) -> dict[str, list[int]]:
    """`save_f32` where `read(name)` gives one f32 tensor at a time: the same file (tensors in name order,
    one metadata key), built by hand so that only one tensor is ever in memory. Their shapes."""
    import numpy as np

    names = sorted(shapes)
    header, off = {"__metadata__": {"format": tag}}, 0
    for k in names:
        n = 4 * int(np.prod(shapes[k]))
        header[k] = {"dtype": "F32", "shape": list(shapes[k]), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads its header to 8 bytes with spaces
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for k in names:
            a = np.ascontiguousarray(read(k), dtype=np.float32)
            assert a.size == int(np.prod(shapes[k])), k
            if a.size:  # an empty anchor (the seed is the base's whole FFN) has no bytes, and memoryview cannot cast it
                f.write(memoryview(a).cast("B"))
    return {k: list(v) for k, v in shapes.items()}


__all__ = ["save_f32", "save_f32_streamed"]
