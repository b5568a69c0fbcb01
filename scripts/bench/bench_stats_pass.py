"""Wall and peak RSS of the router-statistics pass, in memory and layer-streamed, and of the `assemble` that runs it.

Assembly streams, never holding a module whole (docs/memory.md); where a RUN's pooled router statistics are
missing or stale, `mfgguf assemble` first runs the statistics pass (train/experts/pooled.py). That pass built
trunk + expert as one model and scored the sample with loop.evaluate, head included; it now streams the layers
(train/experts/stats_pass.py). This measures both passes over the same experts and samples, each in a fresh
process, and then the whole `mfgguf assemble` with the statistics removed first, so that it runs the pass.

On the README's real-base run (built once into OUT when it is not there, from the SmolLM2 base in the cache:
`import-base smollm2`, `prepare study --experts 5`, one short `train-expert --expert 2`), prints JSON lines:

  {"bench": "cpu", "model": ..., "avx2": ..., "avx512": ..., "bf16_native": ..., "cores": ...}
  {"bench": "run", "largest_module": ..., "largest_module_mb": ..., "experts": [...], "precision": ..., "passes_precision": ...}
  {"bench": "pass", "pass": "in_memory" | "streamed", "wall_s": ..., "peak_rss_mb": ..., "over_largest_mb": ...}
  {"bench": "assemble", "wall_s": ..., "peak_rss_mb": ..., "over_largest_mb": ..., "stats_s": ...}
  {"bench": "agree", "max_rel_diff": ...}   the two passes' second moments, largest |a - b| / max |b| over layers

wall_s and peak_rss_mb are medians over --repeats; peak RSS is each child's VmHWM (wait4's ru_maxrss);
over_largest_mb is peak RSS less the largest module file's size (the design's budget: 200 MB); stats_s is
the pass's own seconds as the statistics' JSON records them.

    python scripts/bench/bench_stats_pass.py OUT                          # experts 2, q8_0
    python scripts/bench/bench_stats_pass.py OUT --repeats 3 --experts 2
    python scripts/bench/bench_stats_pass.py OUT --precision fp32          # the passes as a CPU without native bf16 runs them
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

from bench_train import cpu_flags  # noqa: E402

PASS = """
import sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from mfgguf.config import ModelConfig
from mfgguf.run import RunDir, read_module_meta
from mfgguf.train.engine.loop import evaluate, load_tokens, resolve_device
from mfgguf.train.engine.weights import read_safetensors
from mfgguf.train.experts.expert import build_expert_model
from mfgguf.train.experts.stats import RouterStats, stats_tokens
from mfgguf.train.experts.stats_pass import stream_stats
from mfgguf.train.rounds.restat import precision_of

run, which, experts, out = Path(sys.argv[1]), sys.argv[2], [int(i) for i in sys.argv[3].split(",")], sys.argv[4]
rd = RunDir(run)
cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
dev = resolve_device("cpu")
prec = sys.argv[5] or precision_of(read_module_meta(rd, experts[0]))
stats = RouterStats(cfg.n_layers, cfg.dim, second_moment=True)
with torch.no_grad():
    if which == "in_memory":  # pooled.py's pass before the streamed one: the model whole, scored with its head
        model = build_expert_model(rd, cfg, 0, dev, bf16_trunk=prec == "bf16", trunk_path=rd.module_file(0))
    for i in experts:
        n, shard = stats_tokens(read_module_meta(rd, i)["train"]), load_tokens(rd.shard(i), "shard")
        if which == "in_memory":
            model.load_expert(dict(read_safetensors(rd.module_file(i))))
            evaluate(model, shard, n, "single", dev, prec, hook=stats.hook)
        else:
            stream_stats(cfg, rd.module_file(0), shard, n, stats.hook, expert_path=rd.module_file(i),
                         dev=dev, precision=prec)
save_file({k: v.contiguous() for k, v in stats.tensors().items() if k.endswith("second_moment")}, out)
"""


def child(args: list[str], env: dict | None = None) -> dict:
    """Run `args` in a fresh process: its wall and peak RSS (wait4's ru_maxrss, the child's VmHWM)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(args[:3])}... failed: {proc.stderr.read().decode()[-2000:]}")
    return {"wall_s": round(wall, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def build(out: Path, expert: int) -> None:
    """The README's real-base run: the SmolLM2 base imported, the study corpus prepared, expert `expert` trained
    briefly (one step is enough to measure memory)."""
    cli = [sys.executable, "-m", "mfgguf"]
    if not (out / "modules" / "trunk.json").is_file():
        subprocess.run([*cli, "import-base", "smollm2", "--out", str(out)], cwd=ROOT, check=True)
    if not (out / "run.json").is_file() or not list((out / "data").glob("shard_*.npy")):
        subprocess.run([*cli, "prepare", "study", "--out", str(out), "--experts", "5", "--max-chars-per-domain",
                        "1000000", "--test-frac", "0.02"], cwd=ROOT, check=True)
    if not (out / "modules" / f"expert_{expert:03d}.json").is_file():
        subprocess.run([*cli, "train-expert", str(out), "--expert", str(expert), "--tokens", "4096", "--eval-tokens",
                        "1024", "--no-progress"], cwd=ROOT, check=True)


def median(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the RUN (built from the SmolLM2 base when absent)")
    ap.add_argument("--experts", default="2", help="experts the passes and the assembly take, I,J")
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--precision", default="", help="the passes' precision (bf16, fp32; default: the experts'; the"
                    " assembly's pass always runs at the experts')")
    a = ap.parse_args()
    experts = [int(i) for i in a.experts.split(",")]
    for i in experts:
        build(a.out, i)
    print(json.dumps({"bench": "cpu", **{k: v for k, v in cpu_flags().items() if k != "flags"}}), flush=True)
    modules = sorted((a.out / "modules").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    largest = modules[-1].stat().st_size / 2**20
    prec = json.loads((a.out / "modules" / f"expert_{experts[0]:03d}.json").read_text()).get("precision")
    print(json.dumps({"bench": "run", "largest_module": modules[-1].name, "largest_module_mb": round(largest, 1),
                      "experts": experts, "precision": prec, "passes_precision": a.precision or prec}), flush=True)
    moments = {}
    for which in ("in_memory", "streamed"):
        moments[which] = a.out.parent / f"{a.out.name}.{which}.safetensors"
        m = median([child([sys.executable, "-c", PASS, str(a.out), which, a.experts, str(moments[which]), a.precision])
                    for _ in range(a.repeats)])
        print(json.dumps({"bench": "pass", "pass": which, **m, "over_largest_mb": round(m["peak_rss_mb"] - largest, 1)}),
              flush=True)
    rows, secs = [], []
    for _ in range(a.repeats):
        for f in (a.out / "modules").glob("router_stats.*"):
            f.unlink()  # missing statistics: assemble runs the pass first
        rows.append(child([sys.executable, "-m", "mfgguf", "assemble", str(a.out), "-o", str(a.out.parent / "bench.gguf"),
                           "--experts", a.experts, "--quant", a.quant, "--force", "--quiet"]))
        secs.append(json.loads((a.out / "modules" / "router_stats.json").read_text())["seconds"])
    m = median(rows)
    print(json.dumps({"bench": "assemble", **m, "over_largest_mb": round(m["peak_rss_mb"] - largest, 1),
                      "stats_s": statistics.median(secs), "quant": a.quant}), flush=True)
    from safetensors.numpy import load_file

    old, new = (load_file(moments[w]) for w in ("in_memory", "streamed"))
    diff = max(float(abs(new[k] - old[k]).max() / max(abs(old[k]).max(), 1e-30)) for k in old)
    print(json.dumps({"bench": "agree", "max_rel_diff": diff}), flush=True)


if __name__ == "__main__":
    main()
