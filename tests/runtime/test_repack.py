"""Weight repacking policy: off on AMX CPUs (llama.cpp's AMX matmul crashes), llama.cpp's default elsewhere.

The decision is tested as a pure function with the flags of both kinds of CI machine, so it holds
on either; the end-to-end tests load real quantized models in child processes (a crash there
is a failed test, not a dead test session) and read llama.cpp's own load log to see which
buffer types it really used.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mfgguf.errors import MfggufError
from mfgguf.runtime import repack

# /proc/cpuinfo flags of the two machine kinds this project runs on (abridged to what matters)
INTEL_AMX = set("fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8".split())
AMD_EPYC = set("fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16".split())
BUILD_AMX = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | REPACK = 1 |"
BUILD_PLAIN = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | LLAMAFILE = 1 | REPACK = 1 |"


@pytest.mark.parametrize("flags, build, want", [
    (INTEL_AMX, BUILD_AMX, False),  # the crash: no repacking
    (INTEL_AMX, BUILD_PLAIN, True),  # no AMX kernels compiled in: the CPU repack path is safe
    (AMD_EPYC, BUILD_PLAIN, True),
    (AMD_EPYC, BUILD_AMX, True),  # an AMX build on a CPU without AMX never picks the AMX buffer
    (set(), BUILD_PLAIN, True),  # no /proc/cpuinfo (macOS): llama.cpp's default
])
def test_auto_decision(flags, build, want):
    for env in (None, "auto", " AUTO "):
        d = repack.decide(cpu_flags=flags, build_info=build, env=env)
        assert d.repack is want and d.reason


@pytest.mark.parametrize("env, want", [("on", True), ("1", True), ("off", False), ("0", False), ("false", False)])
def test_environment_overrides_either_way(env, want):
    for flags, build in ((INTEL_AMX, BUILD_AMX), (AMD_EPYC, BUILD_PLAIN)):
        assert repack.decide(cpu_flags=flags, build_info=build, env=env).repack is want


def test_bad_environment_value_is_one_clear_line():
    with pytest.raises(MfggufError, match="MFGGUF_REPACK='sometimes'.*on, off or auto"):
        repack.decide(cpu_flags=AMD_EPYC, build_info=BUILD_PLAIN, env="sometimes")


def test_cpu_flags_parses_linux_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 amx_tile amx_int8\n\n"
                 "processor\t: 1\nflags\t\t: fpu avx2 amx_tile amx_int8\n")
    assert repack.cpu_flags(f) == {"fpu", "avx2", "amx_tile", "amx_int8"}
    assert repack.cpu_flags(tmp_path / "missing") == set()


def test_this_machine_decision_matches_its_cpu():
    d = repack.current()
    amx = all(f in repack.cpu_flags() for f in repack.AMX_FLAGS) and "AMX_INT8 = 1" in repack.build_info()
    if os.environ.get(repack.ENV, "auto").lower() == "auto":
        assert d.repack is (not amx)


def test_apply_reaches_every_llama(tiny_gguf):
    import llama_cpp

    d = repack.apply()
    assert repack.apply() is d  # idempotent: wrapped once
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts is d.repack
    assert llama_cpp.Llama(str(tiny_gguf), n_ctx=32, verbose=False).model_params.use_extra_bufts is d.repack


_LOAD_AND_DECODE = """
import sys
from mfgguf.runtime.llm import loaded
with loaded(sys.argv[1], n_ctx=64, verbose=True) as llm:
    out = llm.create_completion("def main():", max_tokens=8, temperature=0.0)
    print("DECODED", out["usage"]["completion_tokens"], flush=True)
"""


def _load_log(path, env: str | None) -> tuple[int, str]:
    e = {k: v for k, v in os.environ.items() if k != repack.ENV}
    if env is not None:
        e[repack.ENV] = env
    p = subprocess.run([sys.executable, "-c", _LOAD_AND_DECODE, str(path)], capture_output=True, text=True,
                       env=e, timeout=300)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def quantized_models(trained_run, tmp_path_factory):
    from mfgguf.converters.assemble import assemble

    d = tmp_path_factory.mktemp("repack")
    out = {}
    for q in ("q8_0", "q4_0", "q4_k"):
        out[q] = d / f"tiny-{q}.gguf"
        assemble(trained_run, out[q], quant=q, progress=False)
    return out


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q4_k"])
def test_quantized_models_decode_by_default(quantized_models, quant):
    """The default policy on this machine, whatever its CPU: a real load + decode in a child process."""
    rc, log = _load_log(quantized_models[quant], None)
    assert rc == 0, f"decode of a {quant} model failed with exit code {rc}:\n{log[-2000:]}"
    assert "DECODED" in log
    if not repack.current().repack:  # AMX machines: llama.cpp must not have used any repacked buffer
        assert "AMX model buffer" not in log and "REPACK model buffer" not in log, log[-2000:]


def test_forcing_repacking_off_is_seen_by_llama_cpp(quantized_models):
    rc, log = _load_log(quantized_models["q4_0"], "off")
    assert rc == 0 and "DECODED" in log, log[-2000:]
    assert "mfgguf: MFGGUF_REPACK=off" in log
    assert "AMX model buffer" not in log and "REPACK model buffer" not in log
