"""SIGKILL a 100-job `mfgguf train-experts` run three times, finish it with the same command, and compare its experts
byte for byte with an uninterrupted run's.

tests/train/fanout/test_whole_run.py does this for three experts at three chosen moments; this does it for a run
of many jobs at seeded random moments, through the real CLI. It builds one RUN under OUT/base (`prepare` of the
built-in corpus, one shard per job, `cluster` where every shard it makes is long enough to train on, else `random`
(see base_run), vocab 512, a `tiny` trunk; both stages are skipped where their outputs exist, so a rerun is cheap),
copies it twice without checkpoints (as tests/conftest.py's `copy_run`), and then:

  A  `mfgguf train-experts A <FLAGS>` once, timed: its wall W. Watching its files it also takes J, a job's wall (the
     seconds from the first expert's record to the last one's over jobs - 1), S, the command's start (the first
     record's moment less J: imports, the disk check, loading the trunk), and P, the seconds from the last
     expert's record to the pooled router statistics' file (their pass over every expert);
  B  the same command, started in a process group of its own (`start_new_session`) so that SIGKILL to the group
     takes everything it started, killed three times, then run again to the end (it must exit 0).

When to kill (uniform over the remaining work, so a kill lands inside the work whatever speed this shared machine
gives the attempt): attempt k starts with `left` jobs not done, so left * J + P seconds of work; u ~ U(0.05, 0.95)
from `--seed`'s RNG and x = u * (left * J + P). The attempt is killed x - n * J seconds after the n-th of its jobs
wrote its record, n = min(left, floor(x / J)); for n = 0, S + x seconds after the attempt's start. A kill in the
last P seconds lands while the statistics are pooled ("phase": "pooling"; "after pooling": their file was written
and the command not yet gone). Every kill must land before the command ends: one that comes after is reported
("landed": false) and fails the benchmark. The moments are seconds on a machine whose speed may change while it runs
(another job beside it), which is why they count from the records this attempt writes, not from its start alone.

Compared: every `modules/*.safetensors` of A and B by sha256 (the 100 experts, the trunk and the pooled router
statistics, modules/router_stats.safetensors, that train-experts writes once every expert is done), each expert's
record's own sha256 against its file, what each record says training gave (RESULT_KEYS: losses, curves, steps), and
B must hold no checkpoint at the end. Prints JSON lines:

  {"bench": "cpu", "model": ..., "flags": [...], "cores": ...}
  {"bench": "setup", "jobs": 100, "partition": "cluster"|"random", "shard_tokens_min": ..., "flags": [...], ...}
  {"bench": "uninterrupted", "wall_s": W, "startup_s": S, "pool_s": P, "per_job_s": J}
  {"bench": "kill", "attempt": k, "landed": true, "at_s": ..., "experts_before": ..., "target_jobs": ...,
   "experts_done": ..., "phase": "job"|"pooling"|"after pooling", "checkpoints": [...], "stats_pooled": ...}
                                                                                                   one per kill
  {"bench": "finish", "wall_s": ..., "rc": 0}
  {"bench": "kills", "jobs": 100, "kills": 3, "identical": true|false, "differing": [...],
   "wall_uninterrupted_s": W, "wall_killed_total_s": ...}

and exits 1 where anything differs or a kill did not land.

    python scripts/bench/bench_kills.py --out ~/bench-kills [--jobs 100] [--tokens 2048] [--seed 0] [--partition auto]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mfgguf.machine import cpu  # noqa: E402
from mfgguf.run import RunDir, read_module_meta  # noqa: E402

# One thread per command, as the test runs it: bit-identity is claimed for the same command on the same machine,
# and on a shared 2-core machine one thread keeps to its share.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
# How often the watcher looks at RUN: a listing of modules/ a look, so that it takes next to nothing of the CPU the
# command it watches trains on (a job takes seconds, so a kill lands within a small share of one of where it aims)
POLL_S = 0.05
# What an expert's record says its training gave, to agree between A and B too (its timings may not: they are the
# machine's, and a resumed job's record says where it resumed)
RESULT_KEYS = ("sha256", "steps", "tokens_seen", "final_loss", "validation_loss", "shard_loss", "history",
               "validation_history", "router_stats_count")


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def base_run(out: Path, jobs: int, chars: int, trunk_tokens: int, partitions: tuple[str, ...]) -> tuple[Path, dict]:
    """OUT/base prepared with `jobs` shards and a trained tiny trunk, each stage reused where it is done; (path, how
    it was partitioned). `cluster` (c-BTM) where every cluster's shard holds a training window, else `random`: on a
    small corpus balanced k-means gathers the corpus's near-empty documents (a few tokens each) into
    clusters of their own, shards too short for a single context, and a job on one fails (driver.get_batch)."""
    from mfgguf.config import get_preset
    from mfgguf.data.prepare import prepare
    from mfgguf.errors import MfggufError
    from mfgguf.options import TrainOptions
    from mfgguf.train.whole.trunk import train_trunk

    root = out / "base"
    rd, need = RunDir(root), get_preset("tiny").model.ctx_len + 1
    tried = {}
    if not (root / "run.json").is_file():
        for partition in partitions:
            shutil.rmtree(root, ignore_errors=True)
            try:
                prepare(["builtin"], root, n_experts=jobs, partition=partition, vocab_size=512,
                        max_chars_per_domain=chars, seed=0, force=True, progress=False)
            except MfggufError as e:  # too few training documents for `jobs` clusters
                tried[partition] = str(e)
                continue
            least = min(int(sh["tokens"]) for sh in rd.info()["shards"])
            if least >= need:
                break
            tried[partition] = f"a shard of {least} tokens, fewer than one context of {need}"
        else:
            raise SystemExit(f"no partition gives every one of {jobs} shards a context: {tried}; raise --chars")
    info = rd.info()
    sizes = [int(sh["tokens"]) for sh in info["shards"]]
    if len(sizes) != jobs or min(sizes) < need:
        raise SystemExit(f"{root} holds {len(sizes)} shards, the least of {min(sizes)} tokens, not {jobs} of at least"
                         f" {need}: remove it or pick another --out")
    if not rd.module_meta(0).is_file():
        train_trunk(root, preset="tiny", options=TrainOptions(tokens=trunk_tokens), progress=False)
    return root, {"partition": info["partition"], "shard_tokens_min": min(sizes), "shard_tokens_max": max(sizes),
                  **({"partition_rejected": tried} if tried else {})}


def fresh_copy(base: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(base, dst, ignore=shutil.ignore_patterns("checkpoints", "logs"))
    return dst


def command(run: Path, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "mfgguf", "train-experts", str(run), *flags]


def done(rd: RunDir, jobs: int) -> int:
    """Experts whose record is written: what train-experts itself counts as trained (one listing, not a look each)."""
    try:
        names = set(os.listdir(rd.modules))
    except FileNotFoundError:
        return 0
    return sum(rd.module_meta(i).name in names for i in range(1, jobs + 1))


def uninterrupted(run: Path, flags: list[str], jobs: int) -> dict:
    """Run A to the end, noting when the first and the last expert's records and the pooled statistics appeared:
    its wall W, and S, J, P as the module docstring says."""
    rd, t0, seen = RunDir(run), time.perf_counter(), {}
    proc = subprocess.Popen(command(run, flags), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    while proc.poll() is None:  # the output is small (--no-progress), so the pipe never fills while we poll
        now, n = time.perf_counter() - t0, done(rd, jobs)
        if n >= 1:
            seen.setdefault("first", now)
        if n == jobs:
            seen.setdefault("last", now)
        if n == jobs and rd.router_stats.is_file():
            seen.setdefault("pooled", now)
        time.sleep(POLL_S)
    wall = time.perf_counter() - t0
    out = proc.stdout.read()
    if proc.returncode != 0 or len(seen) < 3:
        raise SystemExit(f"the uninterrupted run failed ({proc.returncode}) or went unseen ({seen}):\n{out}")
    j = (seen["last"] - seen["first"]) / (jobs - 1)
    return {"wall_s": wall, "startup_s": max(0.0, seen["first"] - j), "per_job_s": j,
            "pool_s": seen["pooled"] - seen["last"]}


def killed_attempt(run: Path, flags: list[str], jobs: int, u: float, s: float, j: float, p: float) -> dict:
    """One attempt of B, SIGKILLed as the module docstring's rule says (S, J, P = s, j, p); what it left."""
    rd = RunDir(run)
    before = done(rd, jobs)
    x = u * ((jobs - before) * j + p)
    n = min(jobs - before, int(x // j))
    t0 = time.perf_counter()
    proc = subprocess.Popen(command(run, flags), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)
    try:
        if n == 0:  # inside this attempt's first job (or the pooling, where no job is left): the start counts
            fire = t0 + s + x
        else:
            while done(rd, jobs) < before + n and proc.poll() is None:
                time.sleep(POLL_S)
            fire = time.perf_counter() + x - n * j
        while time.perf_counter() < fire and proc.poll() is None:
            time.sleep(max(0.0, min(POLL_S, fire - time.perf_counter())))
        at = time.perf_counter() - t0
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the group: the command and any job process it started
    finally:
        out, _ = proc.communicate(timeout=120)
    wall = time.perf_counter() - t0
    after, pooled = done(rd, jobs), rd.router_stats.is_file()
    return {"landed": proc.returncode == -signal.SIGKILL, "rc": proc.returncode, "at_s": round(at, 2),
            "wall_s": round(wall, 2), "experts_before": before, "target_jobs": round(before + x / j, 2),
            "experts_done": after, "phase": "job" if after < jobs else "after pooling" if pooled else "pooling",
            "checkpoints": sorted(c.parent.name for c in rd.root.glob("checkpoints/*/state.safetensors")),
            "stats_pooled": pooled, "output_tail": out[-400:] if proc.returncode >= 0 else None}


def sha(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def compare(a: Path, b: Path, jobs: int) -> list[str]:
    """Names whose bytes differ between A and B, or whose record disagrees with its file, or that one lacks."""
    ra, rb = RunDir(a), RunDir(b)
    names = sorted({p.name for rd in (ra, rb) for p in rd.modules.glob("*.safetensors")})
    want = {ra.module_file(i).name for i in range(1, jobs + 1)} | {ra.router_stats.name}
    differing = sorted(want - set(names))  # neither run wrote it
    for n in names:
        fa, fb = ra.modules / n, rb.modules / n
        if not (fa.is_file() and fb.is_file()) or sha(fa) != sha(fb):
            differing.append(n)
    for i in range(1, jobs + 1):
        if not (ra.module_meta(i).is_file() and rb.module_meta(i).is_file()):
            continue  # its module file is already named above
        ma, mb = read_module_meta(ra, i), read_module_meta(rb, i)
        differing += [f"{ra.module_meta(i).name}:{k}" for k in RESULT_KEYS if ma.get(k) != mb.get(k)]
        differing += [f"{rd.root.name}/{rd.module_meta(i).name}: sha256 not its file's"
                      for rd, m in ((ra, ma), (rb, mb))
                      if not rd.module_file(i).is_file() or m.get("sha256") != sha(rd.module_file(i))]
    if list(rb.root.glob("checkpoints/*/*")):  # the finishing command drops every finished job's checkpoint
        differing.append("B: checkpoints left")
    return differing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-kills"), help="where base, A and B are built")
    ap.add_argument("--jobs", type=int, default=100, help="experts (one job each)")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="the kill moments' RNG")
    ap.add_argument("--tokens", type=int, default=2048, help="each job's training tokens (tiny: 512 a step)")
    ap.add_argument("--ckpt-every", type=int, default=2, help="steps between checkpoints: a kill mid-job resumes"
                    " from the last one and redoes the steps after it")
    ap.add_argument("--eval-tokens", type=int, default=512, help="held-out tokens per domain at each job's end")
    ap.add_argument("--chars", type=int, default=2_000_000, help="built-in corpus characters per domain (fewer"
                    " leave a random partition empty shards)")
    ap.add_argument("--partition", choices=("auto", "cluster", "random"), default="auto",
                    help="auto: cluster where every shard is long enough to train on, else random")
    ap.add_argument("--trunk-tokens", type=int, default=10_240)
    a = ap.parse_args()
    if a.jobs < 2:
        raise SystemExit("--jobs must be at least 2 (a job's wall is measured between two records)")

    emit(bench="cpu", **cpu())
    a.out.mkdir(parents=True, exist_ok=True)
    base, parts = base_run(a.out, a.jobs, a.chars, a.trunk_tokens,
                           ("cluster", "random") if a.partition == "auto" else (a.partition,))
    # the same explicit flags for A and B; one job at a time in the command's own process (--in-process), so
    # a kill takes the job with it and the next command resumes it from its checkpoint
    flags = ["--in-process", "--tokens", str(a.tokens), "--ckpt-every", str(a.ckpt_every), "--eval-tokens",
             str(a.eval_tokens), "--curve-tokens", str(a.eval_tokens), "--eval-every", "0", "--seed", "0",
             "--keep-free", "0", "--no-progress"]
    emit(bench="setup", jobs=a.jobs, **parts, preset="tiny", vocab=512, chars_per_domain=a.chars,
         flags=flags, kill_seed=a.seed)

    run_a = fresh_copy(base, a.out / "A")
    t = uninterrupted(run_a, flags, a.jobs)
    wall_a, startup, per_job, pool = t["wall_s"], t["startup_s"], t["per_job_s"], t["pool_s"]
    emit(bench="uninterrupted", **{k: round(v, 3) for k, v in t.items()})

    run_b = fresh_copy(base, a.out / "B")
    rng, total, landed = random.Random(a.seed), 0.0, 0
    for k in range(1, a.kills + 1):
        row = killed_attempt(run_b, flags, a.jobs, rng.uniform(0.05, 0.95), startup, per_job, pool)
        total += row["wall_s"]
        landed += row["landed"]
        emit(bench="kill", attempt=k, **{key: v for key, v in row.items() if v is not None})
        if not row["landed"]:
            break  # the command ended first: nothing left to kill
    t0 = time.perf_counter()
    fin = subprocess.run(command(run_b, flags), capture_output=True, text=True, env=ENV)
    fin_s = time.perf_counter() - t0
    total += fin_s
    emit(bench="finish", wall_s=round(fin_s, 2), rc=fin.returncode,
         **({"output_tail": (fin.stdout + fin.stderr)[-400:]} if fin.returncode else {}))

    differing = compare(run_a, run_b, a.jobs)
    identical = not differing and fin.returncode == 0
    emit(bench="kills", jobs=a.jobs, kills=landed, identical=identical, differing=differing,
         wall_uninterrupted_s=round(wall_a, 2), wall_killed_total_s=round(total, 2))
    sys.exit(0 if identical and landed == a.kills else 1)


if __name__ == "__main__":
    main()
