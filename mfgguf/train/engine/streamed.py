"""Train the trunk in bounded memory: one unit (embedding rows, one block, a head row block) in RAM.

The model's state lives in a `ParamStore` (offload.py). A step streams:
  1. forward, block by block: only block-boundary activations are kept (the next block is read
     on a thread while this one computes);
  2. the head in vocabulary chunks: a first pass for the log-sum-exp, a second for the gradients
     of the output rows and of the last activations;
  3. backward, last block first, recomputing inside the block; each block's gradients go to its
     gradient file, their norms are kept;
  4. the update: with the global gradient norm now known (the same clipping as
     `clip_grad_norm_`), AdamW (torch's own functional `adamw`) runs piece by piece over every
     tensor, reading the current set and writing the other -- on its own thread, while the next
     step's forward follows it unit by unit (`update`, `_wait`).
The step's batch is cut into micro-batches inside each block ("accumulation"): the block's weights
are read once per step whatever the batch, so a larger batch amortises the I/O.

Same training as `run_loop`: the batch at each step, the init, AdamW's arithmetic and the clipping
are the in-memory run's, so the two agree within float rounding (tests/train/engine/test_streamed.py).
The loop around it (checkpoints, resume, the held-out curve) is streamed_loop.py.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from torch.optim.adamw import adamw

from mfgguf.config import ModelConfig, TrainConfig
from mfgguf.head_loss import IGNORE_INDEX
from mfgguf.errors import MfggufError
from mfgguf.model import Block, RMSNorm, rope_for
from mfgguf.train.engine.loop import LOGITS_CHUNK, autocast
from mfgguf.train.engine.offload import ParamStore, Slot, Unit

PIECE = 1 << 22  # f32 elements per piece of the update pass (4 bytes each, per array)
HEAD_ROWS = 4096  # vocabulary rows of the output head read and applied at once (x dim f32)
BASELINE = 400 << 20  # bytes a process needs before any tensor: python, torch, the tokens' mmap


def block_bytes(cfg: ModelConfig, tokens: int) -> int:
    """Peak bytes of one block's forward+backward over `tokens` tokens (bf16/f32 mix, as trunk.py estimates)."""
    return tokens * 4 * (12 * cfg.dim + 3 * (cfg.anchor_ff + (cfg.expert_ff if cfg.seed_expert else 0)) * 2)


def streamed_bytes(cfg: ModelConfig, units: list[Unit], batch: int, micro: int, spill: bool = False) -> int:
    """Estimated peak RSS of a streamed step: baseline, two blocks' weights and one's gradients,
    update pieces, kept activations (every block's input, unless `spill` sends them to a scratch
    file), the head's input and gradients, and one micro-batch inside a block."""
    unit = max(u.numel for u in units if u.name.startswith("blk.")) * 4
    act = batch * cfg.ctx_len * cfg.dim * 4  # one (B, T, C) f32 activation
    bounds = (4 if spill else cfg.n_layers + 3) * act
    head = 3 * 4 * LOGITS_CHUNK  # a chunk of logits, its bf16 copy and softmax
    return BASELINE + 3 * unit + 8 * PIECE * 4 + bounds + head + block_bytes(cfg, micro * cfg.ctx_len)


def plan_micro(cfg: ModelConfig, units: list[Unit], batch: int, budget: int) -> tuple[int, bool]:
    """(the largest micro-batch, a divisor of `batch`, whose step fits `budget` bytes; whether the
    block inputs must be spilled to disk for it), preferring to keep them in memory."""
    for spill in (False, True):
        for m in sorted((d for d in range(1, batch + 1) if batch % d == 0), reverse=True):
            if streamed_bytes(cfg, units, batch, m, spill) <= budget:
                return m, spill
    need = streamed_bytes(cfg, units, batch, 1, True)
    raise MfggufError(f"a streamed step of batch {batch} needs about {need / 2**30:.2f} GiB, more than the"
                      f" --memory-budget of {budget / 2**30:.2f} GiB; raise the budget or lower --batch-size")


class StreamedTrunk:
    """The trunk computed from a ParamStore, one unit at a time (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, route: str, store: ParamStore, dev: torch.device, precision: str,
                 micro: int, spill: bool = False):
        self.cfg, self.route, self.store, self.dev, self.prec, self.micro = cfg, route, store, dev, precision, micro
        self.spill = spill  # block inputs go to a scratch file instead of RAM (large accumulated batches)
        self.units = list(store.units.values())
        self.blocks = [u for u in self.units if u.name.startswith("blk.")]
        self.block = Block(cfg, n_experts=1 if route == "single" else 0).to(dev)  # workspace: parameters re-pointed
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps).to(dev)
        for p in [*self.block.parameters(), *self.norm.parameters()]:
            p.data = torch.empty(0, device=dev)  # the workspace owns no weights of its own
        self.set = "a"
        # The update of step s runs on its own thread while step s+1's forward follows it unit by unit:
        # `_ready[unit]` is set once that unit's new state is on disk (see `update`).
        self._updater = ThreadPoolExecutor(1, thread_name_prefix="mfgguf-update")
        self._pending: Future | None = None
        self._ready: dict[str, threading.Event] = {}
        self._todo: tuple | None = None
        self._last: np.ndarray | None = None  # the last block's weights after a forward: the backward starts with them

    # ---- helpers ----------------------------------------------------------------------------------

    def _t(self, a: np.ndarray, shape) -> torch.Tensor:
        return torch.from_numpy(a).view(shape).to(self.dev)

    def _point(self, unit: Unit, flat: np.ndarray) -> None:
        """Re-point the block workspace's parameters at `flat` (one unit's P region)."""
        prefix = f"layers.{unit.name.split('.')[1]}."
        params = dict(self.block.named_parameters())
        for s in unit.slots:
            p = params[s.name[len(prefix):]]
            p.data = self._t(flat[s.offset : s.offset + s.numel], s.shape)
            p.grad = None

    def _mbs(self, n: int):
        return [slice(i, min(n, i + self.micro)) for i in range(0, n, self.micro)]

    def _wait(self, unit: str) -> None:
        """Block until the pending update has written `unit`'s new state (no-op when none is pending)."""
        ev, pending = self._ready.get(unit), self._pending
        while ev is not None and not ev.wait(1.0):
            if pending is not None and pending.done() and pending.exception() is not None:
                raise pending.exception()  # an update that failed raises here instead of hanging the step

    def _read_params(self, unit: str) -> Future:
        """The unit's current parameters, read on the reader thread once the pending update wrote them."""
        return self.store.submit(lambda: (self._wait(unit), self.store.read(unit, self.set, "P"))[1])

    def _blocks_forward(self, x: torch.Tensor, cos, sin, keep: list | None) -> torch.Tensor:
        """x: (B, T, C) -> the last block's output; `keep` collects each block's input."""
        fut = self._read_params(self.blocks[0].name)
        for i, unit in enumerate(self.blocks):
            flat = fut.result()
            if i + 1 < len(self.blocks):
                fut = self._read_params(self.blocks[i + 1].name)
            self._point(unit, flat)
            if keep is not None:
                keep.append(self._stash(i, x))
            with torch.no_grad(), autocast(self.prec, self.dev):
                x = torch.cat([self.block(x[m], cos, sin, self.route, None, i) for m in self._mbs(len(x))])
        self._last = flat  # the last block's weights: the backward starts with them
        return x

    def _stash(self, i: int, x: torch.Tensor):
        """Keep block i's input for the backward: the tensor itself, or its place in the scratch file."""
        if not self.spill:
            return x
        self.store.write_scratch(x.detach().cpu().numpy().reshape(-1), i * x.numel())
        return (i * x.numel(), x.shape)

    def _unstash(self, kept) -> "Future | torch.Tensor":
        if not self.spill:
            return kept
        off, shape = kept
        return self.store.submit(lambda: torch.from_numpy(self.store.read_scratch(int(np.prod(shape)), off)).view(shape))

    def _head_chunks(self):
        """(row0, rows, rows of output.weight in the compute dtype) over the vocabulary, read one chunk ahead."""
        self._wait("head")
        w = self.store.units["head"].slot("output.weight")
        step = min(w.rows, HEAD_ROWS)
        starts = list(range(0, w.rows, step))
        fut = self.store.prefetch("head", self.set, "P", w, starts[0], min(step, w.rows))
        for k, r0 in enumerate(starts):
            rows = min(step, w.rows - r0)
            cur = fut.result()
            if k + 1 < len(starts):
                fut = self.store.prefetch("head", self.set, "P", w, starts[k + 1], min(step, w.rows - starts[k + 1]))
            yield r0, rows, self._t(cur, (rows, w.row)).to(self._cdt)

    def _token_blocks(self, n: int, rows: int):
        per = max(1, LOGITS_CHUNK // rows)  # tokens per block: a (block, rows) logits tile stays small
        return [slice(i, min(n, i + per)) for i in range(0, n, per)]

    @property
    def _cdt(self) -> torch.dtype:  # what autocast computes the head's matmuls in
        return torch.bfloat16 if self.prec == "bf16" else torch.float32

    def _lse(self, h: torch.Tensor, y: torch.Tensor):
        """h: (N, C) normalised, y: (N,) -> (log-sum-exp (N,), target logit (N,)) over the vocabulary.

        The vocabulary in chunks of HEAD_ROWS rows (each read once), the tokens in blocks under
        each: the cost is linear in N (chunks sized by N made it quadratic: docs/memory.md)."""
        N = h.shape[0]
        hb = h.to(self._cdt)  # cast once, as autocast casts the in-memory head's input once
        m = torch.full((N,), -math.inf, device=self.dev)
        s = torch.zeros(N, device=self.dev)
        tgt = torch.zeros(N, device=self.dev)
        for r0, rows, w in self._head_chunks():
            for b in self._token_blocks(N, rows):
                z = (hb[b] @ w.T).float()  # (n, rows)
                m_new = torch.maximum(m[b], z.max(-1).values)
                s[b] = s[b] * torch.exp(m[b] - m_new) + torch.exp(z - m_new[:, None]).sum(-1)
                m[b] = m_new
                yb = y[b]
                hit = (yb >= r0) & (yb < r0 + rows)
                tgt[b][hit] = z[hit, yb[hit] - r0]
        return m + torch.log(s), tgt

    def _norm_weight(self) -> torch.Tensor:
        self._wait("head")
        head = self.store.units["head"]
        s = head.slot("output_norm.weight")
        return self._t(self.store.read("head", self.set, "P", s), s.shape)

    # ---- evaluation -------------------------------------------------------------------------------

    @torch.no_grad()
    def token_losses(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """idx, targets: (B, T) -> per-token cross-entropy (B*T,), forward only."""
        B, T = idx.shape
        cos, sin = rope_for(self.cfg, T, self.dev)
        x = self._embed(idx)[0]
        x = self._blocks_forward(x, cos, sin, None)
        self.norm.weight.data = self._norm_weight()
        h = self.norm(x.reshape(B * T, -1))
        lse, tgt = self._lse(h, targets.reshape(-1).to(self.dev))
        return lse - tgt

    def _embed(self, idx: torch.Tensor):
        """idx (B, T) -> ((B, T, C) rows of the embedding, unique ids, inverse index)."""
        ids, inv = torch.unique(idx, return_inverse=True)
        self._wait("embd")
        slot = self.store.units["embd"].slot("tok_embd.weight")
        rows = torch.from_numpy(self.store.read_rows("embd", self.set, slot, ids.numpy())).to(self.dev)  # (U, C)
        return rows[inv.to(self.dev)], ids, inv

    # ---- one training step ------------------------------------------------------------------------

    def step(self, idx: torch.Tensor, targets: torch.Tensor, step: int, lr: float, tc: TrainConfig) -> float:
        """Forward and backward of one batch (gradients to the gradient files, norms kept); returns
        its mean loss. `update()` then applies AdamW."""
        B, T = idx.shape
        N = B * T
        cos, sin = rope_for(self.cfg, T, self.dev)
        x0, ids, inv = self._embed(idx)
        keep: list[torch.Tensor] = []
        xL = self._blocks_forward(x0, cos, sin, keep)  # keep[l]: input of block l, (B, T, C)
        del x0
        sq: dict[str, torch.Tensor] = {}  # squared gradient norm per tensor
        xr = xL.reshape(N, -1).detach().requires_grad_()  # the head's input, with autograd
        del xL
        loss, dx = self._head_backward(xr, targets, sq)
        del xr
        dx = self._blocks_backward(keep, dx.view(B, T, -1), cos, sin, sq)

        # embedding: the gradient of the rows this batch used (every other row's is zero)
        ge = torch.zeros(len(ids), self.cfg.dim, device=self.dev).index_add_(0, inv.reshape(-1).to(self.dev),
                                                                            dx.reshape(N, -1))  # (U, C)
        sq["tok_embd.weight"] = ge.pow(2).sum()
        del dx

        # clip exactly as torch.nn.utils.clip_grad_norm_, then AdamW tensor by tensor
        order = [s.name for u in self.units for s in u.slots]
        total = torch.linalg.vector_norm(torch.stack([sq[n].sqrt() for n in order]))
        coef = float(torch.clamp(tc.grad_clip / (total + 1e-6), max=1.0))
        self._todo = (step, lr, tc, coef, ids.numpy(), ge.cpu())
        return loss

    def _head_backward(self, xr: torch.Tensor, targets: torch.Tensor, sq: dict) -> tuple[float, torch.Tensor]:
        """The head on the last activations `xr` (N, C): the normalised input with autograd, then the two
        vocabulary passes; the batch's mean loss and the gradient of `xr`."""
        N = xr.shape[0]
        self.norm.weight.data = self._norm_weight()
        self.norm.weight.requires_grad_()
        with autocast(self.prec, self.dev):
            hn = self.norm(xr)  # (N, C)
        h = hn.detach()
        y = targets.reshape(-1).to(self.dev)
        keep = y != IGNORE_INDEX  # (N,): a target at IGNORE_INDEX (a loss mask's context) neither counts nor sends gradient
        n = max(int(keep.sum()), 1)  # the mean is over the counted targets
        y = y.clamp_min(0)
        lse, tgt = self._lse(h, y)
        loss = float(torch.where(keep, lse - tgt, 0.0).sum()) / n
        head = self.store.units["head"]
        w_slot = head.slot("output.weight")
        sq_out = torch.zeros((), device=self.dev)
        hb = h.to(self._cdt)
        dh = torch.zeros_like(h)  # (N, C) f32
        for r0, rows, w in self._head_chunks():
            gw = torch.zeros(rows, w.shape[1], device=self.dev)  # (rows, C) f32
            for b in self._token_blocks(N, rows):
                z = (hb[b] @ w.T).float()  # (n, rows)
                g = torch.exp(z - lse[b, None])  # softmax over the vocabulary, this chunk's columns
                yb = y[b]
                hit = (yb >= r0) & (yb < r0 + rows)
                g[hit, yb[hit] - r0] -= 1.0
                g = (g * keep[b, None] / n).to(self._cdt)  # d(mean CE)/dz, cast as autograd casts the .float()
                gw += (g.T @ hb[b]).float()
                dh[b] += (g @ w).float()
            sq_out += gw.pow(2).sum()
            self.store.write("head", "grad", "P", gw.cpu().numpy().reshape(-1), w_slot, r0)
        sq["output.weight"] = sq_out
        hn.backward(dh)
        gn = self.norm.weight.grad
        sq["output_norm.weight"] = gn.pow(2).sum()
        self.store.write("head", "grad", "P", gn.cpu().numpy().copy(), head.slot("output_norm.weight"))
        dx = xr.grad
        self.norm.weight.grad = None
        del h, hn
        return loss, dx

    def _blocks_backward(self, keep: list, dx: torch.Tensor, cos, sin, sq: dict) -> torch.Tensor:
        """The blocks, last first, recomputed micro-batch by micro-batch; the gradient of the embedding's output."""
        B = dx.shape[0]
        if self.spill:
            self.store.flush_writes()  # the scratch file holds every block input before it is read back
        x_next = self._unstash(keep.pop())
        for i in reversed(range(len(self.blocks))):
            unit = self.blocks[i]
            flat = self._last if i == len(self.blocks) - 1 else fut.result()
            x = x_next.result().to(self.dev) if self.spill else x_next
            if i > 0:
                fut = self.store.prefetch(self.blocks[i - 1].name, self.set, "P")  # written: the forward waited for it
                x_next = self._unstash(keep.pop())
            self._point(unit, flat)
            out = []
            for m in self._mbs(B):
                xi = x[m].detach().requires_grad_()
                with autocast(self.prec, self.dev):
                    o = self.block(xi, cos, sin, self.route, None, i)
                o.backward(dx[m])
                out.append(xi.grad)
            dx = torch.cat(out)
            del x, out
            self._write_grads(unit, dict(self.block.named_parameters()), f"layers.{i}.", sq)
        self._last = None
        return dx

    def update(self, commit: dict | None = None, wait: bool = False) -> None:
        """AdamW for the step just computed, on the update thread: reads set `cur`, writes the other,
        then (with `commit`) makes that the checkpoint. The next step may start at once; it waits
        unit by unit for what it reads. `wait` returns only once the update (and commit) is done."""
        assert self._todo is not None, "update() follows step()"
        self.join()
        cur, nxt = self.set, "b" if self.set == "a" else "a"
        self._ready = {u.name: threading.Event() for u in self.units}

        def run():
            self._update(cur, nxt, *self._todo)
            if commit is not None:
                self.store.commit({**commit, "set": nxt})

        self._pending = self._updater.submit(run)
        self.set = nxt
        if wait:
            self.join()

    def join(self) -> None:
        """Wait for the pending update (and its commit); raise its error if it failed."""
        if self._pending is not None:
            fut, self._pending = self._pending, None
            fut.result()
            self.store.flush_writes()  # the last unit's writes may still be queued
        self._ready = {}

    def _write_grads(self, unit: Unit, params: dict, prefix: str, sq: dict) -> None:
        flat = np.empty(unit.numel, dtype=np.float32)
        for s in unit.slots:
            g = params[s.name[len(prefix):]].grad
            sq[s.name] = g.pow(2).sum()
            flat[s.offset : s.offset + s.numel] = g.detach().cpu().numpy().reshape(-1)
        self.store.write(unit.name, "grad", "P", flat)
        for p in params.values():
            p.grad = None

    def _pieces(self):
        """(unit, slot, row0, rows) covering every tensor in PIECE-sized row blocks, in file order."""
        for u in self.units:
            for s in u.slots:
                step = max(1, PIECE // s.row)
                for r0 in range(0, s.rows, step):
                    yield u, s, r0, min(step, s.rows - r0)

    def _read_piece(self, cur: str, u: Unit, s: Slot, r0: int, rows: int, ids: np.ndarray, ge: torch.Tensor):
        p, m, v = (self.store.read(u.name, cur, r, s, r0, rows) for r in ("P", "M", "V"))
        if s.name == "tok_embd.weight":  # the embedding's gradient is sparse: built here, never written
            g = np.zeros((rows, s.row), dtype=np.float32)
            sel = (ids >= r0) & (ids < r0 + rows)
            g[ids[sel] - r0] = ge.numpy()[sel]
            g = g.reshape(-1)
        else:
            g = self.store.read(u.name, "grad", "P", s, r0, rows)
        return p, m, v, g

    def _update(self, cur: str, nxt: str, step: int, lr: float, tc: TrainConfig, coef: float, ids: np.ndarray,
                ge: torch.Tensor) -> None:
        pieces = list(self._pieces())
        with ThreadPoolExecutor(1, thread_name_prefix="mfgguf-update-read") as reader:  # not the forward's reader
            fut = reader.submit(self._read_piece, cur, *pieces[0], ids, ge)
            for k, (u, s, r0, rows) in enumerate(pieces):
                p, m, v, g = (torch.from_numpy(a) for a in fut.result())
                if k + 1 < len(pieces):
                    fut = reader.submit(self._read_piece, cur, *pieces[k + 1], ids, ge)
                g.mul_(coef)
                wd = tc.weight_decay if len(s.shape) >= 2 else 0.0  # make_optimizer: matrices only
                adamw([p], [g], [m], [v], [], [torch.tensor(float(step))], fused=True, amsgrad=False,
                      beta1=0.9, beta2=0.95, lr=lr, weight_decay=wd, eps=tc.adam_eps, maximize=False)
                for region, a in (("P", p), ("M", m), ("V", v)):
                    self.store.write(u.name, nxt, region, a.numpy(), s, r0)
                if k + 1 == len(pieces) or pieces[k + 1][0] is not u:  # the unit's last piece is queued
                    self.store.after_writes(self._ready[u.name].set)
