"""A llama.cpp LoRA adapter GGUF read back: the checks llama.cpp makes when it applies one, made first.

llama.cpp pairs `<base tensor>.lora_a` (ggml {in, rank}) with `.lora_b` ({rank, out}) and adds
scale * B @ A @ x to the base tensor's product, scale = user scale * alpha / rank, or the user scale
alone when alpha is 0. When an adapter does not fit the model, llama-cpp-python's failure path ends
the process with a segmentation fault instead of an exception, so `check_adapter` refuses such a file
in one line before llama.cpp sees it. The writer is modules/lora_adapter.py.

Example:
    >>> check_adapter(Path("OUT/lora.gguf"), Path("base.gguf"))
"""

from __future__ import annotations

from pathlib import Path

from mfgguf.errors import MfggufError
from mfgguf.gguf.header import read_gguf_header

SUFFIXES = (".lora_a", ".lora_b")


def check_pairs(shapes: dict[str, tuple[int, ...]]) -> None:
    """Every base tensor has both halves, of matching rank: shapes in numpy order, a (rank, in), b (out, rank)."""
    bases = {k[: -len(s)] for k in shapes for s in SUFFIXES if k.endswith(s)}
    if len(bases) * 2 != len(shapes):
        raise MfggufError("a LoRA adapter's tensors must all end in .lora_a or .lora_b, in pairs")
    for b in sorted(bases):
        a_, b_ = shapes.get(b + ".lora_a"), shapes.get(b + ".lora_b")
        if a_ is None or b_ is None or len(a_) != 2 or len(b_) != 2 or a_[0] != b_[1]:
            raise MfggufError(f"LoRA pair {b} is incomplete or its ranks differ; re-train the adapter")


def check_adapter(adapter: Path, model: Path) -> None:
    """Refuse, in one line, an adapter llama.cpp would not apply to `model` (its failures there crash the process).

    The checks llama.cpp makes when it loads an adapter: general.type, adapter.type, the architecture, and
    every pair's shapes against the model tensor it adapts. Both headers are read by our own parser: gguf-py's
    reader decodes a whole vocabulary first, seconds for a real base, on every load."""
    a, m = read_gguf_header(adapter), read_gguf_header(model)
    what = f"the LoRA adapter {adapter}"
    fix = "; `train-base --mode lora` writes one (OUT/lora.gguf) for the base's `assemble --experts none` file"
    kind = a.value("general.type")
    if kind != "adapter" or a.value("adapter.type") != "lora":
        raise MfggufError(f"{what} is not a LoRA adapter GGUF (general.type {kind!r}){fix}")
    arch, want = a.value("general.architecture"), m.value("general.architecture")
    if arch != want:
        raise MfggufError(f"{what} is for a {arch} model, {model} is {want}{fix}")
    ad = {t.name: tuple(t.shape) for t in a.tensors}  # numpy order: a (rank, in), b (out, rank)
    check_pairs(ad)
    shapes = {t.name: tuple(t.shape) for t in m.tensors}  # numpy order: (out, in)
    for name, sa in ad.items():
        if not name.endswith(".lora_a"):
            continue
        base = name[: -len(".lora_a")]
        if shapes.get(base) != (ad[base + ".lora_b"][0], sa[1]):
            raise MfggufError(f"{what} does not fit {model}: its pair for {base} has another shape or no such"
                              f" tensor there{fix}")
