"""A GGUF of a known family (families/: `llama`, `qwen2`) as a base model: its shape from the key-values, its
tensors read one by one.

Weights may be of any type gguf-py dequantizes (f32, f16, bf16, q4_0 ... q8_0, the K-quants, the
i-quants; tensor by tensor, into f32); attn_q and attn_k are already in llama.cpp's RoPE row order. A llama file's `rope_freqs.weight` (Llama 3.x)
becomes the trunk's RoPE frequency factors.
A quantized base imports as the function its file computes: the trunk holds the dequantized
weights, so an f32 assembly of it matches the quantized file up to llama.cpp's activation
rounding. What mfgguf's model cannot compute exactly is refused with one line naming it: another architecture, rope scaling
(or a `rope_freqs` tensor outside llama), a tensor the family does not have, a mixture of experts, a head_dim
other than dim / n_heads.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.families import by_gguf_arch, gguf_archs
from mfgguf.base.source import BaseShape, bf16_to_f32, pread_exact

PLAIN_TYPES = ("F32", "F16", "BF16")  # read as they are; every other type goes through gguf-py's dequantizer


def readable(qtype) -> bool:
    """Whether gguf-py dequantizes this gguf.GGMLQuantizationType (its public API has no list: ask it)."""
    import gguf

    if qtype.name in PLAIN_TYPES:
        return True
    try:
        _, nbytes = gguf.GGML_QUANT_SIZES[qtype]  # (elements, bytes) of one block
        gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), qtype)
    except (KeyError, NotImplementedError, TypeError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class BaseTensor:
    """One tensor of the base file, as its header describes it."""

    name: str
    shape: tuple[int, ...]  # numpy order (slowest first)
    qtype: object  # gguf.GGMLQuantizationType
    data_offset: int  # absolute, in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class GGUFBase:
    """A base model in one GGUF file (a known family's dense architecture)."""

    kind = "gguf"

    def __init__(self, path: Path):
        import gguf

        from mfgguf.gguf.header import read_gguf_header

        self.path = Path(path)
        what = f"base {self.path.name}"
        try:  # our parser, not gguf-py's reader: that one takes seconds over a real base's vocabulary
            self.header = read_gguf_header(self.path)
            self.tensors = {t.name: BaseTensor(t.name, t.shape, gguf.GGMLQuantizationType(t.ggml_type),
                                               self.header.data_offset + t.offset, t.nbytes) for t in self.header.tensors}
        except (MfggufError, ValueError) as e:  # a damaged or foreign file; ValueError: a type ggml does not have
            raise MfggufError(f"{self.path} is not a readable GGUF file, damaged or truncated ({e}); fetch or copy it"
                              " again") from None
        if (end := self.header.tensors_end()) > self.header.size:
            raise MfggufError(f"{self.path} is not a readable GGUF file, damaged or truncated (its tensors end at byte"
                              f" {end:,}, the file at {self.header.size:,}); fetch or copy it again")
        arch = self._kv("general.architecture", what)
        fam = by_gguf_arch(arch)
        if fam is None:
            raise MfggufError(f"{what} has architecture {arch!r}; import-base reads dense"
                              f" {', '.join(f'`{a}`' for a in gguf_archs())} GGUFs only")
        self.arch = a = arch
        if int(self._kv(f"{a}.expert_count", what, 0) or 0):
            raise MfggufError(f"{what} is a mixture of experts; import-base reads dense models only")
        scaling = self._kv(f"{a}.rope.scaling.type", what, "none")
        if scaling not in ("none", None):
            raise MfggufError(f"{what} uses rope scaling {scaling!r}, which mfgguf's model does not compute")
        n_heads = int(self._kv(f"{a}.attention.head_count", what))
        dim = int(self._kv(f"{a}.embedding_length", what))
        key_len = int(self._kv(f"{a}.attention.key_length", what, dim // n_heads)) if fam.free_head_dim else 0
        factors: tuple[float, ...] = ()
        if (rf := self.tensors.pop("rope_freqs.weight", None)) is not None:
            if not fam.rope_freqs or rf.qtype.name != "F32" or rf.n_elements != (key_len or dim // n_heads) // 2:
                raise MfggufError(f"{what} has a rope_freqs tensor of {rf.n_elements} {rf.qtype.name}, which"
                                  f" mfgguf's model does not compute; it reads {(key_len or dim // n_heads) // 2} F32 factors of a llama")
            factors = tuple(float(x) for x in self._raw(rf).view(np.float32))
        verdict: dict[str, bool] = {}
        tied = "output.weight" not in self.tensors
        emb = self.tensors.get("token_embd.weight")
        if emb is None:
            raise MfggufError(f"{what} has no token_embd.weight tensor")
        self.shape = BaseShape(
            dim=dim, n_layers=int(self._kv(f"{a}.block_count", what)), n_heads=n_heads,
            n_kv_heads=int(self._kv(f"{a}.attention.head_count_kv", what, n_heads)),
            ff=int(self._kv(f"{a}.feed_forward_length", what)), vocab_size=emb.shape[0],
            rope_theta=float(self._kv(f"{a}.rope.freq_base", what, 10000.0)),
            norm_eps=float(self._kv(f"{a}.attention.layer_norm_rms_epsilon", what)),
            ctx_len=int(self._kv(f"{a}.context_length", what)), tied=tied, family=fam.name, rope_freq_factors=factors,
            head_dim=key_len if key_len != dim // n_heads else 0)
        self.shape.check(what)
        hd = self.shape.hd
        for key in (f"{a}.rope.dimension_count", f"{a}.attention.key_length", f"{a}.attention.value_length"):
            v = self._kv(key, what, hd)
            if int(v) != hd:
                raise MfggufError(f"{what}: {key} is {v}, not the head width {hd}; mfgguf's model cannot compute it")
        want = self.shape.expected_shapes()
        for name, t in self.tensors.items():
            if name not in want:
                raise MfggufError(f"{what} has tensor {name}, which mfgguf's model has no place for")
            if t.shape != want[name]:
                raise MfggufError(f"{what}: tensor {name} has shape {list(t.shape)}, expected {list(want[name])}")
            kind = t.qtype.name
            if kind not in verdict:
                verdict[kind] = readable(t.qtype)
            if not verdict[kind]:
                raise MfggufError(f"{what}: tensor {name} is {kind}, which gguf-py {gguf_version()} cannot dequantize;"
                                  f" convert the base to f16 or q8_0 with llama.cpp's llama-quantize first")
        missing = [n for n in want if n not in self.tensors and not (n == "output.weight" and tied)]
        if missing:
            raise MfggufError(f"{what} has no tensor {missing[0]}")

    def _kv(self, key: str, what: str, default=MfggufError):
        """A key's value; a missing key is `default`, or one line naming it when there is none."""
        v = self.header.value(key, MfggufError)
        if v is MfggufError:
            if default is MfggufError:
                raise MfggufError(f"{what} has no {key} key; is it a complete GGUF?")
            return default
        return v

    @property
    def tokenizer_json(self) -> Path | None:
        return None  # a GGUF-only base tokenizes through llama.cpp (base/runbase.py, `base_tokenizer`)

    def tensor(self, name: str) -> np.ndarray:
        """One f32 tensor (numpy shape, llama.cpp row order), read from the file now."""
        import gguf

        if name == "output.weight" and self.shape.tied:
            name = "token_embd.weight"
        t = self.tensors[name]
        shape, raw = t.shape, self._raw(t)
        kind = t.qtype.name
        if kind == "F32":
            return raw.view(np.float32).reshape(shape)
        if kind == "F16":
            return raw.view(np.float16).astype(np.float32).reshape(shape)
        if kind == "BF16":
            return bf16_to_f32(raw.view(np.uint16)).reshape(shape)
        rows = raw.reshape(int(np.prod(shape[:-1])), -1)  # (rows, bytes per row)
        return gguf.quants.dequantize(rows, t.qtype).astype(np.float32, copy=False).reshape(shape)

    def _raw(self, t: BaseTensor) -> np.ndarray:
        """A tensor's bytes, read from the file now."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return np.frombuffer(pread_exact(fd, t.n_bytes, t.data_offset, f"base {self.path.name}"), np.uint8)
        finally:
            os.close(fd)

    def write_vocab(self, path: Path) -> None:
        """A vocab-only GGUF (every key-value of the base, no tensors): llama.cpp loads it with vocab_only."""
        import gguf

        w = gguf.GGUFWriter(str(path), self.arch)
        for name, vt, v in self.header.kv:
            if name == "general.architecture":
                continue
            if vt == "ARRAY":  # (item type, items)
                w.add_key_value(name, v[1], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType[v[0]])
            else:
                w.add_key_value(name, v, gguf.GGUFValueType[vt])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()


def gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"
