"""Model families mfgguf imports and writes, each declared once as data (as gguf-py's MODEL_TENSORS declares archs).

A family is what differs between llama-like decoders that mfgguf's model computes: the GGUF
architectures it is read from and written as, the Hugging Face classes it comes from, its RoPE
rotation, the per-block tensors it has beyond llama's (biases, Q/K norms), and the GGUF
architectures it brings with what their llama.cpp graphs do (`Arch`: RoPE rotation, shared expert
and its gate, top-k renormalisation, extra keys; gguf/schema.py's tables are derived from these).
Readers, the model, the layout and the writers ask the family, never `if arch == ...`; a new family
is one file here (found by the registry, nothing to add to it) plus the forward's differences in
model.py, and a writer where its MoE graph computes something no existing writer lays out.

Example:
    >>> family("qwen2").moe_layouts
    {'shared-expert': 'qwen2moe', 'folded': 'llama'}
    >>> block_extras(family("qwen2"), n_heads=4, n_kv_heads=2, head_dim=16)["attn_k.bias"]
    (32,)
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from mfgguf.errors import MfggufError
from mfgguf.families.family import Arch, Family


@functools.cache
def _registry() -> dict[str, Family]:
    """Every module of this package that declares a FAMILY, in name order (llama first: the default family)."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "family")
    fams = [importlib.import_module(f"{__name__}.{n}").FAMILY for n in names]
    return {f.name: f for f in sorted(fams, key=lambda f: f.name != "llama")}


@functools.cache
def archs() -> dict[str, Arch]:
    """Every GGUF architecture a family declares, by name; each is declared once."""
    out: dict[str, Arch] = {}
    for f in _registry().values():
        for a in f.archs:
            if a.name in out:
                raise AssertionError(f"architecture {a.name} is declared twice (families {f.name} and another)")
            out[a.name] = a
    return out


def family(name: str) -> Family:
    try:
        return _registry()[name]
    except KeyError:
        raise MfggufError(f"unknown model family {name!r}; mfgguf knows {', '.join(_registry())}") from None


def by_gguf_arch(arch: str) -> Family | None:
    return next((f for f in _registry().values() if f.gguf_arch == arch), None)


def by_hf_arch(archs: list[str]) -> Family | None:
    return next((f for f in _registry().values() for a in archs if a in f.hf_archs), None)


def gguf_archs() -> list[str]:
    return [f.gguf_arch for f in _registry().values()]


def hf_archs() -> list[str]:
    return [a for f in _registry().values() for a in f.hf_archs]


def written_archs() -> tuple[str, ...]:
    """Every architecture `mfgguf assemble` writes: each family's MoE ones and its dense one."""
    return tuple(dict.fromkeys(a for f in _registry().values() for a in (*f.moe_layouts.values(), f.gguf_arch)))


# --layout's earlier values, named for the architecture llama's family writes with them; files and scripts still carry them
OLD_LAYOUTS = {"granitemoe": "shared-expert", "mixtral": "folded"}


def layout_name(layout: str) -> str:
    """A layout by its name, or by its earlier one (OLD_LAYOUTS): the name it has now."""
    return OLD_LAYOUTS.get(layout, layout)


def resolve_layout(f: Family, layout: str) -> str:
    """`auto` (assemble's default) is the family's first MoE layout: shared-expert for llama."""
    return next(iter(f.moe_layouts)) if layout == "auto" else layout_name(layout)


def block_extras(f: Family, *, n_heads: int, n_kv_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """Per-block extra tensors of family `f` as GGUF suffix (`attn_q.bias`) -> numpy shape."""
    size = {"q": n_heads * head_dim, "kv": n_kv_heads * head_dim, "head": head_dim}
    return {name: (size[kind],) for name, kind in f.extras.items()}


def moe_arch(f: Family, layout: str) -> str:
    layout = layout_name(layout)
    if layout not in f.moe_layouts:
        raise MfggufError(f"layout {layout!r} does not hold a {f.name} model; use --layout {' or '.join(f.moe_layouts)}")
    return f.moe_layouts[layout]
