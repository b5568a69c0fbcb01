"""Stream the trunk and N experts into one preallocated Mixture-of-Experts GGUF, quantizing on the fly.

Phases, each checking its own state before the next runs:
  1. validate + layout  (layout.plan: metadata and headers only, nothing written yet)
  2. header             key-values, tokenizer, provenance and tensor infos, at offset 0
  3. preallocate        the whole file (posix_fallocate): a full disk fails now, not in an hour
  4+5. stream          trunk and experts, tensor by tensor in row chunks of at most CHUNK_BYTES,
                        each quantized and written at its precomputed offset with os.pwrite, whole
                        chunks on a pool of threads (_QuantPool). A few module files are open at a
                        time, read and hashed on background threads (stream.py). Expert slot p of a
                        stacked tensor lives at `offset + p * expert_bytes`; the experts' means and
                        the pooled second moments (modules/router_stats.safetensors) feed the router
  6. merge              trunk tensors that experts trained copies of (`--shared`): each one merged
                        from the trunk's and the copies' row chunks (merge.py), then written; the
                        stream pass skipped these slots
  7. fold               mixtral only: the (possibly merged) anchor into every expert slot
  8. router             closed form from the pooled statistics (router.py), F32
  9. fsync + verify     every slot fully written (own byte accounting), then the file is re-read
                        with llama.cpp's GGUF parser (gguf-py's reader as fallback): names, types,
                        sizes, offsets
  10. rename            the temporary file beside the destination replaces it atomically

Memory is a few chunks in flight (plus their quantized bytes), the router accumulator (layers x
dim x dim f32 for ridge) and a few read-ahead buffers per open file: it does not grow with the
number of experts. Every module file is read once, sequentially; its digest is computed on that
same read (the very bytes that are quantized) and compared with the manifest's (blake3; sha256
for modules written before it), and every chunk is checked for NaN/Inf, so a damaged module
aborts assembly before anything reaches the destination. This path imports no torch. The merge
phase rereads the merged tensors' rows with
pread (checked to be the same files: size and mtime), one row chunk of one tensor from one
module at a time, so it too is flat in the number of experts.

Layouts:
  granitemoe  anchor = always-on shared expert; with top-1 the selected weight is exactly 1, so a
              token routed to expert i computes exactly what expert i was trained on.
  mixtral     `llama` arch: no shared expert, and llama.cpp renormalises the top-k softmax
              weights. We fold the anchor into every routed expert: expert i' is one SwiGLU of
              hidden width anchor_ff + expert_ff (gate/up rows stacked, down columns joined), which
              computes anchor(x) + expert_i(x) exactly. Since the renormalised weights sum to 1,
              sum_j w_j (anchor + e_j) = anchor + sum_j w_j e_j for any top-k: the same function as
              granitemoe. The anchor is not added as a separate routed "expert 0": llama's router
              has no bias, so nothing could keep it from being selected (and displacing a real
              expert). Cost: the file holds N copies of the anchor, fine for tiny/small presets.
              A merged anchor (experts trained with `--shared all`) is merged once into an
              unnamed f32 scratch file beside the output and folded from there; the experts'
              down rows then wait for it (fold phase) instead of being joined while they stream.
  dense       no experts (`experts=[]`): the trunk alone as a plain `llama` file.

Example:
    >>> assemble(Path("RUN"), Path("model.gguf"), quant="q8_0", top_k=1)
    {'path': 'model.gguf', 'bytes': ..., 'arch': 'granitemoe', ...}
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from ..errors import MfggufError
from ..run import STATS_PREFIX, RunDir, atomic_path
from . import quant as Q
from .fileio import SYNC_FILE_RANGE_WRITE, pread_into, pwrite_all, sync_range
from .layout import Plan, plan
from .merge import DEFAULT_DENSITY, merged_chunks, open_checked
from .router import RouterBuilder, needs_stats
from .schema import blk
from .stream import CHUNK_BYTES, stream_modules

WRITEBACK_BYTES = 64 << 20
_FFN_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)(_shexp)?\.weight")
_SEED_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_seed\.weight")
_STATS_RE = re.compile(re.escape(STATS_PREFIX) + r"blk\.(\d+)\.(mean|second_moment)")


def assemble(run: Path, out: Path, *, quant: str = "q8_0", top_k: int = 1, router: str = "ridge",
             layout: str = "granitemoe", experts: list[int] | None = None, merge: str = "mean",
             merge_density: float = DEFAULT_DENSITY, force: bool = False, threads: int | None = None,
             fast_quant: bool = False, progress: bool = True) -> dict:
    """Assemble the trunk and experts of RUN into one GGUF that stock llama.cpp runs.

    Streams one tensor at a time into a preallocated file, quantizing as it goes (ggml's own
    quantizer); the router is computed from the experts' recorded statistics. `experts=None`
    takes all experts, `experts=[]` writes the trunk alone as a dense llama file. Trunk tensors
    that experts trained private copies of (`train-expert --shared`) are merged: `mean` (token-
    weighted mean of the copies), `ties` (TIES-merging of their deltas, keeping `merge_density`
    of each row) or `none` (the trunk as trained). The output appears only when complete and
    verified; an existing file is replaced only with force=True. `fast_quant` quantizes q8_0 with
    ggml's vectorised quantizer (fastquant.py: ~8x faster, a few bytes per million differ from
    llama.cpp's reference quantizer, which the default matches byte for byte).

    Example:
        mfgguf assemble RUN -o model.gguf --quant q8_0 --top-k 1 --router ridge --merge mean
    """
    t0 = time.perf_counter()
    rd, out = RunDir(run), Path(out)
    if out.is_dir():
        raise MfggufError(f"{out} is a directory; give a file name such as {out / 'model.gguf'}")
    if out.exists() and not force:
        raise MfggufError(f"{out} already exists; pass --force to overwrite it")
    p = plan(rd, quant=quant, top_k=top_k, router=router, layout=layout, experts=experts, merge=merge,
             density=merge_density)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out)
    threads = threads or Q.default_threads()
    with atomic_path(out, suffix=f".{os.getpid()}") as tmp:
        w = _Writer(p, tmp, threads, progress, fast_quant)
        try:
            w.header()
            w.preallocate()
            w.stream()
            w.merge()
            w.fold()
            w.router()
            w.finish()
        finally:
            w.close()
        verify(p, tmp)
        os.chmod(tmp, 0o644 & ~_umask())
    return {
        "path": str(out), "bytes": p.total_size, "arch": p.arch, "layout": p.layout, "quant": p.quant,
        "top_k": p.top_k, "router": p.router if p.experts else None, "experts": p.experts,
        "merge": p.merge if p.merged else None, "merged_tensors": len(p.merged),
        "n_tensors": len(p.slots), "input_bytes": p.input_bytes, "quantizer": _quantizer_name(quant, fast_quant),
        "threads": threads,
        "seconds": round(time.perf_counter() - t0, 3),
    }


class _Writer:
    def __init__(self, p: Plan, path: Path, threads: int, progress: bool, fast: bool = False):
        self.p, self.threads, self.fast = p, threads, fast
        self.lanes = max(2, threads)  # files read + hashed at once
        self.fd = os.open(path, os.O_RDWR)
        self.phase = "open"
        self.rb = RouterBuilder(p.router, n_layers=p.cfg.n_layers, dim=p.cfg.dim, n_experts=len(p.experts)) if p.experts else None
        self.bar = _Bar(p.input_bytes, progress)
        self.anchor_fd: int | None = None  # mixtral: the trunk stays readable for the folded anchor
        self.scratch = None  # mixtral with a merged anchor: its f32 rows (unnamed file beside the output)
        self.scratch_at: dict[str, int] = {}  # merged anchor tensor -> byte offset in the scratch file
        self.deferred_down: set[str] = set()  # mixtral: merged anchor down tensors, joined in the fold phase
        if p.layout == "mixtral" and any(_FFN_RE.fullmatch(n) for n in p.merged):
            self.scratch = tempfile.TemporaryFile(dir=path.parent)
            self.deferred_down = {n for n in p.merged if n.endswith("ffn_down_shexp.weight")}
        self.unflushed = 0  # bytes written since writeback was last started
        self.pool = _QuantPool(self.fd, threads, fast) if os.environ.get("MFGGUF_CHUNK_THREADS", "1") != "0" else None
        self._chunk, self._release = None, None  # the streamed chunk being handled, and how to give it back

    def _enter(self, phase: str, after: str) -> None:
        assert self.phase == after, f"phase {phase} after {self.phase}, expected after {after}"
        self.phase = phase

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.bar.close()
        if self.scratch is not None:
            self.scratch.close()
            self.scratch = None
        if self.anchor_fd is not None:
            os.close(self.anchor_fd)
            self.anchor_fd = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ---- phases --------------------------------------------------------------------------------

    def header(self) -> None:
        self._enter("header", "open")
        pad = self.p.data_offset - len(self.p.header)
        pwrite_all(self.fd, np.frombuffer(self.p.header + b"\0" * pad, np.uint8), 0)

    def preallocate(self) -> None:
        self._enter("preallocate", "header")
        try:
            os.posix_fallocate(self.fd, 0, self.p.total_size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise MfggufError(
                    f"not enough disk space for the output: it needs {self.p.total_size / 1e9:.2f} GB;"
                    " free some space or write it elsewhere with -o"
                ) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystems without fallocate: just grow
                raise
            os.ftruncate(self.fd, self.p.total_size)
        assert os.fstat(self.fd).st_size == self.p.total_size

    def stream(self) -> None:
        """Trunk and experts in one pass: the trunk's hashing overlaps the experts' work."""
        self._enter("stream", "preallocate")
        p, lay = self.p, self.p.layout
        if lay == "mixtral" or (lay == "dense" and p.cfg.seed_expert):  # anchor rows joined to other rows
            self.anchor_fd = os.open(p.trunk.path, os.O_RDONLY)
        first = 2 if p.pooled else 1  # stream position of expert slot 0
        counts = [int(m.meta.get("router_stats_count") or 0) for m in p.expert_modules]
        # chunks of one tensor region come in module order, so the router's pooled sums are added
        # in the same order as with one file at a time
        for pos, name, r0, x, release in stream_modules(p.modules, lanes=self.lanes, on_bytes=self.bar.advance):
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
        """Merged trunk tensors, after every module's sha256 has been checked (merge.py)."""
        self._enter("merge", "stream")
        p = self.p
        for name, positions in p.merged.items():
            to_scratch = self.scratch is not None and _FFN_RE.fullmatch(name) is not None  # mixtral anchor
            if to_scratch:
                self.scratch_at[name] = base = os.fstat(self.scratch.fileno()).st_size
            else:
                s = p.slot(name)
            for r0, x in merged_chunks(name, p.trunk, [p.expert_modules[i] for i in positions],
                                       method=p.merge, density=p.density):
                if to_scratch:
                    pwrite_all(self.scratch.fileno(), x, base + r0 * x.shape[1] * 4)
                else:
                    self._put(s, s.offset + r0 * s.row_bytes, x)

    def fold(self) -> None:
        """mixtral: the anchor's rows (merged where experts trained copies) into every expert slot."""
        self._enter("fold", "merge")
        if self.p.layout == "mixtral":
            for slot_i in range(len(self.p.expert_modules)):
                self._fold_anchor_rows(slot_i)

    def _trunk_chunk(self, name: str, r0: int, x: np.ndarray) -> None:
        p, lay = self.p, self.p.layout
        if name in p.merged:
            return  # written by the merge phase
        if (sm := _SEED_RE.fullmatch(name)) is not None:
            if lay == "dense":  # trunk alone = anchor + seed, one SwiGLU of width anchor_ff + expert_ff
                self._seed_chunk(int(sm.group(1)), sm.group(2), r0, x)
            return  # in an MoE the seed is where the experts started, not a tensor of the model
        m = _FFN_RE.fullmatch(name)
        if m and m.group(3):  # anchor
            if lay == "mixtral":
                return  # folded into every expert slot (_fold_anchor_rows)
            if lay == "dense":
                if m.group(2) == "down" and p.cfg.seed_expert:
                    return  # joined with the seed's columns (_seed_chunk)
                name = blk(int(m.group(1)), f"ffn_{m.group(2)}")
        s = p.slot(name)
        self._put(s, s.offset + r0 * s.row_bytes, x)

    def _seed_chunk(self, l: int, f: str, r0: int, x: np.ndarray) -> None:
        """dense with a seed: the seed joined to the anchor, one SwiGLU of width anchor_ff + expert_ff."""
        s = self.p.slot(blk(l, f"ffn_{f}"))
        r0, x = self._after_anchor(l, f, r0, x)
        self._put(s, s.offset + r0 * s.row_bytes, x, owned=x is not self._chunk)  # joined rows: a new array

    def _after_anchor(self, l: int, f: str, r0: int, x: np.ndarray) -> tuple[int, np.ndarray]:
        """Rows r0.. of an expert-width FFN tensor placed after the anchor in one wider SwiGLU: gate/up
        rows follow the anchor's anchor_ff rows; down rows (dim, expert_ff) get the anchor's columns first."""
        if f == "down":
            a = self._anchor_rows(blk(l, "ffn_down_shexp"), r0, r0 + len(x))  # (rows, anchor_ff)
            return r0, np.concatenate([a, x], axis=1)  # (rows, anchor_ff + expert_ff)
        return r0 + self.p.cfg.anchor_ff, x

    def _pooled_chunk(self, name: str, r0: int, x: np.ndarray) -> None:
        if (st := _STATS_RE.fullmatch(name)) is not None and st.group(2) == "second_moment":
            self.rb.add_pooled(int(st.group(1)), r0, x)

    def _expert_chunk(self, slot_i: int, count: int, name: str, r0: int, x: np.ndarray) -> None:
        p = self.p
        if (st := _STATS_RE.fullmatch(name)) is not None:
            if needs_stats(p.router):
                l = int(st.group(1))
                if st.group(2) == "mean":
                    self.rb.add_mean(slot_i, l, x.reshape(-1), count)
                elif p.pooled is None:  # module format 1: every expert holds its own second moment
                    self.rb.add_second_moment(slot_i, l, r0, x, count)
            return
        m = _FFN_RE.fullmatch(name)
        if m is None:
            return  # an extra tensor: hashed, not part of the model
        l, f = int(m.group(1)), m.group(2)
        s = p.slot(blk(l, f"ffn_{f}_exps"))
        base = s.offset + slot_i * s.expert_bytes
        if p.layout == "mixtral":
            if f == "down" and blk(l, "ffn_down_shexp") in self.deferred_down:
                return  # joined with the merged anchor in the fold phase
            r0, x = self._after_anchor(l, f, r0, x)  # anchor + expert i as one SwiGLU
        self._put(s, base + r0 * s.row_bytes, x, owned=x is not self._chunk)

    def router(self) -> None:
        self._enter("router", "fold")
        if not self.p.experts:
            return
        for l, w in enumerate(self.rb.finish()):  # w: (n_experts, dim)
            s = self.p.slot(blk(l, "ffn_gate_inp"))
            self._put(s, s.offset, w)
        self.rb = None

    def finish(self) -> None:
        self._enter("fsync", "router")
        if self.pool is not None:  # every queued chunk written (raises what a worker raised)
            self.pool.drain()
        missing = [s.name for s in self.p.slots if s.written != s.nbytes]
        if missing:
            s = self.p.slot(missing[0])
            raise AssertionError(f"{len(missing)} tensors incompletely written, e.g. {s.name}: {s.written}/{s.nbytes}")
        os.fsync(self.fd)

    # ---- helpers -------------------------------------------------------------------------------

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
            q = Q.quantize(x, s.qtype, threads=self.threads, fast=self.fast)
            assert q.nbytes == nbytes, (q.nbytes, nbytes)
            pwrite_all(self.fd, q, self.p.data_offset + offset)
        s.written += nbytes
        self.unflushed += nbytes
        if self.unflushed >= WRITEBACK_BYTES:  # the disk writes while we compute; the final fsync waits less
            sync_range(self.fd, 0, 0, SYNC_FILE_RANGE_WRITE)
            self.unflushed = 0

    def _fold_anchor_rows(self, slot_i: int) -> None:
        """mixtral: the first anchor_ff rows of expert slot_i's gate/up are the anchor's; with a
        merged anchor the down rows (anchor columns, then the expert's) are joined here too."""
        p, cfg = self.p, self.p.cfg
        for l in range(cfg.n_layers):
            for f in ("gate", "up"):
                s = p.slot(blk(l, f"ffn_{f}_exps"))
                base = s.offset + slot_i * s.expert_bytes
                src = blk(l, f"ffn_{f}_shexp")
                step = max(1, CHUNK_BYTES // (cfg.dim * 4))
                for r0 in range(0, cfg.anchor_ff, step):
                    r1 = min(cfg.anchor_ff, r0 + step)
                    self._put(s, base + r0 * s.row_bytes, self._anchor_rows(src, r0, r1), owned=True)
            if blk(l, "ffn_down_shexp") in self.deferred_down:
                s = p.slot(blk(l, "ffn_down_exps"))
                base = s.offset + slot_i * s.expert_bytes
                mod = p.expert_modules[slot_i]
                e = mod.entries[blk(l, "ffn_down")]
                step = max(1, CHUNK_BYTES // ((cfg.anchor_ff + cfg.expert_ff) * 4))
                fd = open_checked(mod)
                try:
                    for r0 in range(0, cfg.dim, step):
                        r1 = min(cfg.dim, r0 + step)
                        x = np.empty((r1 - r0, cfg.expert_ff), np.float32)  # (rows, expert_ff)
                        pread_into(fd, x, e.begin + r0 * cfg.expert_ff * 4, f"module {mod.name} ended early; retrain it")
                        a = self._anchor_rows(blk(l, "ffn_down_shexp"), r0, r1)  # (rows, anchor_ff)
                        self._put(s, base + r0 * s.row_bytes, np.concatenate([a, x], axis=1), owned=True)
                finally:
                    os.close(fd)

    def _anchor_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows r0:r1 of anchor tensor `name`: the merged ones from the scratch file, else the trunk's."""
        e = self.p.trunk.entries[name]
        cols = e.shape[-1]
        buf = np.empty((r1 - r0, cols), np.float32)
        if name in self.scratch_at:
            pread_into(self.scratch.fileno(), buf, self.scratch_at[name] + r0 * cols * 4,
                       "the merge scratch file ended early; retrain it")
        else:
            pread_into(self.anchor_fd, buf, e.begin + r0 * cols * 4, "the trunk module ended early; retrain it")
        return buf


def _quantizer_name(quant: str, fast: bool) -> str:
    if fast and quant == "q8_0":
        from .fastquant import available

        if available():
            return "ggml-cpu (vectorised q8_0)"
    return Q.backend()


class _QuantPool:
    """Quantize and write streamed row chunks on `threads` threads, one whole chunk per thread.

    Splitting one chunk over threads costs more than it gains for small tensors (a 1 MB `1b` expert
    tensor, q8_0: 464 MB/s on one thread, 239 MB/s split over two on the 2-core machine: the hand-
    off dominates), and most of a `1b` run's bytes are such tensors. So whole chunks go to
    different threads: each lands at its own offset, so their order does not matter, and the copy
    into the page cache overlaps the next chunk's quantization. A chunk's stream buffer is released
    once it is written; at most `4 x threads` chunks are in flight, and a worker's error is raised
    by the next `submit` or by `drain`.
    """

    def __init__(self, fd: int, threads: int, fast: bool = False):
        import collections
        from concurrent.futures import ThreadPoolExecutor

        self.fd, self.limit, self.fast = fd, 4 * threads, fast
        self.ex = ThreadPoolExecutor(threads, thread_name_prefix="mfgguf-quant")
        self.futs: collections.deque = collections.deque()

    def submit(self, x: np.ndarray, qtype: str, offset: int, nbytes: int, release=None) -> None:
        while self.futs and (len(self.futs) >= self.limit or self.futs[0].done()):
            self.futs.popleft().result()
        self.futs.append(self.ex.submit(self._job, x, qtype, offset, nbytes, release))

    def _job(self, x: np.ndarray, qtype: str, offset: int, nbytes: int, release) -> None:
        try:
            q = Q.quantize(x, qtype, threads=1, fast=self.fast)
            assert q.nbytes == nbytes, (q.nbytes, nbytes)
            pwrite_all(self.fd, q, offset)
        finally:
            if release is not None:
                release()

    def drain(self) -> None:
        while self.futs:
            self.futs.popleft().result()

    def close(self) -> None:
        """Let every queued chunk finish (each releases its stream buffer), whatever happened."""
        self.ex.shutdown(wait=True)


def verify(p: Plan, path: Path) -> None:
    """Re-read the written file: size, then every tensor's name, type, size and offset, and the arch.

    The parser is llama.cpp's own (gguf_init_from_file in libggml-base, header only), falling back
    to gguf-py's GGUFReader where that library is unavailable (slower: it builds one numpy view per
    token string).
    """
    from .schema import QTYPES

    size = os.path.getsize(path)
    if size != p.total_size:
        raise AssertionError(f"written file is {size} bytes, the layout says {p.total_size}")
    infos, data_offset, arch = _read_back(path)
    if len(infos) != len(p.slots):
        raise AssertionError(f"re-read {len(infos)} tensors, wrote {len(p.slots)}")
    if data_offset != p.data_offset or arch != p.arch:
        raise AssertionError(f"re-read data offset {data_offset} / arch {arch}, wrote {p.data_offset} / {p.arch}")
    for (name, ggml_type, nbytes, offset), s in zip(infos, p.slots):
        if (name, ggml_type, nbytes, offset) != (s.name, QTYPES[s.qtype].ggml, s.nbytes, s.offset):
            raise AssertionError(f"re-read tensor {name} differs from the layout of {s.name}")


def _read_back(path: Path) -> tuple[list[tuple[str, int, int, int]], int, str]:
    """[(name, ggml type, bytes, offset in data)], data offset, architecture, as a reader parses them."""
    import ctypes

    lib = Q.ggml_lib()
    if lib is None or os.environ.get("MFGGUF_VERIFY") == "gguf-py":
        import gguf

        r = gguf.GGUFReader(path)
        f = r.fields["general.architecture"]
        d0 = r.tensors[0].data_offset if r.tensors else 0
        infos = [(t.name, int(t.tensor_type), int(t.n_bytes), int(t.data_offset) - d0) for t in r.tensors]
        return infos, d0, bytes(f.parts[f.data[0]]).decode()

    class Params(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn, res, args in (("gguf_init_from_file", vp, [ctypes.c_char_p, Params]), ("gguf_free", None, [vp]),
                          ("gguf_get_n_tensors", i64, [vp]), ("gguf_get_tensor_name", ctypes.c_char_p, [vp, i64]),
                          ("gguf_get_tensor_offset", ctypes.c_size_t, [vp, i64]), ("gguf_get_tensor_type", ctypes.c_int, [vp, i64]),
                          ("gguf_get_tensor_size", ctypes.c_size_t, [vp, i64]), ("gguf_get_data_offset", ctypes.c_size_t, [vp]),
                          ("gguf_find_key", i64, [vp, ctypes.c_char_p]), ("gguf_get_val_str", ctypes.c_char_p, [vp, i64])):
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = res, args
    ctx = lib.gguf_init_from_file(str(path).encode(), Params(True, None))
    if not ctx:
        raise AssertionError(f"llama.cpp's GGUF parser rejected {path}")
    try:
        n = lib.gguf_get_n_tensors(ctx)
        infos = [(lib.gguf_get_tensor_name(ctx, i).decode(), lib.gguf_get_tensor_type(ctx, i),
                  lib.gguf_get_tensor_size(ctx, i), lib.gguf_get_tensor_offset(ctx, i)) for i in range(n)]
        key = lib.gguf_find_key(ctx, b"general.architecture")
        arch = lib.gguf_get_val_str(ctx, key).decode() if key >= 0 else ""
        return infos, lib.gguf_get_data_offset(ctx), arch
    finally:
        lib.gguf_free(ctx)


def _remove_stale_temps(out: Path) -> None:
    """Temporary files of killed assemblies (`.NAME.XXXX.PID.tmp` whose PID is gone) are removed."""
    for t in out.parent.glob(f".{out.name}.*.tmp"):
        try:
            pid = int(t.name.rsplit(".", 2)[-2])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            t.unlink(missing_ok=True)
        except PermissionError:
            continue


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


class _Bar:
    """A rich progress bar over input bytes (MB/s, ETA), or nothing."""

    def __init__(self, total: int, enabled: bool):
        self.p = None
        if enabled:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self.p = Progress(TextColumn("assemble"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                              TimeRemainingColumn(), transient=False)
            self.p.start()
            self.task = self.p.add_task("assemble", total=total)

    def advance(self, n: int) -> None:
        if self.p is not None:
            self.p.advance(self.task, n)

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()
            self.p = None
