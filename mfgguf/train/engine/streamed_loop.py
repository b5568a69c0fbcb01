"""The training loop around a StreamedTrunk: the same driver as `run_loop` (batches, schedule, held-out
curve), a checkpoint at every step (the update committed as it is written), and the wsd branch point read
from the store one tensor at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from mfgguf.config import ModelConfig, TrainConfig
from mfgguf.errors import MfggufError
from mfgguf.train.engine.driver import LoopResult, train_steps
from mfgguf.train.engine.loop import eval_windows
from mfgguf.train.engine.offload import Slot, load_state
from mfgguf.train.engine.records import Drive

from mfgguf.train.engine.streamed import StreamedTrunk


def init_from_seed(cfg: ModelConfig, seed: int) -> Callable[[Slot], torch.Tensor]:
    """The initial value of each tensor, drawn in model order exactly as `Transformer.reset_parameters`
    draws them (norms are ones), one tensor in memory at a time."""
    g = torch.Generator().manual_seed(seed)
    std = 0.02

    def init(slot: Slot) -> torch.Tensor:
        t = torch.ones(slot.shape)
        if len(slot.shape) == 2:
            s = std / math.sqrt(2 * cfg.n_layers) if slot.name.endswith(("attn_output.weight", "down.weight")) else std
            t.normal_(0.0, s, generator=g)
        return t

    return init


def streamed_loop(trunk: StreamedTrunk, data: np.ndarray, tc: TrainConfig, drive: Drive, *, ckpt_meta: dict,
                  branch_path=None) -> LoopResult:
    """`run_loop` for a StreamedTrunk: the same driver, batches, schedule and held-out curve; every step
    is a checkpoint. `branch_path`: where a wsd run keeps its branch point (branch.py)."""
    impl = StreamedSteps(trunk, tc, ckpt_meta, branch_path)
    res = train_steps(impl, data, tc, drive, ctx_len=trunk.cfg.ctx_len)
    res.io_per_step = impl.io or [0, 0]
    return res


class StreamedSteps:
    """A StreamedTrunk's step for the driver (driver.Steps): forward and backward, then the update on its
    own thread, overlapped with the next step's forward, and committed as the checkpoint once written."""

    def __init__(self, trunk: StreamedTrunk, tc: TrainConfig, ckpt_meta: dict, branch_path=None):
        self.trunk, self.store, self.tc, self.ckpt_meta = trunk, trunk.store, tc, ckpt_meta
        self.branch_path = branch_path
        self.io: list[int] | None = None  # [bytes read, bytes written] by the last step
        self._issued = False  # this step's update was started by settle()
        self._bytes = (0, 0)

    def resume(self) -> dict | None:
        store, cfg = self.store, self.trunk.cfg
        state = load_state(store.root)
        if state is None:
            store.create(init_from_seed(cfg, self.tc.seed))
            state = {**self.ckpt_meta, "step": 0, "set": "a", "history": [], "validation_history": []}
            store.commit(state)
        for k, v in self.ckpt_meta.items():
            if state.get(k) != v:
                raise MfggufError(f"streamed checkpoint {store.root} is from a different {k} than this training;"
                                  " pass --restart (restart=True) to delete it and start over")
        self.trunk.set = state["set"]
        return state

    def step(self, step: int, x, y, lr: float) -> float:
        self._bytes, self._issued = (self.store.bytes_read, self.store.bytes_written), False
        return self.trunk.step(x, y, step, lr, self.tc)

    def settle(self) -> None:
        self.trunk.update(wait=True)  # the curve point scores the updated weights
        self._issued = True

    def checkpoint(self, step: int, state: dict, last: bool) -> None:
        state = {**self.ckpt_meta, **state}
        if self._issued:
            self.store.commit({**state, "set": self.trunk.set})
        else:
            self.trunk.update(commit=state)  # overlaps the next step's forward
        self.io = [self.store.bytes_read - self._bytes[0], self.store.bytes_written - self._bytes[1]]

    def branch(self, step: int, state: dict) -> None:
        """The branch point from the store's current set, one tensor at a time (P, M, V = weight and moments)."""
        if self.branch_path is None:
            return
        if step and not self._issued:
            self.settle()
        from mfgguf.train.whole.branch import save_branch

        where = {s.name: (u, s) for u in self.trunk.units for s in u.slots}
        region = {"param": "P", "exp_avg": "M", "exp_avg_sq": "V"}

        def read(part: str, name: str) -> np.ndarray:
            u, s = where[name]
            return self.store.read(u.name, self.trunk.set, region[part], s)

        save_branch(self.branch_path, {n: s.shape for n, (u, s) in where.items()}, read,
                    {**self.ckpt_meta, **state, "adam_step": step})

    def finish(self) -> None:
        self.trunk.join()


def streamed_validation_losses(trunk: StreamedTrunk, test_dir, max_tokens: int, budget_tokens: int) -> dict:
    """{domain: mean loss} like `validation_losses` (a loss mask's counted targets only), forward-streamed in groups
    of windows."""
    from pathlib import Path

    from mfgguf.data.masks import load_mask, target_mask
    from mfgguf.train.engine.loop import load_tokens

    out = {}
    for f in sorted(Path(test_dir).glob("*.npy")):
        tokens = load_tokens(f, f"held-out tokens of {f.stem}")
        mask = load_mask(f, len(tokens))
        starts, win = eval_windows(tokens, trunk.cfg.ctx_len, max_tokens)
        if not len(starts):
            continue
        per = max(1, budget_tokens // win)
        total, count = 0.0, 0
        for b in range(0, len(starts), per):
            rows = np.stack([np.asarray(tokens[s : s + win + 1], dtype=np.int64) for s in starts[b : b + per]])
            w = torch.from_numpy(rows)
            losses = trunk.token_losses(w[:, :-1], w[:, 1:]).double()  # (b * win,)
            keep = torch.ones_like(losses, dtype=torch.bool) if mask is None else \
                target_mask(mask, starts[b : b + per], win).reshape(-1).to(losses.device)
            total += float(losses[keep].sum())
            count += int(keep.sum())
        if count:
            out[f.stem] = total / count
    return out
