"""What this machine has to give, read from Linux without importing torch (the scheduler is torch-free).

Example:
    >>> mem_available(fallback=8 << 30)  # bytes the kernel could hand out now without swapping
    >>> cpu()  # {"model": "Intel(R) Xeon(R) Processor", "flags": ["amx_bf16", ...], "cores": 2}
    >>> startup_s(time.perf_counter())  # in a CLI process: seconds before its first timed job (imports), once
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# The instruction sets training and llama.cpp's speed turn on, named as /proc/cpuinfo names them: a figure is
# only comparable with one measured on the same model with the same of these.
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16",
               "amx_int8", "asimd", "sve", "bf16", "i8mm")


def mem_available(fallback: int, meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable of /proc/meminfo in bytes; `fallback` where it cannot be read (macOS, a sandbox).

    Callers choose the fallback by what a wrong guess costs: trunk training assumes plenty (it then
    trains in memory, as asked), the scheduler assumes 8 GiB (it then starts fewer jobs at once).
    """
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return fallback


def cpuinfo_fields(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """Each field of /proc/cpuinfo with its first value (the first core's; every core has the same model and
    flags); empty where there is none (macOS, a sandbox)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo"), fields: dict[str, str] | None = None) -> set[str]:
    """The CPU feature flags as Linux lists them (x86 names the field "flags", Arm "Features")."""
    f = cpuinfo_fields(cpuinfo) if fields is None else fields
    return set((f.get("flags") or f.get("Features") or "").split())


# Environment variables that hold torch's kernels to a lower instruction set than the CPU has (how an AVX-512
# machine stands in for an AVX2-only one): a figure taken under them says so.
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The CPU a figure was measured on: its model name, the SPEED_FLAGS it has, the cores this process sees, and
    (`held_to`) the ISA_LIMITS set in the environment, where any is."""
    fields = cpuinfo_fields(cpuinfo)
    flags = cpu_flags(fields=fields)
    held = {k: os.environ[k] for k in ISA_LIMITS if os.environ.get(k)}
    return {"model": fields.get("model name") or fields.get("Processor") or "unknown",
            "flags": [f for f in SPEED_FLAGS if f in flags], "cores": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count(), **({"held_to": held} if held else {})}


def process_age(stat: Path = Path("/proc/self/stat"), uptime: Path = Path("/proc/uptime")) -> float | None:
    """Seconds since this process was started (the kernel's start time, in clock ticks since boot, against the
    uptime); None where /proc cannot say (macOS, a sandbox)."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5), the third after the name
        return max(0.0, float(uptime.read_text().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return None


_startup_open = False  # set by the CLI: a process started to run one command pays its start once, in its first job


def count_startup(on: bool = True) -> None:
    """Mark this process as started for one command (the CLI's main), so its first timed job counts the start; off
    for a process that only hands jobs to others (they count their own) and whose later clocks must not claim it."""
    global _startup_open
    _startup_open = on


def startup_s(t_start: float) -> float:
    """Seconds this process ran before `t_start` (a time.perf_counter() reading): the interpreter's start, the imports
    (torch's alone takes seconds), the CLI's parsing. A wall that starts at a job's own clock misses them, and a recipe
    of many processes pays them once a process. The first call in a process the CLI started returns them; later
    calls (jobs run in-process after the first start nothing anew), a library caller's process (its start is not
    the job's) and a process whose age cannot be read give 0.0."""
    global _startup_open
    if not _startup_open:
        return 0.0
    _startup_open = False
    age = process_age()
    return 0.0 if age is None else max(0.0, age - (time.perf_counter() - t_start))
