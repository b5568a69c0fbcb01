"""Whether llama.cpp may repack quantized weights into its "extra" CPU buffer types, decided per machine.

llama.cpp copies quantized weights, at load time, into buffer types laid out for the CPU's
fastest kernels (`use_extra_bufts`, llama-cli's `--no-repack` turns it off). On CPUs with Intel
AMX it picks the AMX buffer type, and llama.cpp's AMX matmul segfaults there on the first decode
(q8_0, q4_0, q4_k alike; f16/f32 weights are never repacked and run fine). This is llama.cpp's
own bug, not something in our files: a GGUF that llama.cpp's own quantizer writes crashes the same
way (scripts/bench/bench_repack.py checks both). So, by default:

  - CPU has AMX and this llama.cpp was built with AMX kernels -> no repacking (the only safe choice);
  - any other CPU                                              -> repacking, llama.cpp's default.

`MFGGUF_REPACK=on|off|auto` overrides the choice (on: repack even on AMX, to try a fixed
llama.cpp; off: never repack, e.g. to compare speeds). The choice is applied to every
`llama_cpp.Llama` this process creates, including the ones llama-cpp-python's OpenAI server
creates, by wrapping `llama_model_default_params` once: there is no other hook, since `Llama`
loads the model inside its constructor.

Example:
    >>> decide(cpu_flags={"avx2", "amx_tile", "amx_int8"}, build_info="AMX_INT8 = 1 |", env=None)
    Decision(repack=False, reason='CPU has AMX and llama.cpp was built with AMX kernels, ...')
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mfgguf.errors import MfggufError
from mfgguf.machine import cpu_flags  # re-exported: decide's callers read the flags here

ENV = "MFGGUF_REPACK"
AMX_FLAGS = ("amx_tile", "amx_int8")  # /proc/cpuinfo names; both are needed for AMX int8 matmuls
_ON, _OFF = ("on", "1", "true", "yes"), ("off", "0", "false", "no")


@dataclass(frozen=True)
class Decision:
    repack: bool  # the value of llama_model_params.use_extra_bufts
    reason: str  # one line for `--verbose` output and the benchmarks


def decide(*, cpu_flags: set[str], build_info: str, env: str | None) -> Decision:
    """The repacking policy as a pure function of the CPU's flags, llama.cpp's build and MFGGUF_REPACK."""
    v = (env or "auto").strip().lower()
    if v in _ON:
        return Decision(True, f"{ENV}={env}: repacking forced on")
    if v in _OFF:
        return Decision(False, f"{ENV}={env}: repacking forced off")
    if v != "auto":
        raise MfggufError(f"{ENV}={env!r} is not understood; set it to on, off or auto (or unset it)")
    cpu_amx = all(f in cpu_flags for f in AMX_FLAGS)
    build_amx = "AMX_INT8 = 1" in build_info
    if cpu_amx and build_amx:
        return Decision(False, "CPU has AMX and llama.cpp was built with AMX kernels, whose repacked "
                               f"matmul crashes: weights are not repacked ({ENV}=on to force it)")
    if cpu_amx:
        return Decision(True, "CPU has AMX but this llama.cpp has no AMX kernels: repacking is safe")
    return Decision(True, "no AMX on this CPU: llama.cpp repacks quantized weights as usual")


def build_info() -> str:
    """llama.cpp's system info line ("AVX2 = 1 | AMX_INT8 = 1 | ..."): what this build compiled in."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode("utf-8", "replace")


_applied: list[Decision] = []


def current() -> Decision:
    """This machine's decision (computed once per process)."""
    if not _applied:
        _applied.append(decide(cpu_flags=cpu_flags(), build_info=build_info(), env=os.environ.get(ENV)))
    return _applied[0]


def apply() -> Decision:
    """Make every `llama_cpp.Llama` created from now on in this process follow `current()`.

    Idempotent. Call it before constructing a Llama (runtime.llm.open_model and serve do).
    """
    import llama_cpp.llama as llama_mod
    import llama_cpp.llama_cpp as lib

    d = current()
    if getattr(lib.llama_model_default_params, "_mfgguf", False):
        return d
    original = lib.llama_model_default_params

    def llama_model_default_params():
        params = original()
        params.use_extra_bufts = current().repack
        return params

    llama_model_default_params._mfgguf = True
    lib.llama_model_default_params = llama_model_default_params
    # llama.py resolves it through the `llama_cpp` module object it imported, which is `lib`
    assert getattr(llama_mod, "llama_cpp", lib) is lib
    return d


__all__ = ["ENV", "Decision", "decide", "cpu_flags", "build_info", "current", "apply"]
