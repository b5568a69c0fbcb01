"""Add experts to a finished MoE GGUF, or remove some, without its modules and without retraining.

`mfgguf assemble` records in the file what the router was computed from (routing/stats.py): each
expert's FFN-input means and token count, and each source's pooled second moment G with its token
count, beside the trunk's sha256 (`mfgguf.trunk_sha256`). `extend` reads them back, drops the
removed slots, adds experts of another RUN trained against the same trunk (their means from their
module files, their RUN's pooled G as a new source), and recomputes the router in closed form
(router.py), exactly as assembly would.

Sources. G is kept per source, never summed into one matrix: a source is one RUN's pooled
statistics file (named by its sha256), and the G the router uses is their token-weighted mean,
G = sum_s c_s G_s / sum_s c_s (one source: G_s itself). A source stays while any expert that came
with it does. So removing what was added drops its source and gives back the very bytes the router
was computed from: the router, and the whole file, come back bit for bit. The price is one
layers x dim x dim f32 array per source in the statistics block after the tensor data
(routing/stats.py; docs/assembly.md gives its size per preset), which no GGUF reader loads. Experts
added from the RUN a source already came from share its G.

Streaming, as assembly: the output is preallocated beside the destination; every tensor of the
trunk and every kept expert slot of the stacked `_exps` tensors is copied byte for byte
(copy_file_range, no decode), only the new experts' tensors are quantized (ggml's reference
quantizer, the type of the slot they join), row chunk by row chunk as their module files stream
and are hashed (stream.py); the router rows and the statistics go in last, then the file is
re-read (readback.py) and renamed over the destination. Memory holds the N means (layers x dim),
one layer of G at a time and a few chunks: not the experts, not a whole G.

Layouts. granitemoe (qwen2moe for a Qwen2 trunk) has the anchor as a shared expert: a new expert is a
slot of its own. The folded layout (`llama`, and qwen3moe, Qwen3's only one) folds the anchor into
every slot, one SwiGLU of width anchor + expert: a new slot is rebuilt as assembly builds it, with the
anchor read from the --add RUN's trunk, which must be the file's (extension/folded.py). Removing is
dropping slots in every layout.

Refused with one line, nothing written: a GGUF without the router statistics (not written by this
mfgguf's assemble, or with a router that needs none, or rewritten by a tool that dropped the block
after its tensors), a file without experts, a file whose trunk was merged from experts' copies or
whose seed is routed (`assemble --seed-gate`), an expert trained against another trunk (or
unfinished, or with trunk copies of its own, or already in the file), a folded file's additions from
a RUN whose trunk is not the file's, a slot K out of range, and an existing destination without
--force.

Example:
    >>> extend(Path("model.gguf"), Path("model5.gguf"), add=Path("RUN2"), experts=[1])
    {'path': 'model5.gguf', 'experts': 5, 'added': 1, 'removed': 0, ...}
"""

from __future__ import annotations

import os
import time
from pathlib import Path


from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, atomic_path
from mfgguf.converters import quant as Q
from mfgguf.converters.plan.ensure_stats import plan_with_stats
from mfgguf.converters.routing.guard import Guard, guard_new_rows
from mfgguf.converters.readback import verify
from mfgguf.converters.extension.newfile import plan_extension, write_extension
from mfgguf.converters.extension.source import Source, read_additions


def extend(model: Path, out: Path, *, add: Path | None = None, experts: list[int] | None = None,
           remove: list[int] | None = None, force: bool = False, threads: int | None = None,
           keep_routing: bool = False, guard: Guard | None = None) -> dict:
    """Add experts trained later against the same trunk to a finished MoE GGUF, or remove experts
    from it, without the original modules and without retraining: the router is recomputed in closed
    form from the statistics `assemble` recorded in the file. --add RUN takes the experts of RUN
    (--experts LIST: some of them) trained against the model's trunk; --remove K,... drops the
    K-th experts (1..N in the file's order: `mfgguf inspect`'s slot K-1; removal first, then additions).
    Existing experts are copied byte for byte, only new ones are quantized, one tensor at a time.
    Removing what was added gives back the original file. An existing OUT is replaced only with
    --force. --keep-routing leaves the experts already in the file their router rows exactly (tokens
    rank them as before) and puts an added expert's closed-form row on their scale, instead of
    recomputing every row: a domain opted in or out moves the others less. --guard PCT keeps the rows too and
    lowers the added experts' logits by the fewest nats (searched: 0, 0.25, 0.5, 1, ..., then halved gaps) under
    which every old expert's training shard (a 4,096-token sample from --guard-run RUN, default the --add RUN,
    scored by llama.cpp) moves by at most PCT percent of perplexity: the price, the new domain's own gain given
    back, is printed. Where the --add RUN's pooled statistics are missing or stale, the router-stats pass
    runs first (as `assemble` does).

    Example:
        mfgguf extend model.gguf --add RUN2 --experts 1 -o model4.gguf
    """
    t0 = time.perf_counter()
    model, out = Path(model), Path(out)
    if not model.is_file():
        raise MfggufError(f"{model} does not exist; give the .gguf written by `mfgguf assemble`")
    if out.is_dir():
        raise MfggufError(f"{out} is a directory; give a file name such as {out / 'model.gguf'}")
    if out.exists() and not force:
        raise MfggufError(f"{out} already exists; pass --force to overwrite it")
    if add is None and not remove:
        raise MfggufError("nothing to do: pass --add RUN (and --experts LIST) and/or --remove K[,K...]")
    if experts is not None and add is None:
        raise MfggufError("--experts selects experts of the RUN given with --add; pass --add RUN")
    if guard is not None and (add is None or remove):
        raise MfggufError("--guard keeps the old experts' domains in place when experts are added: pass --add RUN,"
                          " and remove experts in an extend of its own")
    if guard is not None and not 0 < guard.max_move < 1:
        raise MfggufError(f"--guard {100 * guard.max_move:g} is out of range; give the largest move allowed in percent,"
                          " e.g. 0.5")
    keep_routing = keep_routing or guard is not None
    src = Source.read(model)
    keep = src.kept(remove or [])
    adds = plan_with_stats(lambda: read_additions(Path(add), experts, src), RunDir(add), progress=False,
                           verb="extend", experts=experts) if add else None
    p = plan_extension(src, keep, adds, keep_routing)
    with open(model, "rb") as fin:
        with atomic_path(out, suffix=f".{os.getpid()}") as tmp:
            fd = os.open(tmp, os.O_RDWR)
            try:
                write_extension(p, fin.fileno(), fd, threads or Q.default_threads(), keep_routing)
            finally:
                os.close(fd)
            verify(p, tmp)
            guarded = guard_new_rows(model, tmp, RunDir(add), new_slots=list(range(len(keep), len(p.slot_of))),
                                     guard=guard, threads=threads) if guard else None
            m = os.umask(0)
            os.umask(m)
            os.chmod(tmp, 0o644 & ~m)
    return {"path": str(out), "bytes": p.total_size, "experts": len(p.slot_of), "added": len(p.new),
            "removed": src.n - len(keep), "router": src.router, "sources": len(p.sources), "keep_routing": keep_routing,
            "guard": guarded, "seconds": round(time.perf_counter() - t0, 3)}
