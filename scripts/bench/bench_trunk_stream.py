"""Trunk training in bounded memory, measured: in-memory vs layer-streamed, same run.

Each configuration trains the trunk for a few steps in its own process (`mfgguf train-trunk`) and
prints one JSON line: peak RSS (the process's own, os.wait4), peak memory of its cgroup (RSS +
page cache) where one could be made, tokens/s of the training steps (held-out scoring excluded),
bytes read/written per step and disk space of the streamed state.

The streamed runs are measured as on an 8 GB laptop, not this machine's page cache: each runs in
a cgroup v1 memory group limited to the budget (`memory.limit_in_bytes` counts the page cache)
when this machine allows one (root, cgroup v1), and in any case drops every streamed file's pages
after use (posix_fadvise), so each step really reads from disk. The output says which applied.

    python scripts/bench/bench_trunk_stream.py                       # 1b preset, 2 steps each (~25 min)
    python scripts/bench/bench_trunk_stream.py --preset small --steps 4   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mfgguf.config import get_preset  # noqa: E402
from mfgguf.run import RunDir  # noqa: E402
from mfgguf.stages import run_stage  # noqa: E402

CGROUP = Path("/sys/fs/cgroup/memory")


def emit(out: Path, **rec) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    with open(out / "bench_trunk_stream.jsonl", "a") as f:
        f.write(line + "\n")


def make_cgroup(name: str, limit: int) -> Path | None:
    """A cgroup v1 memory group limited to `limit` bytes (page cache included), or None."""
    g = CGROUP / name
    try:
        g.mkdir(exist_ok=True)
        (g / "memory.limit_in_bytes").write_text(str(limit))
        (g / "memory.max_usage_in_bytes").write_text("0")  # reset the peak
        return g
    except OSError:
        return None


def train(run: RunDir, out: Path, tag: str, steps: int, batch: int, ctx: int, preset: str, extra: list,
          cgroup_limit: int | None) -> dict:
    for d in (run.root / "checkpoints", run.module_file(0), run.module_meta(0)):
        shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
    accum = int(extra[extra.index("--accum") + 1]) if "--accum" in extra else 1
    tokens = steps * batch * accum * ctx
    args = ["train-trunk", run.root, "--preset", preset, "--tokens", tokens, "--eval-tokens", ctx, "--eval-every", 0,
            "--no-progress", *extra]
    group = make_cgroup(f"mfgguf-bench-{os.getpid()}", cgroup_limit) if cgroup_limit else None
    if group is not None:  # the child joins the group, then becomes mfgguf (same pid: wait4 sees it)
        from mfgguf.stages import mfgguf_argv

        argv = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *map(str, mfgguf_argv(*args))]
        try:
            r, _ = run_stage(tag, [sys.executable, "-c", "import os,sys; os.execvp(sys.argv[1], sys.argv[1:])", *argv])
            cg_peak = int((group / "memory.max_usage_in_bytes").read_text())
            failcnt = int((group / "memory.failcnt").read_text())
        finally:
            group.rmdir()  # also when the stage failed: no group left behind
    else:
        r, _ = run_stage(tag, args)
        cg_peak = failcnt = None
    meta = json.loads(run.module_meta(0).read_text())
    s = meta.get("streamed") or {}
    rec = dict(config=tag, preset=preset, steps=meta["steps"], batch=batch * accum, tokens=meta["tokens_seen"],
               peak_rss_mb=r.peak_rss_mb, tokens_per_s=round(meta["tokens_per_s"], 1), wall_s=r.wall_s,
               train_s=round(meta["train_s"], 1), final_loss=round(meta["final_loss"], 4))
    if s:
        rec.update(micro_batch=s["micro_batch"], accum=s["accum"], budget_mb=round(s["memory_budget"] / 2**20),
                   disk_gb=round(s["disk_bytes"] / 1e9, 3), read_gb_per_step=round(s["read_bytes_per_step"] / 1e9, 3),
                   written_gb_per_step=round(s["written_bytes_per_step"] / 1e9, 3),
                   page_cache="dropped after use (posix_fadvise DONTNEED)",
                   limited_by=(f"cgroup v1 memory.limit_in_bytes = {cgroup_limit} (RSS + page cache)" if group is not None
                               else "no cgroup (not permitted here): posix_fadvise only"))
        if cg_peak is not None:
            rec.update(cgroup_peak_mb=round(cg_peak / 2**20, 1), cgroup_limit_hits=failcnt)
    emit(out, **rec)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "trunk-stream")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per configuration")
    ap.add_argument("--budget", default="1.5G")
    ap.add_argument("--accum", type=int, default=None, help="accumulation of the third row (default: train-trunk's)")
    ap.add_argument("--chars-per-domain", type=int, default=1_500_000)
    ap.add_argument("--skip-in-memory", action="store_true")
    ap.add_argument("--skip-same-batch", action="store_true", help="only the accumulation row (and the references)")
    ap.add_argument("--cgroup-extra", default="0", help="cgroup limit = budget + this (page cache beside the process),"
                    " e.g. 1G; the default 0 is the strictest measure")
    a = ap.parse_args()
    from mfgguf.train.whole.trunk import STREAMED_ACCUM, parse_size

    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    run = RunDir(out / "run")
    p = get_preset(a.preset)
    if not run.run_json.is_file():
        run_stage("prepare", ["prepare", "builtin", "--out", run.root, "--experts", 1, "--vocab-size", p.model.vocab_size,
                              "--max-chars-per-domain", a.chars_per_domain])
    emit(out, bench="trunk-stream", event="start", preset=a.preset, steps=a.steps, budget=a.budget, cpus=os.cpu_count(),
         cgroup=CGROUP.is_dir() and os.access(CGROUP, os.W_OK))
    budget = parse_size(a.budget)
    limit = budget + (parse_size(a.cgroup_extra) if a.cgroup_extra not in ("0", "") else 0)
    batch, ctx = p.trunk.batch_size, p.model.ctx_len
    rows = {}
    if not a.skip_in_memory:
        rows["memory"] = train(run, out, "in-memory", a.steps, batch, ctx, a.preset, ["--no-stream"], None)
    if not a.skip_same_batch:
        rows["same"] = train(run, out, "streamed, same batch", a.steps, batch, ctx, a.preset,
                             ["--memory-budget", a.budget, "--stream", "--accum", 1], limit)
    acc = a.accum or STREAMED_ACCUM
    rows["accum"] = train(run, out, f"streamed, accum {acc}", a.steps, batch, ctx, a.preset,
                          ["--memory-budget", a.budget, "--stream", "--accum", acc], limit)
    if "memory" in rows:
        # in memory again: this machine's speed drifts by 20% between minutes, so the reference
        # is the mean of a run before and one after the streamed ones
        again = train(run, out, "in-memory (again)", a.steps, batch, ctx, a.preset, ["--no-stream"], None)
        m = rows["memory"]
        ref = (m["tokens_per_s"] + again["tokens_per_s"]) / 2
        emit(out, metric="trunk_stream", preset=a.preset, in_memory_peak_rss_mb=m["peak_rss_mb"],
             streamed_peak_rss_mb=max(r["peak_rss_mb"] for k, r in rows.items() if k != "memory"),
             goal_rss_mb=f"<= {budget / 2**20:.0f}", in_memory_tokens_per_s=[m["tokens_per_s"], again["tokens_per_s"]],
             throughput_same_batch=round(rows["same"]["tokens_per_s"] / ref, 3) if "same" in rows else None,
             goal_same=">= 0.6", cgroup_limit_bytes=limit,
             throughput_accum=round(rows["accum"]["tokens_per_s"] / ref, 3), goal_accum=">= 0.9",
             accum=acc)


if __name__ == "__main__":
    main()
