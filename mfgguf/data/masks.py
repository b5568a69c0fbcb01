"""Loss masks: which tokens of a RUN's token file are trained on and scored.

Beside a token file `data/shard_001.npy` (and train.npy, valid/<domain>.npy, test/<domain>.npy) `prepare` may
write `data/shard_001.mask`: an .npy array of uint8, as long as the tokens, 1 where the token is a target the loss
counts (a conversation's assistant turns) and 0 where it is context only (its system and user turns). No mask
file means every token counts: raw text, and every RUN prepared before masks existed, read unchanged. The name
does not end in .npy, so whatever lists a split's `<domain>.npy` files never takes a mask for a domain.

Training applies a mask to a batch's targets: a target whose own token is masked becomes IGNORE_INDEX, which
every loss leaves out and does not count (head_loss.py). `target_mask` cuts the mask windows of the same starts
as the token windows; `mask_targets` applies them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError

SUFFIX = ".mask"


def mask_path(tokens: Path) -> Path:
    """The mask file of a token file: data/shard_001.npy -> data/shard_001.mask."""
    return Path(tokens).with_suffix(SUFFIX)


def load_mask(tokens: Path, n: int | None = None) -> np.ndarray | None:
    """The memory-mapped mask of token file TOKENS (None: none, every token counts); N: the tokens' length."""
    p = mask_path(tokens)
    if not p.is_file():  # raw text, or a RUN from before masks
        return None
    try:
        m = np.load(p, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise MfggufError(f"loss mask {p} is unreadable ({e}); re-create the run with `mfgguf prepare`") from None
    if m.ndim != 1 or m.dtype != np.uint8 or (n is not None and len(m) != n):
        raise MfggufError(f"loss mask {p} does not match its {n} tokens ({m.dtype} {m.shape});"
                          " re-create the run with `mfgguf prepare`")
    return m


def split_masks(split_dir: Path, domains: dict) -> dict:
    """{domain: its loss mask, cut to its tokens} for the domains of a split (RUN/data/<split>/<domain>.npy) that
    have one; `domains` maps each to its tokens (perhaps the first few of them)."""
    masks = {d: load_mask(Path(split_dir) / f"{d}.npy") for d in domains}
    return {d: m[: len(domains[d])] for d, m in masks.items() if m is not None}


def write_mask(path: Path, masks: list, docs: list, order) -> int | None:
    """The mask of DOCS (token arrays) in ORDER, as `write_tokens` wrote them to PATH (each followed by its EOS),
    beside PATH when one of them has one; `masks[i]` is document i's (its EOS's entry last) or None (all ones).
    Returns the tokens it counts, or None where no mask was needed (no file written)."""
    order = list(order)
    if all(masks[i] is None for i in order):
        return None
    lengths = [len(docs[i]) for i in order]
    total = sum(n + 1 for n in lengths)
    arr = np.lib.format.open_memmap(mask_path(path), mode="w+", dtype=np.uint8, shape=(total,))
    pos = 0
    for i, n in zip(order, lengths):
        arr[pos: pos + n + 1] = 1 if masks[i] is None else masks[i]
        pos += n + 1
    arr.flush()
    counted = int(np.count_nonzero(arr))
    del arr
    return counted


def union_masks(token_files: list[Path], n: int) -> np.ndarray | None:
    """The masks of token files each cut to their first N tokens, concatenated (a union of shards); None: no mask."""
    parts = [load_mask(f) for f in token_files]
    if all(p is None for p in parts):
        return None
    return np.concatenate([np.ones(n, np.uint8) if p is None else np.asarray(p[:n]) for p in parts])


def target_mask(mask: np.ndarray, starts, ctx_len: int):
    """(B, T) bool tensor: whether each target of the windows at STARTS counts (window s's targets are tokens
    s+1 .. s+ctx_len, as a batch of ctx_len+1 tokens from s gives them)."""
    import torch

    rows = np.stack([np.asarray(mask[s + 1: s + ctx_len + 1]) for s in starts])  # (B, T)
    return torch.from_numpy(rows != 0)


def mask_targets(y, counted):
    """Targets y (B, T) with IGNORE_INDEX where `counted` (the same shape: bool, or the mask's own 0/1 windows)
    is 0: the batch's targets as the loss sees them."""
    import torch

    from mfgguf.head_loss import IGNORE_INDEX

    counted = torch.as_tensor(counted).to(y.device) != 0
    return y.masked_fill(~counted, IGNORE_INDEX)


def counted_share(part, whole) -> float:
    """The share of WHOLE's counted targets that PART (a micro-batch of its rows) holds: the micro-batch's weight in
    the batch's mean loss. Exactly rows(part) / rows(whole) where nothing is masked."""
    from mfgguf.head_loss import IGNORE_INDEX

    n = int((whole != IGNORE_INDEX).sum())
    if n == whole.numel():
        return part.shape[0] / whole.shape[0]
    return int((part != IGNORE_INDEX).sum()) / max(n, 1)
