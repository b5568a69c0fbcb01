"""machine.py: MemAvailable from a meminfo file, and the caller's fallback where there is none."""

from pathlib import Path

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
