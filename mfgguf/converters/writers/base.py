"""What every output layout's writer shares: the phases, the streamed chunks' dispatch, quantize-and-write.

A writer fills the slots of a `layout.Plan` in a preallocated file, phase by phase (assemble.py
calls them in order; each checks it follows the one before): header, preallocate, stream (trunk,
pooled statistics and experts in one pass), merge (trunk tensors merged from the experts' copies),
fold, router, finish. A layout's class (granitemoe.py, mixtral.py, dense.py) decides only where
the trunk's anchor and seed FFNs and the experts' FFN rows go:

  `_anchor_name(l, f)`     the slot an anchor tensor's rows are written to as they stream, or None
  `_seed_chunk(...)`       what a seed FFN chunk of the trunk becomes (nothing, unless dense)
  `_expert_rows(...)`      an expert FFN chunk's first row and rows in its slot, or None
  `_merged_writer(name)`   where a merged trunk tensor's rows go (the slot, unless mixtral's scratch)
  `_fold()`                the fold phase (mixtral: the anchor into every expert slot)

Example:
    >>> w = GraniteMoeWriter(p, tmp, threads=2, progress=False)
    >>> w.header(); w.preallocate(); w.stream(); w.merge(); w.fold(); w.router(); w.finish(); w.close()
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.run import STATS_PREFIX
from mfgguf.converters import quant as Q
from mfgguf.gguf.fileio import SYNC_FILE_RANGE_WRITE, allocate, pread_into, pwrite_all, sync_range, truncated
from mfgguf.converters.plan.layout import Plan
from mfgguf.gguf.writer import write_header
from mfgguf.modules.merge import merged_chunks, open_checked
from mfgguf.converters.routing.router import RouterBuilder, needs_stats
from mfgguf.base.source import rope_permute
from mfgguf.families import family
from mfgguf.gguf.schema import ARCH_ROPE, blk
from mfgguf.converters.stream import stream_modules
from mfgguf.converters.profile import Profile
from mfgguf.converters.writers.pool import Bar, QuantPool

WRITEBACK_BYTES = 64 << 20
QK_RE = re.compile(r"blk\.\d+\.attn_(q|k)\.(weight|bias)")
FFN_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)(_shexp)?\.weight")  # group 3: the anchor's
SEED_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_seed\.weight")
STATS_RE = re.compile(re.escape(STATS_PREFIX) + r"blk\.(\d+)\.mean")


class Writer:
    """Fills one planned GGUF file; a subclass per output layout (see the module's docstring)."""

    def __init__(self, p: Plan, path: Path, threads: int, progress: bool, fast: bool = False,
                 profile: Profile | None = None):
        self.p, self.threads, self.fast = p, threads, fast
        self.prof = profile if profile is not None else Profile()
        self.lanes = max(2, threads)  # files read + hashed at once
        self.fd = os.open(path, os.O_RDWR)
        self.phase = "open"
        self.rb = self._router_builder() if p.experts else None
        self.bar = Bar(p.input_bytes, progress)
        self.unflushed = 0  # bytes written since writeback was last started
        self.pool = QuantPool(self.fd, threads, fast, self.prof) if os.environ.get("MFGGUF_CHUNK_THREADS", "1") != "0" else None
        self._chunk, self._release = None, None  # the streamed chunk being handled, and how to give it back
        # a NEOX family (qwen2) in a file whose graph rotates adjacent pairs (llama, granitemoe): Q/K rows (and
        # biases) permuted as convert_hf_to_gguf.py permutes Hugging Face's, whole tensors at a time (_qk_rows)
        self.qk_permute = family(p.cfg.family).rope == "neox" and ARCH_ROPE[p.arch] == "normal"
        self._qk: dict[str, tuple[np.ndarray, int]] = {}  # Q/K tensor being gathered -> (rows, rows filled)

    def _enter(self, phase: str, after: str) -> None:
        assert self.phase == after, f"phase {phase} after {self.phase}, expected after {after}"
        self.phase = phase

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.bar.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ---- phases --------------------------------------------------------------------------------

    def header(self) -> None:
        self._enter("header", "open")
        write_header(self.fd, self.p.header, self.p.data_offset)

    def preallocate(self) -> None:
        self._enter("preallocate", "header")
        allocate(self.fd, self.p.total_size)
        assert os.fstat(self.fd).st_size == self.p.total_size

    def stream(self) -> None:
        """Trunk and experts in one pass: the trunk's hashing overlaps the experts' work."""
        self._enter("stream", "preallocate")
        self._open_inputs()
        p = self.p
        for name, x in p.constants.items():  # tensors from the config alone (layout._constants)
            s = p.slot(name)
            self._put(s, s.offset, x)
        first = 2 if p.pooled else 1  # stream position of expert slot 0
        counts = [int(m.meta.router_stats_count or 0) for m in p.expert_modules]
        # chunks of one tensor region come in module order, so the router's pooled sums are added
        # in the same order as with one file at a time
        for pos, name, r0, x, release in stream_modules(p.modules, lanes=self.lanes, on_bytes=self.bar.advance,
                                                        profile=self.prof):
            self._chunk, self._release = x, release
            try:
                if pos == 0:
                    self._trunk_chunk(name, r0, x)
                elif pos < first:
                    self._pooled_chunk(name, r0, x)
                else:
                    self._expert_chunk(pos - first, counts[pos - first], name, r0, x)
            finally:  # not handed to the chunk pool: give the buffer back now
                if self._release is not None:
                    self._release()
                self._chunk, self._release = None, None

    def merge(self) -> None:
        """Merged trunk tensors, after every module's digest has been checked (merge.py)."""
        self._enter("merge", "stream")
        p = self.p
        for name, positions in p.merged.items():
            write = self._merged_writer(name)
            for r0, x in merged_chunks(name, p.trunk, [p.expert_modules[i] for i in positions],
                                       method=p.merge):
                write(r0, x)

    def fold(self) -> None:
        self._enter("fold", "merge")
        self._fold()

    def router(self) -> None:
        self._enter("router", "fold")
        if not self.p.experts:
            return
        for l, w in enumerate(self.rb.finish()):  # w: (n_experts, dim)
            s = self.p.slot(blk(l, "ffn_gate_inp"))
            self._put(s, s.offset, w)
        self._router_stats()
        self.rb = None

    def _router_stats(self) -> None:
        """The statistics the router came from, into their block after the tensor data (routing/stats.py)."""
        rb, at = self.rb, self.p.stats
        if at is None:
            return
        for p in range(at.n_experts):
            pwrite_all(self.fd, np.ascontiguousarray(rb.mu[:, p, :]), at.mean(p))  # (layers, dim)
        if at.ridge:  # one source: the pooled G as read
            for l in range(at.n_layers):
                pwrite_all(self.fd, rb.pooled(l), at.second_moment(0, l))  # (dim, dim)

    def finish(self) -> None:
        self._enter("fsync", "router")
        if self.pool is not None:  # every queued chunk written (raises what a worker raised)
            self.pool.drain()
        missing = [s.name for s in self.p.slots if s.written != s.nbytes]
        if missing:
            s = self.p.slot(missing[0])
            raise AssertionError(f"{len(missing)} tensors incompletely written, e.g. {s.name}: {s.written}/{s.nbytes}")
        os.fsync(self.fd)

    # ---- the streamed chunks -------------------------------------------------------------------

    def _trunk_chunk(self, name: str, r0: int, x: np.ndarray) -> None:
        p = self.p
        if name in p.merged:
            return  # written by the merge phase
        if (sm := SEED_RE.fullmatch(name)) is not None:
            self._seed_chunk(int(sm.group(1)), sm.group(2), r0, x)
            return
        if self.qk_permute and QK_RE.fullmatch(name):
            self._qk_rows(name, r0, x)
            return
        m = FFN_RE.fullmatch(name)
        if m and m.group(3):  # anchor
            name = self._anchor_name(int(m.group(1)), m.group(2))
            if name is None:
                return
        s = p.slot(name)
        self._put(s, s.offset + r0 * s.row_bytes, x)

    def _pooled_chunk(self, name: str, r0: int, x: np.ndarray) -> None:
        """The pooled statistics stream to be hashed; the router phase reads them again a layer at a time
        (`_pooled_layer`), so no (layers, dim, dim) copy is held through the stream."""

    def _expert_chunk(self, slot_i: int, count: int, name: str, r0: int, x: np.ndarray) -> None:
        p = self.p
        if (st := STATS_RE.fullmatch(name)) is not None:
            if needs_stats(p.router):
                self.rb.add_mean(slot_i, int(st.group(1)), x.reshape(-1), count)
            return
        m = FFN_RE.fullmatch(name)
        if m is None:
            return  # an extra tensor: hashed, not part of the model
        l, f = int(m.group(1)), m.group(2)
        s = p.slot(blk(l, f"ffn_{f}_exps"))
        placed = self._expert_rows(l, f, r0, x)
        if placed is not None:
            r0, x = placed
            self._put(s, s.offset + slot_i * s.expert_bytes + r0 * s.row_bytes, x, owned=x is not self._chunk)

    # ---- what a layout decides -----------------------------------------------------------------

    def _router_builder(self) -> RouterBuilder:
        """What computes the router rows from the experts' statistics (the plan's router method)."""
        return RouterBuilder(self.p.router, n_layers=self.p.cfg.n_layers, dim=self.p.cfg.dim, n_experts=len(self.p.experts),
                             pooled=self._pooled_layer if self.p.pooled is not None else None)

    def _pooled_layer(self, l: int) -> np.ndarray:
        """Layer l's pooled second moment (dim, dim) f32, read from the file the stream hashed (checked to be
        the same: size and mtime)."""
        m, D = self.p.pooled, self.p.cfg.dim
        e = m.entries[f"{STATS_PREFIX}blk.{l}.second_moment"]
        fd = open_checked(m)
        try:
            return pread_into(fd, np.empty((D, D), np.float32), e.begin, truncated(m))
        finally:
            os.close(fd)

    def _open_inputs(self) -> None:
        """Files the layout reads beside the stream, opened when the stream phase starts."""

    def _anchor_name(self, l: int, f: str) -> str | None:
        """The slot of anchor tensor ffn_{f}_shexp of layer l as it streams; None: not written now."""
        return blk(l, f"ffn_{f}_shexp")

    def _seed_chunk(self, l: int, f: str, r0: int, x: np.ndarray) -> None:
        """In an MoE the seed is where the experts started, not a tensor of the model."""

    def _expert_rows(self, l: int, f: str, r0: int, x: np.ndarray) -> tuple[int, np.ndarray] | None:
        """(first row, rows) of an expert's FFN chunk in its slot; None: written later."""
        return r0, x

    def _merged_writer(self, name: str) -> Callable[[int, np.ndarray], None]:
        """Where the rows of merged trunk tensor `name` go: its slot."""
        if self.qk_permute and QK_RE.fullmatch(name):
            return lambda r0, x: self._qk_rows(name, r0, x)
        s = self.p.slot(name)
        return lambda r0, x: self._put(s, s.offset + r0 * s.row_bytes, x)

    def _qk_rows(self, name: str, r0: int, x: np.ndarray) -> None:
        """Rows of a Q/K weight or bias in NEOX order, gathered; once whole, written in adjacent-pair order.
        One attention tensor at a time is held (the stream and the merge go tensor by tensor)."""
        s = self.p.slot(name)
        shape = (s.shape[0] if len(s.shape) > 1 else 1, s.shape[-1])  # chunks are 2-D, a bias's one row
        buf, filled = self._qk.get(name) or (np.empty(shape, np.float32), 0)
        buf[r0:r0 + len(x)] = x
        filled += len(x)
        if filled < shape[0]:
            self._qk[name] = (buf, filled)
            return
        self._qk.pop(name, None)
        heads = self.p.cfg.n_heads if QK_RE.fullmatch(name).group(1) == "q" else self.p.cfg.n_kv_heads
        w = rope_permute(buf.reshape(s.shape), heads).reshape(shape)
        self._put(s, s.offset, np.ascontiguousarray(w), owned=True)

    def _fold(self) -> None:
        """Nothing to fold."""

    # ---- writing -------------------------------------------------------------------------------

    def _put(self, s, offset: int, x: np.ndarray, owned: bool = False) -> None:
        """Quantize rows `x` of slot `s` and write them at `offset`: on the chunk pool when `x` is the
        streamed chunk (released once written) or an array nobody reuses (`owned`), else here."""
        nbytes = x.size // x.shape[-1] * s.row_bytes
        assert s.offset <= offset and offset + nbytes <= s.offset + s.nbytes, (s.name, offset)
        if self.pool is not None and (owned or x is self._chunk):
            release = None
            if x is self._chunk:
                release, self._release = self._release, None
            self.pool.submit(x, s.qtype, self.p.data_offset + offset, nbytes, release)
        else:
            with self.prof.work("quantize"):
                q = Q.quantize(x, s.qtype, threads=self.threads, fast=self.fast)
            assert q.nbytes == nbytes, (q.nbytes, nbytes)
            with self.prof.work("write"):
                pwrite_all(self.fd, q, self.p.data_offset + offset)
        s.written += nbytes
        self.unflushed += nbytes
        if self.unflushed >= WRITEBACK_BYTES:  # the disk writes while we compute; the final fsync waits less
            sync_range(self.fd, 0, 0, SYNC_FILE_RANGE_WRITE)
            self.unflushed = 0
