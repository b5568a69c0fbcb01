"""What this machine has to give, read from Linux without importing torch (the scheduler is torch-free).

Example:
    >>> mem_available(fallback=8 << 30)  # bytes the kernel could hand out now without swapping
"""

from __future__ import annotations

from pathlib import Path


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
