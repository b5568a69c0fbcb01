"""Benchmark `mfgguf export-hf`: wall time and peak RSS of the export against the largest tensor it writes.

Prints JSON lines:
  {"bench": "setup", "preset": ..., "n_experts": N, "quant": ..., "gguf_mb": ..., "assemble_s": ...}
  {"bench": "baseline", "peak_rss_mb": ...}   a child that imports the exporter and reads the file's header
  {"bench": "export_hf", "dtype": ..., "wall_s": ..., "peak_rss_mb": ..., "output_mb": ..., "mb_per_s": ...,
   "largest_tensor": NAME, "largest_tensor_mb": ..., "bound_mb": 2 x largest + 200, "within_bound": ...,
   "hf_class": ..., "model": CPU}
    one line per --dtype; the largest tensor's size is as written (in that dtype) and as f32

The input is an assembled GGUF: by default a synthetic RUN (scripts/synthetic_run.py) of the `1b` preset's
shapes with 8 random experts, assembled q8_0 (the default quant) in the shared-expert layout; or any file
given with --gguf. Each export runs in its own child process (peak RSS: that child's VmHWM, which
includes the interpreter and its imports: the baseline line says how much).

    python scripts/bench/bench_export_hf.py                        # 1b shapes, 8 experts, q8_0 -> f32 and bf16
    python scripts/bench/bench_export_hf.py --quick                # the small preset's shapes
    python scripts/bench/bench_export_hf.py --gguf model.gguf --dtype f32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CHILD = """
import sys, time
from pathlib import Path
t0 = time.perf_counter()
if sys.argv[2] == "-":
    from mfgguf.converters.hf.export import target_for
    from mfgguf.converters.hf.source import GGUFSource
    with GGUFSource(Path(sys.argv[1])) as src:
        target_for(src)
    r = {}
else:
    from mfgguf.converters.hf.export import export_hf
    r = export_hf(Path(sys.argv[1]), Path(sys.argv[2]), dtype=sys.argv[3])
wall = time.perf_counter() - t0
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))  # kB, this image only
print(__import__("json").dumps({"wall_s": wall, "vmhwm_kb": hwm, **r}))
"""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def child(*args: str) -> tuple[dict, float]:
    """Run the exporter (or the header-only baseline) in a child; (its JSON line, its peak RSS in MB).

    The peak is the child's VmHWM: its own image's high-water mark (ru_maxrss would carry this parent's
    size over the fork)."""
    p = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"child failed ({p.returncode}): {p.stdout}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return r, r["vmhwm_kb"] / 1024


def largest(gguf: Path) -> tuple[str, int]:
    """The largest tensor the export writes and its element count."""
    import math

    from mfgguf.converters.hf.export import target_for
    from mfgguf.converters.hf.source import GGUFSource

    with GGUFSource(gguf) as src:
        t = max(target_for(src).tensors(), key=lambda x: math.prod(x.shape))
        return t.name, math.prod(t.shape)


def build(work: Path, preset: str, n_experts: int, quant: str) -> Path:
    from mfgguf.converters.assemble import assemble
    sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]
    from synthetic_run import build as synthetic

    run = synthetic(work / "run", preset=preset, n_experts=n_experts, max_chars=600_000)
    out = work / "model.gguf"
    t0 = time.perf_counter()
    assemble(run, out, quant=quant, progress=False)
    print(json.dumps({"bench": "setup", "preset": preset, "n_experts": n_experts, "quant": quant,
                      "gguf_mb": round(out.stat().st_size / 1e6, 1), "assemble_s": round(time.perf_counter() - t0, 2)}),
          flush=True)
    shutil.rmtree(run)  # only the GGUF is read from here on
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="an assembled MoE GGUF (default: build a synthetic one)")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--dtype", default="f32,bf16", help="comma-separated --dtype values to export")
    ap.add_argument("--quick", action="store_true", help="the small preset's shapes")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_export_hf.", dir=a.dir))
    try:
        gguf = a.gguf or build(work, "small" if a.quick else a.preset, a.experts, a.quant)
        name, n = largest(gguf)
        _, base_rss = child(str(gguf), "-")
        print(json.dumps({"bench": "baseline", "peak_rss_mb": round(base_rss, 1)}), flush=True)
        for dtype in a.dtype.split(","):
            out = work / f"hf-{dtype}"
            r, rss = child(str(gguf), str(out), dtype)
            size = {"f32": 4, "f16": 2, "bf16": 2}[dtype] * n / 1e6
            print(json.dumps({"bench": "export_hf", "dtype": dtype, "wall_s": round(r["wall_s"], 2),
                              "peak_rss_mb": round(rss, 1), "output_mb": round(r["bytes"] / 1e6, 1),
                              "mb_per_s": round(r["bytes"] / 1e6 / r["wall_s"], 1), "largest_tensor": name,
                              "largest_tensor_mb": round(size, 1), "largest_tensor_f32_mb": round(4 * n / 1e6, 1),
                              "bound_mb": round(2 * size + 200, 1), "within_bound": rss <= 2 * size + 200,
                              "hf_class": r["hf_class"], "model": cpu_model()}), flush=True)
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
