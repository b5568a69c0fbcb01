"""A LoRA adapter as llama.cpp loads it: a GGUF of `general.type` = adapter beside a dense base GGUF.

This is what a practitioner serves instead of experts: one adapter per domain on one base, chosen
per request (llama-server's `lora` field, llama-cpp-python's `lora_path`). llama.cpp pairs
`<base tensor>.lora_a` (ggml {in, rank}) with `.lora_b` ({rank, out}) and adds
scale * B @ A @ x to the base tensor's product, scale = user scale * alpha / rank, or the user
scale alone when alpha is 0. The adapters written here carry peft's alpha / rank already folded
into B, so alpha is 0 and the user's `--lora-scale 1` is the trained adapter exactly, whatever
the rank of each pair (the joined anchor + seed FFN pairs have twice the attention's rank).

Example:
    >>> write_lora_adapter(Path("OUT/lora.gguf"), "llama", {"blk.0.attn_q.weight.lora_a": a, ...})
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.run import atomic_path

SUFFIXES = (".lora_a", ".lora_b")


def check_pairs(tensors: dict[str, np.ndarray]) -> None:
    """Every base tensor has both halves, of matching rank: a (rank, in), b (out, rank) in numpy order."""
    bases = {k[: -len(s)] for k in tensors for s in SUFFIXES if k.endswith(s)}
    if len(bases) * 2 != len(tensors):
        raise MfggufError("a LoRA adapter's tensors must all end in .lora_a or .lora_b, in pairs")
    for b in sorted(bases):
        a_, b_ = tensors.get(b + ".lora_a"), tensors.get(b + ".lora_b")
        if a_ is None or b_ is None or a_.ndim != 2 or b_.ndim != 2 or a_.shape[0] != b_.shape[1]:
            raise MfggufError(f"LoRA pair {b} is incomplete or its ranks differ; re-train the adapter")


def write_lora_adapter(path: Path, arch: str, tensors: dict[str, np.ndarray], *, name: str = "mfgguf-lora") -> Path:
    """Write `tensors` (GGUF names of the dense base + .lora_a/.lora_b, F32) as a llama.cpp LoRA adapter GGUF."""
    from gguf import GGUFType, GGUFWriter, Keys

    check_pairs(tensors)
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


def _kv_str(reader, key: str) -> str | None:
    f = reader.fields.get(key)
    return None if f is None else bytes(f.parts[-1]).decode("utf-8", "replace")


def check_adapter(adapter: Path, model: Path) -> None:
    """Refuse, in one line, an adapter llama.cpp would not apply to `model` (its failures there crash the process).

    The checks llama.cpp makes when it loads an adapter: general.type, adapter.type, the architecture, and
    every pair's shapes against the model tensor it adapts."""
    from gguf import GGUFReader

    try:
        a, m = GGUFReader(str(adapter)), GGUFReader(str(model))
    except (ValueError, OSError) as e:
        raise MfggufError(f"cannot read the LoRA adapter {adapter} ({e}); pass a llama.cpp adapter GGUF") from None
    what = f"the LoRA adapter {adapter}"
    fix = "; `train-base --mode lora` writes one (OUT/lora.gguf) for the base's `assemble --experts none` file"
    if _kv_str(a, "general.type") != "adapter" or _kv_str(a, "adapter.type") != "lora":
        raise MfggufError(f"{what} is not a LoRA adapter GGUF (general.type {_kv_str(a, 'general.type')!r}){fix}")
    arch, want = _kv_str(a, "general.architecture"), _kv_str(m, "general.architecture")
    if arch != want:
        raise MfggufError(f"{what} is for a {arch} model, {model} is {want}{fix}")
    shapes = {t.name: [int(x) for x in t.shape] for t in m.tensors}  # ggml order {ne0, ne1}
    ad = {t.name: [int(x) for x in t.shape] for t in a.tensors}
    for name, sa in ad.items():
        if not name.endswith(".lora_a"):
            continue
        base, sb = name[: -len(".lora_a")], ad.get(name[: -len(".lora_a")] + ".lora_b")
        if base not in shapes or sb is None or shapes[base][0] != sa[0] or shapes[base][1] != sb[1] or sa[1] != sb[0]:
            raise MfggufError(f"{what} does not fit {model}: its pair for {base} has another shape or no such"
                              f" tensor there{fix}")
