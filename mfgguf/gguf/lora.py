"""A llama.cpp LoRA adapter GGUF read back: the checks llama.cpp makes when it applies one, made first.

llama.cpp pairs `<base tensor>.lora_a` (ggml {in, rank}) with `.lora_b` ({rank, out}) and adds
scale * B @ A @ x to the base tensor's product, scale = user scale * alpha / rank, or the user scale
alone when alpha is 0. When an adapter does not fit the model, llama-cpp-python's failure path ends
the process with a segmentation fault instead of an exception, so `check_adapter` refuses such a file
in one line before llama.cpp sees it. The writer is converters/lora_adapter.py.

Example:
    >>> check_adapter(Path("OUT/lora.gguf"), Path("base.gguf"))
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError

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
