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
