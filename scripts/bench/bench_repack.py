"""What the AMX protection costs, and whose bug the crash is: llama.cpp's weight repacking on and off.

For a `1b`-shaped MoE (random weights, the real module format, `scripts/synthetic_run.py`) it
writes three files:
  - `mfgguf-q8_0`  : `mfgguf assemble --quant q8_0` (our streaming writer and ggml's quantizer);
  - `mfgguf-f16`   : the same model as f16 (llama.cpp never repacks f16);
  - `llama-q8_0`   : the f16 file re-quantized by llama.cpp's own `llama_model_quantize`, which
                     writes a whole new GGUF with llama.cpp's own writer (its tensor order,
                     alignment and header): if this one crashes too, the crash is not in our files;
plus `mfgguf-q4_0` and `mfgguf-q4_k`. Each file is loaded in its own child process with
MFGGUF_REPACK=off and =on, a 256-token prompt is evaluated and 64 tokens are decoded greedily.
One JSON line per (file, repack): prompt and decode tokens/s, or the exit code when it crashed,
and the buffer types llama.cpp reported. The first line names the CPU and llama.cpp's build.

    python scripts/bench/bench_repack.py                 # 1b shape, 8 experts (about 5 minutes)
    python scripts/bench/bench_repack.py --preset small --experts 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

INFER = r"""
import json, sys, time
from mfgguf.runtime.llm import loaded, read_header
path, n_prompt, n_gen, text = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
n_prompt = min(n_prompt, read_header(path)["context_length"] - n_gen)  # the small preset's context is 256
with loaded(path, n_ctx=n_prompt + n_gen, verbose=True) as llm:
    prompt = (llm.tokenize(open(text).read().encode(), add_bos=False) * 50)[:n_prompt]
    t0 = time.perf_counter(); llm.eval(prompt); t_prompt = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n_gen):  # greedy decode, one token at a time: the chat/generate hot path
        llm.eval([int(llm.sample(temp=0.0))])
    t_gen = time.perf_counter() - t0
print("RESULT " + json.dumps({"prompt_tps": n_prompt / t_prompt, "decode_tps": n_gen / t_gen, "n_prompt": n_prompt,
                              "n_gen": n_gen}), flush=True)
"""


def emit(out: Path, **rec) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    with open(out / "bench_repack.jsonl", "a") as f:
        f.write(line + "\n")


def llama_quantize(src: Path, dst: Path, ftype: int) -> None:
    """llama.cpp's own quantizer and GGUF writer (what llama-quantize runs)."""
    import llama_cpp

    from mfgguf.runtime.llm import _quiet_llama_logs

    _quiet_llama_logs(False)  # llama.cpp logs every tensor it quantizes otherwise
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed with {rc}")


def run_one(path: Path, repack: str, n_prompt: int, n_gen: int, text: Path) -> dict:
    env = {**os.environ, "MFGGUF_REPACK": repack}
    p = subprocess.run([sys.executable, "-c", INFER, str(path), str(n_prompt), str(n_gen), str(text)],
                       capture_output=True, text=True, env=env, timeout=900)
    log = p.stdout + p.stderr
    bufs = sorted(set(re.findall(r"load_tensors:\s+(\S+) model buffer size", log)))
    # a negative exit code is the signal that killed it (-11: segmentation fault)
    rec = {"exit_code": p.returncode, "crashed": p.returncode < 0, "model_buffers": bufs}
    m = re.search(r"^RESULT (.*)$", log, re.M)
    if m:
        rec.update(json.loads(m.group(1)))
    elif p.returncode != 0:
        rec["log_tail"] = log.strip().splitlines()[-3:]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "repack")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_repack.jsonl").unlink(missing_ok=True)

    import llama_cpp

    from mfgguf.converters.assemble import assemble
    from mfgguf.runtime import repack
    from synthetic_run import build, corpus_text

    flags = repack.cpu_flags()
    from mfgguf import machine

    model = machine.cpu()["model"]
    d = repack.decide(cpu_flags=flags, build_info=repack.build_info(), env=None)
    emit(a.out, what="machine", cpu=model, amx=all(f in flags for f in repack.AMX_FLAGS),
         llama_cpp_build=repack.build_info().strip(), auto_repack=d.repack, reason=d.reason)

    run = a.out / f"run-{a.preset}-{a.experts}"
    if not (run / "manifest.json").is_file():
        build(run, preset=a.preset, n_experts=a.experts)
    files = {}
    for q in ("f16", "q8_0", "q4_0", "q4_k"):
        files[f"mfgguf-{q}"] = a.out / f"mfgguf-{q}.gguf"
        if not files[f"mfgguf-{q}"].is_file():
            assemble(run, files[f"mfgguf-{q}"], quant=q, progress=False)
    files["llama-q8_0"] = a.out / "llama-q8_0.gguf"
    if not files["llama-q8_0"].is_file():
        llama_quantize(files["mfgguf-f16"], files["llama-q8_0"], llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0)
    text = a.out / "prompt.txt"
    text.write_text("".join(corpus_text(200_000)))

    for name in ("mfgguf-q8_0", "llama-q8_0", "mfgguf-q4_0", "mfgguf-q4_k", "mfgguf-f16"):
        res = {}
        for rp in ("off", "on"):
            res[rp] = run_one(files[name], rp, a.prompt, a.gen, text)
            emit(a.out, what="inference", file=name, preset=a.preset, experts=a.experts, repack=rp,
                 bytes=files[name].stat().st_size, **res[rp])
        if all("decode_tps" in r for r in res.values()):
            emit(a.out, what="ratio", file=name, decode_off_over_on=res["off"]["decode_tps"] / res["on"]["decode_tps"],
                 prompt_off_over_on=res["off"]["prompt_tps"] / res["on"]["prompt_tps"])


if __name__ == "__main__":
    main()
