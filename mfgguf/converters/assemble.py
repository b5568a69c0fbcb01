"""Stream the trunk and N experts into one preallocated Mixture-of-Experts GGUF, quantizing on the fly.

Phases, each checking its own state before the next runs:
  1. validate + layout  (layout.plan: metadata and headers only, nothing written yet); pooled router
                        statistics that are missing or stale are computed first (plan/ensure_stats.py)
  2. header             key-values, tokenizer, provenance and tensor infos, at offset 0
  3. preallocate        the whole file (posix_fallocate): a full disk fails now, not in an hour
  4+5. stream          trunk and experts, tensor by tensor in row chunks of at most CHUNK_BYTES,
                        each quantized and written at its precomputed offset with os.pwrite, whole
                        chunks on a pool of threads (writers/pool.py). A few module files are open at a
                        time, read and hashed on background threads (stream.py). Expert slot p of a
                        stacked tensor lives at `offset + p * expert_bytes`; the experts' means and
                        the pooled second moments (modules/router_stats.safetensors) feed the router
  6. merge              trunk tensors that experts trained copies of (`--shared`): each one merged
                        from the trunk's and the copies' row chunks (merge.py), then written; the
                        stream pass skipped these slots
  7. fold               the folded layout only: the (possibly merged) anchor into every expert slot
  8. router             closed form from the pooled statistics (router.py), F32, one layer of the
                        pooled second moment read at a time; then the statistics `extend` needs go
                        into their block after the tensor data (routing/stats.py)
  9. fsync + verify     every slot fully written (own byte accounting), then the file is re-read
                        with llama.cpp's GGUF parser (gguf-py's reader as fallback): names, types,
                        sizes, offsets (readback.py)
  10. rename            the temporary file beside the destination replaces it atomically

Memory is a few chunks in flight (plus their quantized bytes), the experts' means (layers x dim
each), one layer's second moment and a few read-ahead buffers per open file: it does not grow with
the number of experts (docs/assembly.md has the figures). Each phase's
seconds, and the stream's reading, hashing, checking, quantizing and writing summed over threads,
come back with the result (profile.py). Every module file is read once, sequentially; its digest is computed on that
same read (the very bytes that are quantized) and compared with the manifest's (blake3; sha256
for modules written before it), and every chunk is checked for NaN/Inf, so a damaged module
aborts assembly before anything reaches the destination. This path imports no torch. The merge
phase rereads the merged tensors' rows with
pread (checked to be the same files: size and mtime), one row chunk of one tensor from one
module at a time, so it too is flat in the number of experts.

Layouts, one writer class each (writers/granitemoe.py: shared-expert, mixtral.py: folded, dense.py) on a common base
(writers/base.py: the phases above); this module plans, picks the writer and runs the phases:
  shared-expert  anchor = always-on shared expert; with top-1 the selected weight is exactly 1, so a
              token routed to expert i computes exactly what expert i was trained on.
  folded      `llama` arch: no shared expert, and llama.cpp renormalises the top-k softmax
              weights. We fold the anchor into every routed expert: expert i' is one SwiGLU of
              hidden width anchor_ff + expert_ff (gate/up rows stacked, down columns joined), which
              computes anchor(x) + expert_i(x) exactly. Since the renormalised weights sum to 1,
              sum_j w_j (anchor + e_j) = anchor + sum_j w_j e_j for any top-k: the same function as
              shared-expert. The anchor is not added as a separate routed "expert 0": llama's router
              has no bias, so nothing could keep it from being selected (and displacing a real
              expert). Cost: the file holds N copies of the anchor, fine for tiny/small presets.
              A merged anchor (experts trained with `--shared all`) is merged once into an
              unnamed f32 scratch file beside the output and folded from there; the experts'
              down rows then wait for it (fold phase) instead of being joined while they stream.
  dense       no experts (`experts=[]`): the trunk alone as a plain `llama` file.
  seed gate   any MoE layout with the seed routed as expert 0 beside the experts (`seed_gate`:
              converters/routing/seed_gate.py, writers/seed_slot.py).

Example:
    >>> assemble(Path("RUN"), Path("model.gguf"), quant="q8_0", top_k=1)
    {'path': 'model.gguf', 'bytes': ..., 'arch': 'granitemoe', ...}
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, atomic_path
from mfgguf.converters import quant as Q
from mfgguf.converters.plan.ensure_stats import plan_with_stats
from mfgguf.converters.plan.layout import plan
from mfgguf.converters.profile import Profile
from mfgguf.converters.readback import verify
from mfgguf.converters.writers.base import Writer
from mfgguf.converters.writers.seed_slot import SEED_SLOT_WRITERS
from mfgguf.converters.writers.dense import DenseWriter
from mfgguf.converters.writers.granitemoe import GraniteMoeWriter
from mfgguf.converters.writers.mixtral import MixtralWriter
from mfgguf.converters.writers.qwen2moe import Qwen2MoeWriter

# by layout; an MoE architecture whose graph differs from its layout's (qwen2moe's gated shared expert) by arch
WRITERS: dict[str, type[Writer]] = {"shared-expert": GraniteMoeWriter, "folded": MixtralWriter, "dense": DenseWriter,
                                    "qwen2moe": Qwen2MoeWriter}


def assemble(run: Path, out: Path, *, quant: str = "q8_0", top_k: int | None = None, router: str = "ridge",
             layout: str = "auto", experts: list[int] | None = None, merge: str = "mean",
             force: bool = False, threads: int | None = None,
             fast_quant: bool = False, progress: bool = True,
             seed_gate: float | None = None) -> dict:
    """Assemble the trunk and experts of RUN into one GGUF that stock llama.cpp runs.

    Streams one tensor at a time into a preallocated file, quantizing as it goes (ggml's own
    quantizer); the router is computed from the experts' recorded statistics. `experts=None`
    takes all experts, `experts=[]` writes the trunk alone as a dense llama file. Trunk tensors
    that experts trained private copies of (`train-expert --shared`) are merged: `mean` (token-
    weighted mean of the copies) or `none` (the trunk as trained). The output appears only when complete and
    verified; an existing file is replaced only with force=True. `fast_quant` quantizes q8_0 with
    ggml's vectorised quantizer (fastquant.py: several times faster, a few bytes per million differ from
    llama.cpp's reference quantizer, which the default matches byte for byte). The ridge router's
    pooled statistics, where missing or stale, are computed first (`mfgguf router-stats`'s pass over the
    experts taken: plan/ensure_stats.py).
    `top_k=None` (the default, as `--top-k` unset): 1, the exact trained function (0 in a dense file).
    `seed_gate=C`: the untrained seed FFN beside plain experts as routed expert 0 (any MoE layout), so a token no
    expert claims computes the trunk alone (on an imported base: the base's FFN); its router row is C times
    the sum of the ridge rows (converters/routing/seed_gate.py).

    Example:
        mfgguf assemble RUN -o model.gguf --quant q8_0 --top-k 1 --router ridge --merge mean
    """
    t0 = time.perf_counter()
    rd, out = RunDir(run), Path(out)
    if out.is_dir():
        raise MfggufError(f"{out} is a directory; give a file name such as {out / 'model.gguf'}")
    if out.exists() and not force:
        raise MfggufError(f"{out} already exists; pass --force to overwrite it")
    prof = Profile()
    with prof.phase("plan"):
        p = plan_with_stats(lambda: plan(rd, quant=quant, top_k=top_k, router=router, layout=layout, experts=experts,
                                         merge=merge, seed_gate=seed_gate), rd, progress=progress,
                            experts=experts)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out)
    threads = threads or Q.default_threads()
    with atomic_path(out, suffix=f".{os.getpid()}") as tmp:
        kind = p.arch if p.arch in WRITERS and p.layout != "dense" else p.layout
        w = (SEED_SLOT_WRITERS if p.routed_seed else WRITERS)[kind](p, tmp, threads, progress, fast_quant, prof)
        try:
            for phase in (w.header, w.preallocate, w.stream, w.merge, w.fold, w.router, w.finish):
                with prof.phase(phase.__name__):
                    phase()
        finally:
            w.close()
        with prof.phase("verify"):
            verify(p, tmp)
        os.chmod(tmp, 0o644 & ~_umask())
    return {
        "path": str(out), "bytes": p.total_size, "arch": p.arch, "layout": p.layout, "quant": p.quant,
        "top_k": p.top_k, "router": p.router if p.experts else None, "experts": p.experts, "seed_gate": p.seed_gate,
        "merge": p.merge if p.merged else None, "merged_tensors": len(p.merged),
        "n_tensors": len(p.slots), "input_bytes": p.input_bytes, "quantizer": _quantizer_name(quant, fast_quant),
        "threads": threads,
        "seconds": round(time.perf_counter() - t0, 3),
        **prof.as_dict(),
    }


def _quantizer_name(quant: str, fast: bool) -> str:
    if fast and quant == "q8_0":
        from mfgguf.converters.fastquant import available

        if available():
            return "ggml-cpu (vectorised q8_0)"
    return Q.backend()


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
