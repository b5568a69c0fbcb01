"""What the README's real-model walk-through keeps of the base: its MoE against the base on HellaSwag, task by task.

The README's block ("Start from a real model"), run as written into OUT/smol (each step skipped where its output
exists): SmolLM2 imported, `prepare study`, the base alone at q8_0, two experts of 32,768 tokens (C++ headers,
manual pages), the MoE of both at q8_0. Then both files are scored with `mfgguf perplexity --hellaswag DATA
--hellaswag-tasks N --out` (the same tasks: llama-perplexity's draw), and the MoE is paired with the base over
them (`--paired-with`). Each scored file's record stays in OUT (resumed runs reuse it); one JSON line per file,
then the paired difference, appended to OUT/walkthrough_general.jsonl.

    python scripts/studies/walkthrough_general.py --out walkthrough --hellaswag hellaswag_val_full.txt --tasks 2000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

README = [  # the README's block, RUN = OUT/smol/run
    (("modules", "trunk.json"), ["import-base", "smollm2", "--out", "{run}"]),
    (("run.json",), ["prepare", "study", "--out", "{run}", "--experts", "5", "--max-chars-per-domain", "1000000",
                     "--test-frac", "0.02", "--no-progress"]),
    (("..", "base.gguf"), ["assemble", "{run}", "-o", "{smol}/base.gguf", "--experts", "none", "--quant", "q8_0"]),
    (("modules", "expert_002.json"), ["train-expert", "{run}", "--expert", "2", "--tokens", "32768", "--eval-tokens",
                                      "4096", "--no-progress"]),
    (("modules", "expert_004.json"), ["train-expert", "{run}", "--expert", "4", "--tokens", "32768", "--eval-tokens",
                                      "4096", "--no-progress"]),
    (("..", "moe.gguf"), ["assemble", "{run}", "-o", "{smol}/moe.gguf", "--experts", "2,4", "--quant", "q8_0"]),
]


def mfgguf(*args) -> str:
    r = subprocess.run([sys.executable, "-m", "mfgguf", *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        sys.exit(f"walkthrough_general: `mfgguf {args[0]}` failed: {(r.stderr or r.stdout).strip()[-400:]}")
    return r.stdout


def emit(out: Path, **rec) -> None:
    print(json.dumps(rec), flush=True)
    with open(out / "walkthrough_general.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def main(argv=None) -> None:
    from bench_train import cpu_flags

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("walkthrough"))
    ap.add_argument("--hellaswag", type=Path, required=True, help="HellaSwag in llama-perplexity's layout")
    ap.add_argument("--tasks", type=int, default=2000)
    a = ap.parse_args(argv)
    smol = a.out.resolve() / "smol"
    run = smol / "run"
    smol.mkdir(parents=True, exist_ok=True)
    for path, args in README:
        if not (run.joinpath(*path)).exists():
            t0 = time.perf_counter()
            mfgguf(*[x.format(run=run, smol=smol) for x in args])
            emit(a.out, step=args[0], seconds=round(time.perf_counter() - t0, 1))
    cpu = cpu_flags()
    records = {}
    for name in ("base", "moe"):
        rec = a.out / f"{name}.hellaswag.json"
        extra = ["--paired-with", a.out / "base.hellaswag.json"] if name == "moe" else []
        if not rec.is_file():
            mfgguf("perplexity", smol / f"{name}.gguf", "--hellaswag", a.hellaswag, "--hellaswag-tasks", a.tasks,
                   "--out", rec, *extra)
        records[name] = json.loads(rec.read_text())["benchmarks"]["hellaswag"]
        r = records[name]
        emit(a.out, model=f"{name}.gguf", tasks=r["tasks"], accuracy=r["accuracy"], ci95=r["ci95"],
             seconds=r["seconds"], engine=r["engine"], cpu=cpu)
    from mfgguf.runtime.choice.paired import paired

    emit(a.out, paired="moe - base", **paired(records["moe"], records["base"]))


if __name__ == "__main__":
    main()
