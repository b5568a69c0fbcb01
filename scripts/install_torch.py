"""Install torch's CPU build into this Python (what `make install` runs with the venv's python), then say what it got.

    .venv/bin/python scripts/install_torch.py torch==2.13.0 --index https://download.pytorch.org/whl/cpu

PyPI's Linux x86-64 torch is the CUDA build: gigabytes of CUDA libraries a CPU never uses. PyTorch's CPU
index serves the CPU build (and torch's dependencies), so it is asked first, but only if it answers a probe
within a few seconds (with pip's configured certificate and proxy): where that host cannot be reached (a
machine whose pip reaches only a PyPI mirror), the probe fails fast and the pin is installed from pip's own
configuration, which may be a CPU wheel in find-links or a mirror's CUDA build. A failed install from the
CPU index falls back the same way. `--index ''` skips the CPU index. Then one line says which build is
installed (torch.version.cuda) and how large the environment is, and for a CUDA build, how to get the CPU one.
A torch already installed at the pinned version is left as it is. Standard library only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pypi_download import opener, pip_settings  # noqa: E402

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_S = 3  # seconds the CPU index has to answer before it is taken as unreachable


def installed(pin: str) -> str | None:
    """The installed torch's version if it satisfies PIN (`torch==X.Y.Z`, any local label), else None."""
    try:
        have = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    return have if have.split("+")[0] == pin.partition("==")[2] else None


def reachable(index: str, timeout: float = PROBE_S) -> bool:
    """Whether INDEX's torch page answers within TIMEOUT seconds."""
    try:
        with opener(pip_settings()).open(f"{index.rstrip('/')}/torch/", timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def pip_install(*args: str) -> bool:
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args]).returncode == 0


def install(pin: str, index: str) -> None:
    if index and reachable(index):
        if pip_install("--timeout", "10", "--retries", "1", "--index-url", index, pin):
            return
        print(f"install_torch: {pin} from {index} failed; installing it from pip's configured index")
    elif index:
        print(f"install_torch: {index} is not reachable from here (no answer within {PROBE_S} s);"
              f" installing {pin} from pip's configured index")
    if not pip_install(pin):
        sys.exit(f"install_torch: pip could not install {pin}")


def env_bytes(prefix: Path) -> int:
    return sum(f.stat().st_size for f in prefix.rglob("*") if f.is_file() and not f.is_symlink())


def report(pin: str, index: str) -> None:
    """One line: the torch build now installed, and the environment's size; how to get the CPU build."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"install_torch: torch does not import:\n{out.stderr}")
    version, cuda = out.stdout.split()
    size = f"{sys.prefix} holds {env_bytes(Path(sys.prefix)) / 1e9:.1f} GB"
    if cuda == "None":
        print(f"install_torch: torch {version}, the CPU build; {size}")
        return
    print(f"install_torch: torch {version} is the CUDA {cuda} build (this project runs on the CPU); {size}.\n"
          f"  For the CPU build, make {index or CPU_INDEX} reachable (or set TORCH_CPU_INDEX to a mirror of it),"
          f" then: rm -rf {os.path.relpath(sys.prefix)} && make install")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pin", help="torch==X.Y.Z")
    ap.add_argument("--index", default=CPU_INDEX, help="PyTorch's CPU index ('' to skip it)")
    a = ap.parse_args()
    if have := installed(a.pin):
        print(f"install_torch: torch {have} is installed")
    else:
        install(a.pin, a.index)
    report(a.pin, a.index)


if __name__ == "__main__":
    main()
