"""The design card's 1B on a real base: 100 experts of ~10M parameters on SmolLM2-135M-Instruct (or on another base).

Prints JSON lines (one per measurement) and appends them to OUT/bench_real_base.jsonl:
  - import-base of the Q4_1 file (wall, peak RSS); one expert really trained (wall, peak RSS);
  - the other experts are the seed plus a small Gaussian perturbation (--perturb x each tensor's
    std), with expert 1's recorded means perturbed alike: this measures the system (files, memory,
    speed), not model quality, which docs/regime.md and `mfgguf eval` measure;
  - assembly of all experts, q8_0 and q4_k: wall time against the same run's plain I/O (read
    every module, write as many bytes as the GGUF, fsync), peak RSS, file size, total and active
    parameters per token;
  - llama-cpp-python on the MoE (q8_0, q4_k) and on the base itself (the Q4_1 file, and the
    imported trunk as q8_0): load seconds, prompt and decode tokens/s (greedy, one token at a
    time), peak RSS; the design card's budget is 8 GB;
  - `extend` adding a 101st expert trained against the same base in another RUN (wall, RSS,
    against plain I/O of the file it copies).

    make smollm2 && python scripts/bench/bench_real_base.py             # ~15 minutes on 2 cores
    python scripts/bench/bench_real_base.py --experts 8 --out /tmp/rb8   # a quicker look
    python scripts/bench/bench_real_base.py --base qwen2.5-0.5b --out bench-out/real-base-qwen2.5 --repeats 1
        # Qwen2.5-0.5B's published shape, random weights (scripts/bench/bench_bases.py builds it): its qwen2moe MoE

With a base that is not a GGUF (a Hugging Face directory, or a published shape built here) there is no base
file to compare bytes and logits with: the parity check and the base file's inference row are left out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

from bench_assemble import assemble_code, module_inputs, run_child  # noqa: E402
from bench_bases import FAMILIES, build_hf  # noqa: E402
from bench_scale import INFER, plain_io_seconds  # noqa: E402
from bench_train import cpu_flags  # noqa: E402

from mfgguf.base.known import resolve_base  # noqa: E402
from mfgguf.run import RunDir, read_module_meta, write_module  # noqa: E402
from mfgguf.stages import run_stage  # noqa: E402

PARITY = r"""
import json, sys
import gguf, numpy as np
from mfgguf.runtime.llm import loaded
f32, q41, base, text = sys.argv[1:5]
def logits(path, ids):
    with loaded(path, n_ctx=len(ids), n_batch=len(ids), logits_all=True) as llm:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)])
with loaded(base, n_ctx=64) as llm:
    ids = llm.tokenize(open(text).read().encode(), add_bos=False)[:512]
a, b = logits(f32, ids), logits(base, ids)  # (T, V) each
d = np.abs(a - b)
ours, theirs = gguf.GGUFReader(q41), gguf.GGUFReader(base)
mine = {t.name: t for t in ours.tensors}
same = [t.name for t in theirs.tensors if mine[t.name].tensor_type == t.tensor_type and np.array_equal(mine[t.name].data, t.data)]
keys = lambda r: {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}
print(json.dumps({"tokens": len(ids), "max_abs_diff": float(d.max()), "max_abs_logit": float(np.abs(b).max()),
                  "max_rel_diff": float(d.max() / np.abs(b).max()),
                  "worst_row_rel_diff": float((d.max(1) / np.abs(b).max(1)).max()),
                  "argmax_agreement": float((a.argmax(1) == b.argmax(1)).mean()),
                  "q4_1_tensors_identical": len(same), "base_tensors": len(theirs.tensors),
                  "differing": sorted(set(t.name for t in theirs.tensors) - set(same)),
                  "tokenizer_keys_identical": keys(ours) == keys(theirs)}))
"""


class Bench:
    """The JSON lines of one run: printed and appended to OUT/bench_real_base.jsonl."""

    def __init__(self, out: Path):
        self.out = out

    def emit(self, **rec) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        with open(self.out / "bench_real_base.jsonl", "a") as f:
            f.write(line + "\n")

    def plain_io(self, inputs: list[Path], out_bytes: int) -> float:
        return plain_io_seconds(inputs, out_bytes, self.out)


def perturbed_experts(run: RunDir, n: int, scale: float, seed: int = 0) -> None:
    """Experts 2..n: the seed FFN + N(0, (scale x tensor std)^2), means of expert 1's statistics alike."""
    from safetensors.numpy import load_file

    trunk = load_file(run.module_file(0))
    first = load_file(run.module_file(1))
    meta = {k: v for k, v in read_module_meta(run, 1).items() if k not in ("sha256", "blake3", "bytes", "file", "name")}
    rng = np.random.default_rng(seed)
    for i in range(2, n + 1):
        if run.module_meta(i).is_file():
            continue
        tensors = {}
        for k, v in first.items():
            src = trunk[k.replace(".weight", "_seed.weight")] if k.startswith("blk.") and "ffn_" in k else v
            tensors[k] = (src + rng.normal(0.0, scale * float(src.std()), src.shape)).astype(np.float32)
        write_module(run, i, tensors, {**meta, "index": i, "shard": i, "synthetic": f"seed + N(0, ({scale} std)^2)"})


def parity(b: Bench, run: RunDir, base: Path, out: Path) -> None:
    """llama.cpp's logits of the imported trunk (f32) against the Q4_1 file on real text; the trunk
    re-quantized as q4_1 against the file's bytes; the tokenizer keys."""
    files = {q: out / f"trunk-{q}.gguf" for q in ("f32", "q4_1")}
    for q, path in files.items():
        run_stage(f"assemble trunk {q}", ["assemble", run.root, "-o", path, "--experts", "none", "--quant", q, "-q",
                                          "--force"])
    _, text = run_stage("parity", [sys.executable, "-c", PARITY, str(files["f32"]), str(files["q4_1"]), str(base),
                                   str(ROOT / "docs" / "assembly.md")], capture=True)
    b.emit(metric="parity", against=base.name, **json.loads(text.strip().splitlines()[-1]))
    for path in files.values():
        path.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "real-base")
    ap.add_argument("--experts", type=int, default=100)
    ap.add_argument("--expert-tokens", type=int, default=4096, help="training tokens of the one real expert")
    ap.add_argument("--perturb", type=float, default=0.01, help="the other experts: seed + this x std noise")
    ap.add_argument("--fresh", action="store_true", help="delete OUT first instead of resuming")
    ap.add_argument("--repeats", type=int, default=3, help="assemblies and extends (each followed by its plain I/O): medians")
    ap.add_argument("--only", default="parity,assemble,inference,extend", help="which measurements (comma-separated)")
    ap.add_argument("--base", default="smollm2", help=f"smollm2, a GGUF or Hugging Face directory, or one of {tuple(FAMILIES)}"
                                                       " (a published shape with random weights, built by bench_bases.py)")
    a = ap.parse_args()

    out: Path = a.out
    if a.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(out)
    base = build_hf(a.base, ROOT / "bench-out" / "bases") if a.base in FAMILIES else resolve_base(a.base)
    base_file = base.is_file()  # a GGUF: its bytes and logits to compare with
    b.emit(bench="real_base", event="start", rss_note="each stage's own process (os.wait4)", experts=a.experts, base=base.name, **cpu_flags(),
           note="one expert trains; the others are the seed perturbed: this measures the system, not quality")
    run = RunDir(out / "run")
    if not run.module_meta(0).is_file():
        r, _ = run_stage("import-base", ["import-base", base, "--out", run.root, "--force"])
        b.emit(stage="import-base", wall_s=r.wall_s, peak_rss_mb=r.peak_rss_mb,
               base_bytes=sum(p.stat().st_size for p in ([base] if base_file else base.iterdir())))
    if not run.run_json.is_file():
        r, _ = run_stage("prepare", ["prepare", "builtin", "--out", run.root, "--experts", a.experts, "--partition",
                                     "random", "--max-chars-per-domain", 1_500_000, "--no-progress"])
        b.emit(stage="prepare", wall_s=r.wall_s, peak_rss_mb=r.peak_rss_mb)
    only = set(a.only.split(","))
    if "parity" in only and base_file:
        parity(b, run, base, out)
    if not run.module_meta(1).is_file():
        r, _ = run_stage("train-expert 1", ["train-expert", run.root, "--expert", 1, "--tokens", a.expert_tokens,
                                            "--eval-tokens", 1024, "--no-progress"])
        b.emit(stage="train-expert", expert=1, tokens=a.expert_tokens, wall_s=r.wall_s, peak_rss_mb=r.peak_rss_mb)
    # in a child: the trunk it reads would raise this process's RSS, which Linux folds into every later child's peak
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); from pathlib import Path; from mfgguf.run import"
            f" RunDir; from bench_real_base import perturbed_experts; perturbed_experts(RunDir(Path({str(run.root)!r})),"
            f" {a.experts}, {a.perturb})")
    r, _ = run_stage("perturbed experts", [sys.executable, "-c", code])
    b.emit(stage="perturbed experts", experts=a.experts - 1, wall_s=r.wall_s, peak_rss_mb=r.peak_rss_mb)
    if not run.router_stats_meta.is_file():
        r, _ = run_stage("router-stats", ["router-stats", run.root, "--tokens", 8192, "--no-progress"])
        b.emit(stage="router-stats", wall_s=r.wall_s, peak_rss_mb=r.peak_rss_mb)

    from mfgguf.gguf.inspect import inspect_gguf

    in_bytes = sum(p.stat().st_size for p in module_inputs(run, a.experts))
    for quant in ("q8_0", "q4_k"):
        gguf = out / f"moe-{quant}.gguf"
        if "assemble" not in only and gguf.is_file():
            continue
        code = assemble_code(run.root, gguf, quant, list(range(1, a.experts + 1)), None)
        walls, ios, runs = [], [], []
        for _ in range(a.repeats if "assemble" in only else 1):  # alternated: the same page cache and neighbours
            wall, _, stdout, _, _ = run_child(code)
            walls.append(wall)
            runs.append(json.loads(stdout.strip().splitlines()[-1]))
            ios.append(b.plain_io(module_inputs(run, a.experts), gguf.stat().st_size))
        r = runs[sorted(range(len(walls)), key=walls.__getitem__)[len(walls) // 2]]  # the median run's profile
        wall, ref = float(np.median(walls)), float(np.median(ios))
        info = inspect_gguf(gguf)
        b.emit(metric="assemble", quant=quant, experts=a.experts, wall_s=round(wall, 2),
               peak_rss_mb=round(max(x["vm_hwm_kb"] for x in runs) / 1024, 1), plain_io_s=round(ref, 2),
               ratio_to_plain_io=round(wall / ref, 2), repeats=len(walls), wall_s_all=[round(x, 2) for x in walls],
               plain_io_s_all=[round(x, 2) for x in ios], input_bytes=in_bytes,
               gguf_bytes=gguf.stat().st_size, gguf_gib=round(gguf.stat().st_size / 2**30, 3),
               params_total=info["params_total"], params_active=info["params_active"],
               phases_s=r["phases_s"], work_s=r["work_s"])
    trunk = out / "trunk-q8_0.gguf"
    if not trunk.is_file():
        run_stage("assemble trunk", ["assemble", run.root, "-o", trunk, "--experts", "none", "--quant", "q8_0", "-q"])

    res = {}
    for name, path in (("moe_q8_0", out / "moe-q8_0.gguf"), ("moe_q4_k", out / "moe-q4_k.gguf"),
                       *((("base_file", base),) if base_file else ()), ("base_trunk_q8_0", trunk)) if "inference" in only else ():
        r, text = run_stage(f"infer {name}", [sys.executable, "-c", INFER, str(path), "256", "128",
                                               str(ROOT / "README.md")], capture=True)
        res[name] = json.loads(text.strip().splitlines()[-1])
        b.emit(metric="inference", model=name, file_bytes=path.stat().st_size, peak_rss_mb=r.peak_rss_mb,
               goal_rss_mb="<= 8192", **res[name])
    for name in ("moe_q8_0", "moe_q4_k") if "inference" in only else ():
        b.emit(metric="decode_vs_base", model=name, vs="base_trunk_q8_0",
               decode_ratio=round(res[name]["decode_tps"] / res["base_trunk_q8_0"]["decode_tps"], 3),
               prompt_ratio=round(res[name]["prompt_tps"] / res["base_trunk_q8_0"]["prompt_tps"], 3))

    more = RunDir(out / "more")  # later: the same base, another corpus, one more expert
    if not more.module_meta(1).is_file():
        run_stage("import-base (more)", ["import-base", base, "--out", more.root, "--force"])
        run_stage("prepare (more)", ["prepare", f"tests={ROOT / 'tests'}", "--out", more.root, "--experts", 1,
                                     "--no-progress"])
        run_stage("train-expert (more)", ["train-expert", more.root, "--expert", 1, "--tokens", a.expert_tokens,
                                          "--eval-tokens", 1024, "--no-progress"])
    if not more.router_stats_meta.is_file():  # its pooled G, as the first RUN's: what `extend` adds as a new source
        run_stage("router-stats (more)", ["router-stats", more.root, "--tokens", 8192, "--no-progress"])
    src, dst = out / "moe-q8_0.gguf", out / f"moe{a.experts + 1}-q8_0.gguf"
    if "extend" in only:
        code = (f"import json; from pathlib import Path; from mfgguf.converters.extend import extend; "
                f"r = extend(Path({str(src)!r}), Path({str(dst)!r}), add=Path({str(more.root)!r}), force=True); "
                f"r['vm_hwm_kb'] = int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]); "
                f"print(json.dumps(r))")
        walls, ios, hwm = [], [], []
        for _ in range(a.repeats):
            wall, _, stdout, _, _ = run_child(code)
            walls.append(wall)
            hwm.append(json.loads(stdout.strip().splitlines()[-1])["vm_hwm_kb"] / 1024)
            # what extend reads: the file, the added expert, its RUN's pooled statistics
            ios.append(b.plain_io([src, more.module_file(1), more.router_stats], dst.stat().st_size))
        wall, ref = float(np.median(walls)), float(np.median(ios))
        b.emit(metric="extend", added=1, experts_after=a.experts + 1, wall_s=round(wall, 2), peak_rss_mb=round(max(hwm), 1),
               plain_io_s=round(ref, 2), ratio_to_plain_io=round(wall / ref, 2), repeats=len(walls),
               wall_s_all=[round(x, 2) for x in walls], plain_io_s_all=[round(x, 2) for x in ios],
               gguf_bytes=dst.stat().st_size, added_bytes=dst.stat().st_size - src.stat().st_size)
    if "inference" in only:
        r, text = run_stage("infer extended", [sys.executable, "-c", INFER, str(dst), "256", "64",
                                               str(ROOT / "README.md")], capture=True)
        b.emit(metric="inference", model=f"moe{a.experts + 1}_q8_0", peak_rss_mb=r.peak_rss_mb,
               **json.loads(text.strip().splitlines()[-1]))

if __name__ == "__main__":
    main()
