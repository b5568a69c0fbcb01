"""What every base-model reader gives the importer: the base's shape, and its tensors one at a time.

A reader (gguf_source.py, hf_source.py) presents the base in llama.cpp's own terms: GGUF tensor
names (`token_embd.weight`, `blk.{l}.attn_q.weight`, `blk.{l}.ffn_gate.weight`, ...), numpy
row-major shapes (torch's layout), Q and K rows in llama.cpp's adjacent-pair RoPE order, every
tensor as f32. Tensors are read from the file with `pread` when asked for, never memory-mapped,
so the importer holds one tensor at a time (a mapping's touched pages would count towards RSS).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.families import block_extras, family
from mfgguf.gguf.fileio import read_at

TOKEN_UNUSED = 5  # llama.cpp's llama_token_type for padding rows ([PAD{i}]), as convert_hf_to_gguf.py writes them


@dataclass(frozen=True)
class BaseShape:
    dim: int  # residual width
    n_layers: int  # transformer blocks
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads
    ff: int  # hidden width of the base's SwiGLU
    vocab_size: int  # rows of token_embd (the tokenizer may be padded to it)
    rope_theta: float  # RoPE base frequency
    norm_eps: float  # RMSNorm epsilon
    ctx_len: int  # the base's context length
    tied: bool  # no output.weight of its own: the output head is token_embd
    family: str = "llama"  # mfgguf/families/: rotation, extra per-block tensors, GGUF architectures
    rope_freq_factors: tuple[float, ...] = ()  # Llama 3.x: per-pair RoPE frequency divisors (llama.cpp's rope_freqs)
    head_dim: int = 0  # a head width other than dim / n_heads (Qwen3); 0 = dim / n_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def check(self, what: str) -> None:
        """Refuse a shape mfgguf's model cannot compute exactly."""
        if (self.dim % self.n_heads and not self.head_dim) or self.n_heads % self.n_kv_heads:
            raise MfggufError(f"{what}: {self.n_heads} heads / {self.n_kv_heads} KV heads do not divide width {self.dim};"
                              " mfgguf's model needs head_dim = dim / n_heads and n_heads a multiple of n_kv_heads")
        if self.hd % 2:
            raise MfggufError(f"{what}: head_dim {self.hd} is odd; RoPE needs an even head_dim")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the importer reads, in GGUF names, and its numpy shape (output.weight is token_embd's
        copy when tied)."""
        hd, C = self.hd, self.dim
        extras = block_extras(family(self.family), n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=hd)
        s = {"token_embd.weight": (self.vocab_size, C), "output_norm.weight": (C,), "output.weight": (self.vocab_size, C)}
        for l in range(self.n_layers):
            b = f"blk.{l}."
            s.update({b + "attn_norm.weight": (C,), b + "attn_q.weight": (self.n_heads * hd, C),
                      b + "attn_k.weight": (self.n_kv_heads * hd, C), b + "attn_v.weight": (self.n_kv_heads * hd, C),
                      b + "attn_output.weight": (C, self.n_heads * hd), b + "ffn_norm.weight": (C,),
                      b + "ffn_gate.weight": (self.ff, C), b + "ffn_up.weight": (self.ff, C), b + "ffn_down.weight": (C, self.ff)})
            s.update({b + x: shape for x, shape in extras.items()})
        return s


def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's rotate-half row order -> llama.cpp's adjacent pairs: convert_hf_to_gguf.py's LlamaModel.permute.

    w: (n_head * head_dim, dim) -> the same shape, rows of each head reordered.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (exact: bf16 is f32's upper half)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def pread_exact(fd: int, n: int, offset: int, what: str) -> bytearray:
    """`n` bytes of an open file at `offset` (a bytearray, so numpy views of it are writable)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = read_at(fd, view[got:], offset + got)
        if k <= 0:
            raise MfggufError(f"{what} is truncated (wanted {n} bytes at offset {offset}); the file is damaged")
        got += k
    return buf
