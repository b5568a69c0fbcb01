"""machine.py: MemAvailable from a meminfo file and the caller's fallback where there is none; the CPU; a process's
age and the start a CLI process pays before its first job's clock."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from mfgguf.machine import mem_available


def test_mem_available_reads_meminfo_and_falls_back(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:    2048 kB\n")
    assert mem_available(fallback=7, meminfo=f) == 2048 * 1024
    f.write_text("MemTotal:       24576000 kB\n")  # an old kernel without MemAvailable
    assert mem_available(fallback=7, meminfo=f) == 7
    assert mem_available(fallback=9, meminfo=tmp_path / "missing") == 9
    real = mem_available(fallback=-1)
    assert real == -1 or 0 < real < 1 << 50  # the machine's own: a plausible size where Linux gives one
    assert Path("/proc/meminfo").is_file() == (real != -1)


def test_cpu_names_the_model_and_the_speed_flags_it_has(tmp_path):
    from mfgguf.machine import cpu

    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 amx_tile avx512f\n"
                 "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 amx_tile avx512f\n")
    c = cpu(f)
    assert c["model"] == "Intel(R) Xeon(R) Processor"
    assert c["flags"] == ["avx2", "avx512f", "amx_tile"]  # SPEED_FLAGS' order; fpu is not one
    assert c["cores"] >= 1
    missing = cpu(tmp_path / "missing")
    assert missing["model"] == "unknown" and missing["flags"] == []


def test_cpu_says_when_torch_is_held_to_a_lower_instruction_set(tmp_path, monkeypatch):
    from mfgguf.machine import ISA_LIMITS, cpu

    for k in ISA_LIMITS:
        monkeypatch.delenv(k, raising=False)
    assert "held_to" not in cpu(tmp_path / "missing")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu(tmp_path / "missing")["held_to"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_process_age_reads_the_start_time_against_the_uptime(tmp_path):
    import os

    from mfgguf.machine import process_age

    tick = os.sysconf("SC_CLK_TCK")
    stat, uptime = tmp_path / "stat", tmp_path / "uptime"
    # the command name may hold spaces and ')': the fields are counted after its last ')'; starttime is field 22
    stat.write_text("4242 (python (x) y) S 1 " + " ".join(["0"] * 17) + f" {50 * tick} 0 0\n")
    uptime.write_text("62.50 100.00\n")
    assert process_age(stat, uptime) == pytest.approx(12.5)
    assert process_age(tmp_path / "missing", uptime) is None
    real = process_age()
    assert real is None or 0.0 <= real < 10 ** 8


def test_startup_is_counted_once_and_only_where_the_cli_started_the_process(monkeypatch):
    from mfgguf import machine

    monkeypatch.setattr(machine, "_startup_open", False)
    assert machine.startup_s(time.perf_counter()) == 0.0  # a library caller's process: its start is not the job's
    monkeypatch.setattr(machine, "process_age", lambda: 7.0)
    machine.count_startup()
    t = time.perf_counter() - 2.0  # the job's clock started 2 s ago, 5 s after the process did
    assert machine.startup_s(t) == pytest.approx(5.0, abs=0.1)
    assert machine.startup_s(t) == 0.0  # the next job in the same process started nothing anew
    machine.count_startup()
    machine.count_startup(False)  # a process that hands its jobs to others, which count their own
    assert machine.startup_s(t) == 0.0


def test_a_cli_process_records_its_imports_in_the_first_record():
    code = ("import time, sys; from mfgguf import machine; machine.count_startup(); import torch; "
            "t = time.perf_counter(); print(machine.startup_s(t), machine.startup_s(t))")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    whole = time.perf_counter() - t0
    first, second = map(float, out)
    assert 0.0 < first < whole and second == 0.0  # torch's import, seen from outside the job's own clock
