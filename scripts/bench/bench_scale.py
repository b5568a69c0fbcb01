"""The mission claim, measured: the `1b` preset (100 experts of ~9.4M parameters + trunk, ~1.27B).

Prints JSON lines (one per measurement) and writes them to OUT/bench_scale.jsonl:
  - peak RSS of training the trunk (layer-streamed, --memory-budget 1.5G) and of one expert (max
    over all expert processes), of assembling all 100
    (q8_0 and q4_k), and of loading the q8_0 result in llama-cpp-python and generating 128 tokens;
  - GGUF size on disk, total and active parameters per token;
  - prompt and decode tokens/s of the assembled MoE and of a dense llama model with the same
    active parameters written by the same code, in the same run;
  - assembly wall time and the same run's plain-I/O reference time.

The trunk and the experts train for only a few steps here: this measures the system (memory,
speed, file sizes), not model quality. Every expert really trains, in its own process.

    python scripts/bench/bench_scale.py                  # the full run (about 40 minutes on 2 cores)
    python scripts/bench/bench_scale.py --experts 8      # a quicker look at the same measurements
    python scripts/bench/bench_scale.py --shared attn    # + one row: peak RSS of an expert with --shared attn
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
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

from mfgguf.run import RunDir  # noqa: E402
from mfgguf.stages import run_stage  # noqa: E402

INFER = r"""
import json, sys, time
from mfgguf.runtime.llm import loaded
path, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = int(sys.argv[5]) if len(sys.argv) > 5 and int(sys.argv[5]) else None  # experts a token; None: the file's own
t0 = time.perf_counter()
with loaded(path, n_ctx=n_prompt + n_gen, experts_per_token=k) as llm:
    t_load = time.perf_counter() - t0
    prompt = (llm.tokenize(open(sys.argv[4]).read().encode(), add_bos=False) * 50)[:n_prompt]
    t0 = time.perf_counter(); llm.eval(prompt); t_prompt = time.perf_counter() - t0
    tok, t0 = prompt[-1], time.perf_counter()
    for _ in range(n_gen):  # greedy decode, one token at a time: the chat/generate hot path
        tok = int(llm.sample(temp=0.0)); llm.eval([tok])
    t_gen = time.perf_counter() - t0
print(json.dumps({"load_s": t_load, "prompt_tps": n_prompt / t_prompt, "decode_tps": n_gen / t_gen, "n_prompt": n_prompt,
                  "n_gen": n_gen}))
"""


def emit(out: Path, **rec) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    with open(out / "bench_scale.jsonl", "a") as f:
        f.write(line + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "scale")
    ap.add_argument("--experts", type=int, default=100)
    ap.add_argument("--trunk-tokens", type=int, default=4096, help="trunk training tokens (1 step of 8 x 512)")
    ap.add_argument("--expert-tokens", type=int, default=2048, help="training tokens per expert (1 step of 4 x 512)")
    ap.add_argument("--chars-per-domain", type=int, default=1_500_000)
    ap.add_argument("--fresh", action="store_true", help="delete OUT first instead of resuming")
    ap.add_argument("--shared", default="none", help="also measure one expert trained with `--shared` this"
                    " (norms, attn, all); its module is set aside, the assembled experts stay plain")
    a = ap.parse_args()

    out: Path = a.out
    if a.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    run = RunDir(out / "run")
    emit(out, bench="scale", event="start", experts=a.experts, machine=f"{os.cpu_count()} cores",
         note="trunk and experts train only a few steps: this measures the system, not model quality",
         rss_note="peak RSS is each stage's own process (os.wait4); Linux counts the parent's RSS at spawn as a"
                  " floor, so the parent's own peak is printed at the end for reference")

    if not run.run_json.is_file():
        r, _ = run_stage("prepare", ["prepare", "builtin", "--out", run.root, "--experts", a.experts,
                                     "--partition", "random", "--vocab-size", 32768,
                                     "--max-chars-per-domain", a.chars_per_domain])
        emit(out, stage="prepare", wall_s=r.wall_s, peak_rss_mb=r.peak_rss_mb)
    if not run.module_meta(0).is_file():
        # layer-streamed within 1.5 GiB (in memory it peaks at 5.7 GB): --accum 1 keeps one step of 8 x 512
        r, _ = run_stage("train-trunk", ["train-trunk", run.root, "--preset", "1b", "--tokens", a.trunk_tokens,
                                         "--eval-tokens", 1024, "--memory-budget", "1.5G", "--accum", 1])
        emit(out, stage="train-trunk", wall_s=r.wall_s, peak_rss_mb=r.peak_rss_mb, tokens=a.trunk_tokens)
        emit(out, metric="train_trunk_peak_rss_mb", value=r.peak_rss_mb, goal="<= 1536", memory_budget="1.5G")

    if a.shared != "none":
        shared_expert_row(out, run, a.shared, a.expert_tokens)
    rss, walls = [], []
    for i in range(1, a.experts + 1):
        if run.module_meta(i).is_file():
            continue
        r, _ = run_stage(f"expert {i}", ["train-expert", run.root, "--expert", i, "--tokens", a.expert_tokens,
                                         "--eval-tokens", 1024])
        rss.append(r.peak_rss_mb)
        walls.append(r.wall_s)
        emit(out, stage="train-expert", expert=i, wall_s=r.wall_s, peak_rss_mb=r.peak_rss_mb)
    if rss:
        emit(out, metric="train_expert_peak_rss_mb", value=max(rss), mean_wall_s=sum(walls) / len(walls),
             goal="<= 1536", n=len(rss))

    from bench_assemble import module_inputs

    from mfgguf.run import router_stats_current

    if not router_stats_current(run):  # the router's pooled second moment (module format 2)
        r, _ = run_stage("router-stats", ["router-stats", run.root, "--no-progress"])
        emit(out, stage="router-stats", wall_s=r.wall_s, peak_rss_mb=r.peak_rss_mb)
    in_bytes = sum(p.stat().st_size for p in module_inputs(run, a.experts))
    for quant in ("q8_0", "q4_k"):
        gguf = out / f"moe-{quant}.gguf"
        r, _ = run_stage(f"assemble {quant}", ["assemble", run.root, "-o", gguf, "--quant", quant, "--force"])
        ref = plain_io_seconds(module_inputs(run, a.experts), gguf.stat().st_size, out)
        emit(out, metric="assemble", quant=quant, wall_s=r.wall_s, peak_rss_mb=r.peak_rss_mb, goal_rss_mb="<= 256",
             gguf_bytes=gguf.stat().st_size, input_bytes=in_bytes, plain_io_s=round(ref, 2),
             ratio_to_plain_io=round(r.wall_s / ref, 2))

    from mfgguf.gguf.inspect import inspect_gguf

    moe = out / "moe-q8_0.gguf"
    info = inspect_gguf(moe)
    emit(out, metric="params", total=info["params_total"], active_per_token=info["params_active"],
         gguf_bytes=moe.stat().st_size, gguf_gib=round(moe.stat().st_size / 2**30, 3))

    dense = dense_model(run, out)
    sample = ROOT / "README.md"
    res = {}
    for name, path in (("moe_q8_0", moe), ("dense_q8_0", dense)):
        r, text = run_stage(f"infer {name}", [sys.executable, "-c", INFER, str(path), "256", "128", str(sample)],
                            capture=True)
        res[name] = json.loads(text.strip().splitlines()[-1])
        emit(out, metric="inference", model=name, file_bytes=path.stat().st_size, peak_rss_mb=r.peak_rss_mb,
             goal_rss_mb="<= 1536" if name == "moe_q8_0" else None, **res[name])
    import resource

    emit(out, metric="bench_parent_peak_rss_mb", value=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    emit(out, metric="moe_over_dense_decode", value=round(res["moe_q8_0"]["decode_tps"] / res["dense_q8_0"]["decode_tps"], 3),
         goal=">= 0.7", prompt_ratio=round(res["moe_q8_0"]["prompt_tps"] / res["dense_q8_0"]["prompt_tps"], 3))


def shared_expert_row(out: Path, run: RunDir, shared: str, tokens: int) -> None:
    """Train expert 1 with --shared and record its peak RSS, leaving expert 1's plain module as it was."""
    files = (run.module_file(1), run.module_meta(1))
    manifest = run.manifest.read_text()  # the shared module's entry must not outlive it
    kept = [f.rename(f.with_name(f.name + ".plain")) for f in files if f.is_file()]
    try:
        r, _ = run_stage(f"expert 1 --shared {shared}", ["train-expert", run.root, "--expert", 1, "--tokens", tokens,
                                                          "--eval-tokens", 1024, "--shared", shared])
    finally:
        for f in files:
            f.unlink(missing_ok=True)
        for f in kept:
            f.rename(f.with_name(f.name.removesuffix(".plain")))
        run.manifest.write_text(manifest)
    emit(out, metric="train_expert_shared_peak_rss_mb", shared=shared, value=r.peak_rss_mb, wall_s=r.wall_s,
         goal="<= 2048")


def plain_io_seconds(inputs: list[Path], out_bytes: int, out: Path) -> float:
    """bench_assemble's reference: read every file of `inputs`, write `out_bytes` into OUT, fsync."""
    from bench_assemble import io_reference

    tmp = out / ".plain-io.tmp"
    r, _ = run_stage("plain I/O", [sys.executable, "-c", io_reference(inputs, out_bytes, tmp)])
    tmp.unlink()
    return r.wall_s


def dense_model(run: RunDir, out: Path) -> Path:
    """A dense llama GGUF with the MoE's active parameters (anchor widened by one expert), same writer.

    Built in a child process: writing a 1.3 GB random trunk would otherwise raise this process's
    RSS, which Linux folds into every later child's peak RSS.
    """
    from mfgguf.run import read_module_meta

    cfg = read_module_meta(run, 0)["config"]
    dense_run = out / "dense-run"
    path = out / "dense-q8_0.gguf"
    if not path.is_file():
        if dense_run.exists():
            shutil.rmtree(dense_run)
        code = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); from pathlib import Path; "
                f"from synthetic_run import build; build(Path({str(dense_run)!r}), preset='1b', n_experts=0, "
                f"vocab={cfg['vocab_size']}, tokenizer=Path({str(run.tokenizer)!r}), "
                f"anchor_ff={cfg['anchor_ff'] + cfg['expert_ff']})")
        run_stage("build dense", [sys.executable, "-c", code])
        run_stage("assemble dense", ["assemble", dense_run, "-o", path, "--quant", "q8_0", "--experts", "none", "--force"])
    return path


if __name__ == "__main__":
    main()
