"""Benchmark streaming assembly: peak RSS flat in N, wall time vs plain file I/O, quantizer throughput.

Prints JSON lines:
  {"bench": "quantize", "type": ..., "mb_per_s": ...}            f32 input MB/s of the quantizer path
  {"bench": "assemble", "n_experts": N, "peak_rss_mb": ..., "wall_s": ..., "io_ref_s": ..., "ratio": ...,
   "cpu_s": ..., "machine_busy": ..., "phases_s": {...}, "work_s": {...}, "model": CPU, "avx2": ...}
      medians of --repeats runs, each assembly followed by its I/O reference; child CPU seconds; busy
      fraction of all cores; the median run's seconds per phase and per kind of stream work
      (reading, hashing, checking, quantizing, writing; summed over threads: converters/profile.py)
  {"bench": "summary", "rss_ratio_max_over_min_n": ..., ...}
  with --reference, for the largest N, on the same weights (scripts/hf_reference.py):
  {"bench": "reference", "path": "mfgguf q8_0" | "convert_hf_to_gguf q8_0" | "mfgguf q4_k" |
   "convert_hf_to_gguf f16 + llama_model_quantize q4_k_s", "wall_s": ..., "peak_rss_mb": ..., "over_io_ref": ...}
  {"bench": "reference_summary", "q8_0_identical_tensors": ..., "convert_over_mfgguf_q8_0": ..., ...}

Modules are synthetic (scripts/synthetic_run.py) with the `1b` preset's shapes: a ~1.3 GB trunk,
~38 MB of f32 weights per expert and one 50 MB file of pooled router statistics. Each assembly runs in its own
subprocess (peak RSS: that process's VmHWM). The I/O reference reads the same
input files and writes the same number of output bytes with fsync, in the same directory, right
after each assembly (same page-cache state).

    python scripts/bench/bench_assemble.py                 # N = 8, 32, 100 (needs ~10 GB of disk)
    python scripts/bench/bench_assemble.py --quick         # N = 8, 32, smaller quantizer matrices
    python scripts/bench/bench_assemble.py --experts 8,32 --dir /var/tmp/bench
    python scripts/bench/bench_assemble.py --shared attn   # experts hold copies of norms+attention: the merge phase too
    python scripts/bench/bench_assemble.py --reference     # + llama.cpp's convert_hf_to_gguf.py and quantizer (`bench` extra)

With `--shared CHOICE` every expert also holds a perturbed copy of those trunk tensors (~121 MB
per expert for `attn` at `1b`), which assembly merges (`--merge`, default mean) into the trunk
it writes; peak RSS must stay flat in N all the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _cpu_ticks() -> tuple[int, int]:
    """(busy, idle) jiffies of the whole machine, from /proc/stat (zeros where unavailable)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = v[3] + v[4]  # idle + iowait
    return sum(v[:8]) - idle, idle


def run_child(code: str) -> tuple[float, float, str, float, float]:
    """Run python code in a subprocess; (wall s, rusage peak RSS MB, stdout, child CPU s, machine busy fraction).

    Linux carries the parent's RSS high-water mark across fork+exec into ru_maxrss, so the
    assembly child reports its own peak from /proc/self/status (VmHWM) in its stdout instead.
    The machine's busy fraction over the run (all processes, ours included) shows how much other
    load there was: wall times on a shared machine are only comparable at similar load.
    """
    b0, i0 = _cpu_ticks()
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    b1, i1 = _cpu_ticks()
    out = p.stdout.read().decode()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"child failed ({p.returncode}): {code[:200]}")
    busy = (b1 - b0) / max(1, (b1 - b0) + (i1 - i0))
    return wall, ru.ru_maxrss / 1024, out, ru.ru_utime + ru.ru_stime, busy


def bench_quantizer(n: int, threads: int | None) -> None:
    from mfgguf.converters import quant as Q

    x = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32) * 0.02
    for t in ("f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"):
        Q.quantize(x[:64], t, threads=threads)  # warm
        t0 = time.perf_counter()
        Q.quantize(x, t, threads=threads)
        dt = time.perf_counter() - t0
        print(json.dumps({"bench": "quantize", "type": t, "shape": [n, n], "backend": Q.backend(),
                          "threads": threads or Q.default_threads(), "mb_per_s": round(x.nbytes / dt / 1e6, 1)}), flush=True)


def module_inputs(rd, n: int) -> list[Path]:
    """Every file assembling N experts reads: trunk, experts 1..N, the pooled router statistics."""
    return [rd.module_file(i) for i in range(0, n + 1)] + ([rd.router_stats] if rd.router_stats.is_file() else [])


def io_reference(inputs: list[Path], out_bytes: int, dest: Path) -> str:
    return f"""
import os
buf = bytearray(8 << 20)
mv = memoryview(buf)
for p in {[str(p) for p in inputs]!r}:
    with open(p, "rb", buffering=0) as f:
        while f.readinto(mv):
            pass
fd = os.open({str(dest)!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
left = {out_bytes}
while left:
    left -= os.write(fd, mv[: min(left, len(buf))])
os.fsync(fd)
os.close(fd)
"""


def main() -> None:
    from bench_train import cpu_flags  # scripts/ is on sys.path when run as a script

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", default=None, help="comma-separated N values (default 8,32,100; --quick 8,32)")
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--quick", action="store_true", help="N = 8,32 and 2048x2048 quantizer matrices")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mfgguf-bench"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="assemblies (each followed by the I/O reference) per N: medians")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic RUN for the next time")
    ap.add_argument("--shared", default="none", help="experts hold perturbed copies of these trunk tensors: none|norms|attn|all")
    ap.add_argument("--merge", default="mean", help="how assembly merges them: none|mean|ties")
    ap.add_argument("--reference", action="store_true", help="for the largest N also run llama.cpp's own path to the"
                    " same files: convert_hf_to_gguf.py (q8_0; f16 + llama_model_quantize for q4_k)")
    ap.add_argument("--fast-quant", action="store_true", help="assemble --fast-quant (q8_0 with ggml's vectorised quantizer)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "mfgguf", help="where the converter is unpacked")
    a = ap.parse_args()
    ns = [int(x) for x in (a.experts or ("8,32" if a.quick else "8,32,100")).split(",")]

    bench_quantizer(2048 if a.quick else 4096, a.threads)

    from synthetic_run import build  # scripts/ is on sys.path when run as a script

    run = a.dir / (f"run-{a.preset}" + ("" if a.shared == "none" else f"-shared-{a.shared}"))
    info = run / "run.json"
    if not info.is_file() or json.loads(info.read_text())["n_experts"] < max(ns):
        shutil.rmtree(run, ignore_errors=True)
        t0 = time.perf_counter()
        build(run, preset=a.preset, n_experts=max(ns), max_chars=3_000_000, shared=a.shared)
        print(json.dumps({"bench": "build_synthetic_run", "n_experts": max(ns), "shared": a.shared,
                          "s": round(time.perf_counter() - t0, 1)}), flush=True)
    from mfgguf.run import RunDir

    rd = RunDir(run)
    os.sync()  # the synthetic run's dirty pages written now, not during the first measurement
    rss = {}
    for n in ns:
        out = a.dir / f"model-{n}.gguf"
        code = assemble_code(run, out, a.quant, list(range(1, n + 1)), a.threads, merge=a.merge, fast_quant=a.fast_quant)
        inputs = module_inputs(rd, n)
        runs, refs = [], []
        for _ in range(a.repeats):  # alternated, so both see the same page cache and the same neighbours
            wall, _, stdout, cpu, busy = run_child(code)
            runs.append((wall, json.loads(stdout.strip().splitlines()[-1]), cpu, busy))
            refs.append(run_child(io_reference(inputs, runs[-1][1]["bytes"], a.dir / "io-ref.bin")))
            (a.dir / "io-ref.bin").unlink(missing_ok=True)
            out.unlink(missing_ok=True)
        walls, ios = [x[0] for x in runs], [x[0] for x in refs]
        wall, r, cpu, busy = sorted(runs, key=lambda x: x[0])[len(runs) // 2]  # the median run, with its profile
        io_s, _, _, io_cpu, io_busy = sorted(refs, key=lambda x: x[0])[len(refs) // 2]
        peak = max(x[1]["vm_hwm_kb"] for x in runs) / 1024
        rss[n] = peak
        print(json.dumps({"bench": "assemble", "preset": a.preset, "n_experts": n, "quant": a.quant, "shared": a.shared,
                          "quantizer": r["quantizer"],
                          "chunk_threads": os.environ.get("MFGGUF_CHUNK_THREADS", "1") != "0",
                          "merge": r["merge"], "merged_tensors": r["merged_tensors"],
                          "input_mb": round(r["input_bytes"] / 1e6), "output_mb": round(r["bytes"] / 1e6),
                          "peak_rss_mb": round(peak, 1), "wall_s": round(wall, 2), "assemble_s": r["seconds"],
                          "io_ref_s": round(io_s, 2), "ratio": round(wall / io_s, 2), "threads": r["threads"],
                          "repeats": a.repeats, "wall_s_all": [round(x, 2) for x in walls],
                          "io_ref_s_all": [round(x, 2) for x in ios],
                          "cpu_s": round(cpu, 2), "io_ref_cpu_s": round(io_cpu, 2),
                          "machine_busy": round(busy, 2), "io_ref_machine_busy": round(io_busy, 2),
                          "phases_s": r["phases_s"], "work_s": r["work_s"], **cpu_flags()}), flush=True)
    lo, hi = min(ns), max(ns)
    print(json.dumps({"bench": "summary", "shared": a.shared, "merge": a.merge,
                      "rss_ratio": round(rss[hi] / rss[lo], 3), "n_lo": lo, "n_hi": hi,
                      "max_rss_mb": round(max(rss.values()), 1)}), flush=True)
    if a.reference:
        reference(rd, hi, a)
    if not a.keep:
        shutil.rmtree(run, ignore_errors=True)


def reference(rd, n: int, a) -> None:
    """mfgguf against llama.cpp's own path to the same file types from the same weights, N experts."""
    import gguf

    from hf_reference import convert_code, converter_dir, quantize_code, write_hf_checkpoint

    conv = converter_dir(a.cache)
    d = a.dir / f"reference-{n}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    experts = list(range(1, n + 1))
    t0 = time.perf_counter()
    run_child(assemble_code(rd.root, d / "f32.gguf", "f32", experts, a.threads))  # the weights, once, for the checkpoint
    hf = write_hf_checkpoint(d / "f32.gguf", rd.tokenizer, d / "hf")
    (d / "f32.gguf").unlink()
    print(json.dumps({"bench": "reference_setup", "n_experts": n, "hf_checkpoint_mb": round(_du(hf) / 1e6),
                      "s": round(time.perf_counter() - t0, 1)}), flush=True)
    inputs = sorted(hf.glob("*.safetensors"))
    threads = a.threads or os.cpu_count()
    rows = {}

    def row(path: str, code: str, out: Path, io_inputs: list[Path]) -> dict:
        wall, _, stdout, cpu, busy = run_child(code)
        last = stdout.strip().splitlines()[-1]  # mfgguf: its JSON result; the others: VmHWM in KB
        peak = (json.loads(last)["vm_hwm_kb"] if path.startswith("mfgguf") else int(last)) / 1024
        io_s, *_ = run_child(io_reference(io_inputs, out.stat().st_size, d / "io-ref.bin"))
        (d / "io-ref.bin").unlink(missing_ok=True)
        r = {"bench": "reference", "n_experts": n, "path": path, "wall_s": round(wall, 2), "peak_rss_mb": round(peak, 1),
             "output_mb": round(out.stat().st_size / 1e6), "io_ref_s": round(io_s, 2), "over_io_ref": round(wall / io_s, 2),
             "cpu_s": round(cpu, 2), "machine_busy": round(busy, 2)}
        print(json.dumps(r), flush=True)
        rows[path] = r
        return r

    mod_inputs = module_inputs(rd, n)
    row("mfgguf q8_0", assemble_code(rd.root, d / "mfgguf-q8_0.gguf", "q8_0", experts, a.threads),
        d / "mfgguf-q8_0.gguf", mod_inputs)
    row("convert_hf_to_gguf q8_0", convert_code(conv, hf, d / "convert-q8_0.gguf", "q8_0"), d / "convert-q8_0.gguf", inputs)
    x = {t.name: t for t in gguf.GGUFReader(d / "mfgguf-q8_0.gguf").tensors}
    y = {t.name: t for t in gguf.GGUFReader(d / "convert-q8_0.gguf").tensors}
    identical = x.keys() == y.keys() and all(x[k].tensor_type == y[k].tensor_type
                                             and np.array_equal(x[k].data, y[k].data) for k in x)
    del x, y
    for f in ("mfgguf-q8_0.gguf", "convert-q8_0.gguf"):
        (d / f).unlink()
    row("mfgguf q4_k", assemble_code(rd.root, d / "mfgguf-q4_k.gguf", "q4_k", experts, a.threads),
        d / "mfgguf-q4_k.gguf", mod_inputs)
    (d / "mfgguf-q4_k.gguf").unlink()
    f16 = row("convert_hf_to_gguf f16", convert_code(conv, hf, d / "convert-f16.gguf", "f16"), d / "convert-f16.gguf", inputs)
    q = row("llama_model_quantize f16 -> q4_k_s", quantize_code(d / "convert-f16.gguf", d / "llama-q4_k.gguf", 14, threads),
            d / "llama-q4_k.gguf", [d / "convert-f16.gguf"])
    shutil.rmtree(d, ignore_errors=True)
    m8, c8, m4 = rows["mfgguf q8_0"], rows["convert_hf_to_gguf q8_0"], rows["mfgguf q4_k"]
    print(json.dumps({"bench": "reference_summary", "n_experts": n, "q8_0_identical_tensors": identical,
                      "convert_over_mfgguf_q8_0": round(c8["wall_s"] / m8["wall_s"], 2),
                      "llama_q4_k_path_s": round(f16["wall_s"] + q["wall_s"], 2),
                      "llama_q4_k_path_over_mfgguf_q4_k": round((f16["wall_s"] + q["wall_s"]) / m4["wall_s"], 2),
                      "quantize_only_over_mfgguf_q4_k": round(q["wall_s"] / m4["wall_s"], 2)}), flush=True)


def assemble_code(run: Path, out: Path, quant: str, experts: list[int], threads, merge: str = "mean",
                   fast_quant: bool = False) -> str:
    """Python source that assembles in a child process and prints its result with its own peak RSS (VmHWM)."""
    return (f"import sys, json; from pathlib import Path; from mfgguf.converters.assemble import assemble; "
            f"r = assemble(Path({str(run)!r}), Path({str(out)!r}), quant={quant!r}, experts={experts!r}, "
            f"merge={merge!r}, force=True, progress=False, threads={threads!r}, fast_quant={fast_quant!r}); "
            f"assert 'torch' not in sys.modules; "
            f"r['vm_hwm_kb'] = int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]); "
            f"print(json.dumps(r))")


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


if __name__ == "__main__":
    main()
