"""The task draws of llama.cpp's `llama-perplexity`, so a Python scorer picks the very tasks, in the same order.

llama-perplexity seeds `std::mt19937 rng(1)` for every benchmark and draws:
  - HellaSwag: always (also when every task is asked for), one task at a time from those left, with
    `std::uniform_int_distribution<size_t>(0, left - 1)`. That distribution is the C++ library's own: this
    is libstdc++'s (GCC 11 and later: Lemire's nearly divisionless reduction of one 32-bit draw, drawn again
    when it lands in the biased sliver), the library llama.cpp is built with on Linux. libc++ (clang on
    macOS) draws differently, and then so does llama-perplexity there;
  - WinoGrande and the multiple-choice format: only when fewer tasks are asked than the file holds, as
    `j = int(scale * rng() * left)` in float32 arithmetic (scale = 1 / (1 + 2^32)) over a list of the
    indices left, the one drawn swapped with the last and dropped.

Example:
    >>> hellaswag_order(10, 3)
    [4, 9, 6]
"""

from __future__ import annotations

import numpy as np

_N, _M = 624, 397
_MATRIX, _UPPER, _LOWER = 0x9908B0DF, 0x80000000, 0x7FFFFFFF
_MASK32 = 0xFFFFFFFF


class MT19937:
    """std::mt19937 seeded with one integer (`init_genrand`), its 32-bit outputs one call at a time."""

    def __init__(self, seed: int = 1):
        mt = [seed & _MASK32]
        for i in range(1, _N):
            mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & _MASK32)
        self._mt, self._i = mt, _N

    def _twist(self) -> None:
        mt = self._mt
        for i in range(_N):
            y = (mt[i] & _UPPER) | (mt[(i + 1) % _N] & _LOWER)
            mt[i] = mt[(i + _M) % _N] ^ (y >> 1) ^ (_MATRIX if y & 1 else 0)
        self._i = 0

    def __call__(self) -> int:
        if self._i >= _N:
            self._twist()
        y = self._mt[self._i]
        self._i += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)


def uniform_below(rng: MT19937, n: int) -> int:
    """libstdc++'s `uniform_int_distribution<size_t>(0, n - 1)(rng)` for a 32-bit generator (Lemire's reduction)."""
    product = rng() * n  # a 64-bit product of two 32-bit numbers
    low = product & _MASK32
    if low < n:
        threshold = ((1 << 32) - n) % n  # (-n) % n in 32-bit unsigned arithmetic
        while low < threshold:
            product = rng() * n
            low = product & _MASK32
    return product >> 32


def hellaswag_order(n_tasks: int, n_drawn: int) -> list[int]:
    """The file indices of the tasks llama-perplexity's --hellaswag scores, in its order, for a file of `n_tasks`."""
    rng, left, order = MT19937(1), list(range(n_tasks)), []
    for _ in range(min(n_drawn, n_tasks)):
        order.append(left.pop(uniform_below(rng, len(left))))
    return order


def float_draw_order(n_tasks: int, n_drawn: int) -> list[int]:
    """The file indices --winogrande and --multiple-choice score: the file's order when every task is asked for
    (`n_drawn` 0 or at least `n_tasks`), else llama-perplexity's float32 draw without replacement."""
    if n_drawn <= 0 or n_drawn >= n_tasks:
        return list(range(n_tasks))
    rng, aux, order = MT19937(1), list(range(n_tasks)), []
    scale = np.float32(1.0) / (np.float32(1.0) + np.float32(_MASK32))  # 2^-32, as float32
    for _ in range(n_drawn):
        j = int(np.float32(scale * np.float32(rng())) * np.float32(len(aux)))
        j = min(j, len(aux) - 1)  # a draw that rounds up to 1.0 would index past the end in C++ (undefined there)
        order.append(aux[j])
        aux[j] = aux[-1]
        aux.pop()
    return order


__all__ = ["MT19937", "float_draw_order", "hellaswag_order", "uniform_below"]
