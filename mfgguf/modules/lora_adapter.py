"""A LoRA adapter as llama.cpp loads it: a GGUF of `general.type` = adapter beside a dense base GGUF.

This is what a practitioner serves instead of experts: one adapter per domain on one base, chosen
per request (llama-server's `lora` field, llama-cpp-python's `lora_path`). The adapters written here
carry peft's alpha / rank already folded into B, so alpha is 0 and the user's scale 1 is the trained
adapter exactly, whatever the rank of each pair (the joined anchor + seed FFN pairs have twice the
attention's rank: train/whole/adapter.py). gguf/lora.py reads them back.

Example:
    >>> write_lora_adapter(Path("OUT/lora.gguf"), "llama", {"blk.0.attn_q.weight.lora_a": a, ...})
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mfgguf.gguf.lora import check_pairs
from mfgguf.run import atomic_path

ADAPTER_FILE = "lora.gguf"  # `train-base --mode lora` writes its adapter here in OUT, beside the merged RUN


def write_lora_adapter(path: Path, arch: str, tensors: dict[str, np.ndarray], *, name: str = "mfgguf-lora") -> Path:
    """Write `tensors` (GGUF names of the dense base + .lora_a/.lora_b, F32) as a llama.cpp LoRA adapter GGUF."""
    from gguf import GGUFType, GGUFWriter, Keys

    check_pairs({k: v.shape for k, v in tensors.items()})
    with atomic_path(Path(path)) as tmp:
        w = GGUFWriter(str(tmp), arch)
        w.add_type(GGUFType.ADAPTER)
        w.add_name(name)
        w.add_string(Keys.Adapter.TYPE, "lora")
        w.add_float32(Keys.Adapter.LORA_ALPHA, 0.0)  # scale folded into B: the user's scale is the whole scale
        for k in sorted(tensors):
            w.add_tensor(k, np.ascontiguousarray(tensors[k], dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return Path(path)
