#!/usr/bin/env python3
"""Build llama.cpp's own programs offline from the llama-cpp-python sdist the project pins.

    python3 scripts/build_llama_tools.py            # what `make llama-tools` runs
    python3 scripts/build_llama_tools.py --where    # print the tools' folder, build nothing
    python3 scripts/build_llama_tools.py --share-libs   # then give llama-cpp-python these libraries

The source is `vendor/llama.cpp` inside the sdist of the pinned llama-cpp-python (pyproject.toml), downloaded
once (no dependencies, no build; with pip, or without it by scripts/pypi_download.py) into the cache, the one `scripts/hf_reference.py` uses too.
CMake builds only the programs the tests use, Release, shared libraries as llama-cpp-python's own build
makes them (GGML_NATIVE left at its default, as pip's build leaves it), with every option that would
reach the network off: the server's web UI is neither downloaded (LLAMA_USE_PREBUILT_UI) nor built with
npm (LLAMA_BUILD_UI), no OpenSSL (no https model downloads). Programs and libraries land together in
`<cache>/llama-tools-<version>/bin` with an `$ORIGIN` rpath, so the folder runs wherever it is moved.

The build happens in a temporary folder beside the cache entry and is renamed into place when complete:
an interrupted build leaves nothing that looks finished. `build-info.json` records the version, the CMake
options and the CPU's feature flags (a native build is only good on the CPU kind it was made for); a
folder whose record matches is reused and the script does nothing more. The cache is `$MFGGUF_CACHE`,
else `$XDG_CACHE_HOME/mfgguf`, else `~/.cache/mfgguf`; `$MFGGUF_LLAMA_TOOLS` names the folder outright.

`--share-libs` copies the libraries this build made (libllama, libggml*, libmtmd) over the ones in the
installed llama_cpp package: the same source and options, so llama-cpp-python may be installed with
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" (no compile of its own) and be given these.
`--install-bindings` (what `make install` runs first) does all of that, so llama.cpp compiles once, but only
where it is safe: the programs are built here for this version, options and CPU, this Python has no
llama-cpp-python yet and CMAKE_ARGS is unset (a build of the user's own). The library-less wheel is built
outside pip's cache (a cached one would be reused for every later install of the version) and installed
from its file; then `import llama_cpp` must load the libraries, else the package is uninstalled again and
pip compiles it as before. Anywhere else it does nothing; docs/front-ends.md says what it saves.

Standard library only, so it runs before the project is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from pypi_download import download  # noqa: E402
PROGRAMS = ("llama-server", "llama-cli", "llama-perplexity", "llama-quantize", "llama-imatrix")
# Libraries llama-cpp-python loads from llama_cpp/lib; the programs link the same ones.
LIBRARIES = ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so", "libmtmd.so")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",            # the layout llama-cpp-python ships: one libllama for every program
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",           # llama-server, and llama-cli which is built on the server's code
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",       # the default fetches the server's web UI from a hub at build time
    "-DLLAMA_BUILD_UI=OFF",              # building it instead would need npm and the network
    "-DLLAMA_OPENSSL=OFF",               # https is only for downloading models, which the tests never do
    "-DLLAMA_CURL=OFF",                  # older vendored versions' download switch; ignored by newer ones
    "-DGGML_CCACHE=ON",                  # used when ccache is installed: a rebuild then costs little
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",     # programs find the libraries beside them, in any folder
)


def pinned_version() -> str:
    """The llama-cpp-python version pyproject.toml pins."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"llama-cpp-python(?:\[[^\]]*\])?==([0-9][^"]*)"', text)
    if not m:
        sys.exit("pyproject.toml pins no llama-cpp-python version (expected llama-cpp-python==X.Y.Z)")
    return m.group(1)


def cache_dir() -> Path:
    """$MFGGUF_CACHE, else $XDG_CACHE_HOME/mfgguf, else ~/.cache/mfgguf (as mfgguf.base.known)."""
    if os.environ.get("MFGGUF_CACHE"):
        return Path(os.environ["MFGGUF_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "mfgguf"


def tools_dir(version: str) -> Path:
    """The folder holding the built programs (and their libraries) for llama-cpp-python VERSION."""
    if os.environ.get("MFGGUF_LLAMA_TOOLS"):
        return Path(os.environ["MFGGUF_LLAMA_TOOLS"])
    return cache_dir() / f"llama-tools-{version}" / "bin"


def cpu_flags() -> str:
    """A short digest of the CPU's feature flags: a native build runs only where they match."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
        flags = " ".join(sorted(m.group(1).split())) if m else ""
    except OSError:
        flags = ""
    import platform
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:16]


def build_info(version: str) -> dict:
    return {"version": version, "programs": list(PROGRAMS), "cmake": list(CMAKE_OPTIONS), "cpu": cpu_flags()}


def is_built(bin_dir: Path, info: dict) -> bool:
    stamp = bin_dir / "build-info.json"
    if not stamp.is_file() or not all((bin_dir / p).is_file() for p in PROGRAMS):
        return False
    try:
        return json.loads(stamp.read_text()) == info
    except ValueError:
        return False


def sdist(version: str, cache: Path) -> Path:
    """The llama-cpp-python sdist of VERSION in the cache, downloaded the first time."""
    path = cache / f"llama_cpp_python-{version}.tar.gz"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        download("llama-cpp-python", version, Path(tmp), sdist=True).replace(path)
    return path


def unpack_vendor(archive: Path, dest: Path) -> Path:
    """Unpack the sdist's vendor/llama.cpp under DEST; its source folder."""
    with tarfile.open(archive) as tf:
        members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name]
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(dest, members=members, **kw)
    src = next(dest.glob("*/vendor/llama.cpp"), None)
    if src is None or not (src / "CMakeLists.txt").is_file():
        sys.exit(f"{archive.name} has no vendor/llama.cpp/CMakeLists.txt")
    return src


def compile_tools(src: Path, build: Path, jobs: int) -> None:
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_OPTIONS], check=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *PROGRAMS], check=True)


def collect(build: Path, out: Path) -> None:
    """Copy the programs and every shared library they load from the build's bin folder into OUT."""
    out.mkdir(parents=True)
    made = build / "bin"
    for p in PROGRAMS:
        shutil.copy2(made / p, out / p)
    for lib in made.glob("lib*.so*"):
        if lib.is_symlink():
            (out / lib.name).symlink_to(os.readlink(lib))
        else:
            shutil.copy2(lib, out / lib.name)


def build(version: str, jobs: int, build_dir: Path | None) -> Path:
    """Build the programs for VERSION into the cache unless a matching build is there; their folder."""
    bin_dir, info = tools_dir(version), build_info(version)
    if is_built(bin_dir, info):
        print(f"llama.cpp tools {version}: {bin_dir} is already built")
        return bin_dir
    if bin_dir.exists() and not (bin_dir / "build-info.json").is_file():  # a folder of the user's own: never replaced
        if all((bin_dir / p).is_file() for p in PROGRAMS):
            print(f"llama.cpp tools: {bin_dir} holds programs this script did not build; they are used as they are")
            return bin_dir
        sys.exit(f"{bin_dir} exists, lacks some of {', '.join(PROGRAMS)} and was not built here;"
                 " remove it or set MFGGUF_LLAMA_TOOLS to another folder")
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            sys.exit(f"building llama.cpp's tools needs {tool}; install it (e.g. apt-get install cmake g++)")
    archive = sdist(version, cache_dir())
    bin_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=bin_dir.parent, prefix=".build-") as tmp:
        work = build_dir or Path(tmp)  # a kept folder keeps its source too: CMake's cache names its path
        src = next((work / "src").glob("*/vendor/llama.cpp"), None) or unpack_vendor(archive, work / "src")
        compile_tools(src, work / "build", jobs)
        staged = Path(tmp) / "bin"
        collect(work / "build", staged)
        (staged / "build-info.json").write_text(json.dumps(info, indent=1) + "\n")
        if bin_dir.exists():
            shutil.rmtree(bin_dir)
        staged.replace(bin_dir)
    print(f"llama.cpp tools {version}: built in {time.monotonic() - t0:.0f} s -> {bin_dir}")
    return bin_dir


def package_lib_dir(version: str) -> Path:
    """The installed llama_cpp package's lib folder, after checking it is llama-cpp-python VERSION."""
    import importlib.metadata
    import importlib.util
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llama_cpp is not installed in this Python; run this with the project's venv python")
    installed = importlib.metadata.version("llama_cpp_python")
    if installed != version:  # the bindings call the libraries by their C signatures: only the same version fits
        sys.exit(f"this Python has llama-cpp-python {installed}, the tools are built from {version}; nothing done")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def share_libs(bin_dir: Path, lib: Path) -> None:
    """Copy this build's libraries over the installed llama_cpp package's (same source, same options)."""
    lib.mkdir(exist_ok=True)
    for f in sorted(f for name in LIBRARIES for f in bin_dir.glob(f"{name}*")):
        dest = lib / f.name
        if dest.is_symlink() or dest.exists():
            dest.unlink()
        if f.is_symlink():
            dest.symlink_to(os.readlink(f))
        else:
            tmp = dest.with_name(f".{f.name}.part")
            shutil.copy2(f, tmp)
            tmp.replace(dest)
    print(f"llama_cpp: libraries from {bin_dir} -> {lib}")


BINDINGS_CMAKE_ARGS = "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"  # llama-cpp-python's switches for its own compile
SMOKE = "import llama_cpp, llama_cpp.mtmd_cpp; llama_cpp.llama_backend_init(); llama_cpp.llama_backend_free()"


def install_bindings(version: str) -> bool:
    """Install llama-cpp-python VERSION into this Python with the built tools' libraries and no compile of its
    own, where that is safe (see the module's docstring); whether it did. Any failure leaves it uninstalled."""
    import importlib
    import importlib.metadata
    try:
        importlib.metadata.version("llama_cpp_python")
        return False  # installed already: pip's business (an upgrade compiles as usual)
    except importlib.metadata.PackageNotFoundError:
        pass
    bin_dir = tools_dir(version)
    if os.environ.get("CMAKE_ARGS") or not is_built(bin_dir, build_info(version)):
        return False
    pip = [sys.executable, "-m", "pip"]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "CMAKE_ARGS": BINDINGS_CMAKE_ARGS}
        built = subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-cache-dir", "-w", tmp,
                                str(sdist(version, cache_dir()))], env=env).returncode == 0
        wheel = next(Path(tmp).glob("llama_cpp_python-*.whl"), None)
        if not built or wheel is None or subprocess.run([*pip, "install", "-q", str(wheel)]).returncode != 0:
            print("llama-cpp-python: the build without libraries failed; pip compiles it instead")
            return False
    ok = False
    try:  # never leave the package installed without libraries: pip would take it as done
        importlib.invalidate_caches()  # the package appeared after this process started
        share_libs(bin_dir, package_lib_dir(version))
        ok = subprocess.run([sys.executable, "-c", SMOKE]).returncode == 0
    except Exception as e:  # noqa: BLE001 - any failure here means: let pip compile it
        print(f"llama-cpp-python: giving it {bin_dir}'s libraries failed: {e}")
    finally:
        if not ok:
            subprocess.run([*pip, "uninstall", "-q", "-y", "llama-cpp-python"])
            print(f"llama-cpp-python: {bin_dir}'s libraries do not load in it; uninstalled, pip compiles it instead")
    if not ok:
        return False
    print(f"llama-cpp-python {version}: installed in {time.monotonic() - t0:.0f} s with the libraries of {bin_dir}"
          " (no second compile of llama.cpp)")
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", default=None, help="llama-cpp-python version (default: pyproject.toml's pin)")
    ap.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    ap.add_argument("--build-dir", type=Path, default=None,
                    help="keep the source and CMake's build folder here, to rebuild incrementally"
                         " (default: a temporary one)")
    ap.add_argument("--where", action="store_true", help="print the tools' folder and exit")
    ap.add_argument("--share-libs", action="store_true",
                    help="after building, copy the libraries into this Python's installed llama_cpp package")
    ap.add_argument("--install-bindings", action="store_true",
                    help="build nothing: install llama-cpp-python with the built programs' libraries, where safe")
    a = ap.parse_args()
    version = a.version or pinned_version()
    if a.where:
        print(tools_dir(version))
        return
    if a.install_bindings:
        install_bindings(version)
        return
    lib = package_lib_dir(version) if a.share_libs else None  # checked before a build, not after it
    bin_dir = build(version, a.jobs, a.build_dir)
    if lib is not None:
        share_libs(bin_dir, lib)


if __name__ == "__main__":
    main()
