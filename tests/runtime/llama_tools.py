"""llama.cpp's own programs, as `make llama-tools` builds them into the cache: where they are, how to run them.

The folder is scripts/build_llama_tools.py's (`tools_dir` of the pinned version); a test that needs a program
skips with one line naming `make llama-tools` when it is not built. `run` runs a program to its end with a
bounded wait; `server` runs llama-server on a free loopback port for a `with` block and always stops it.
Every program that loads a model gets `--no-repack` where mfgguf's repacking policy says so (AMX CPUs).
"""

from __future__ import annotations

import importlib.util
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.runtime.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("build_llama_tools", ROOT / "scripts" / "build_llama_tools.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tool(name: str) -> Path:
    """The built program NAME, or a skip saying how to build it."""
    s = _script()
    path = s.tools_dir(s.pinned_version()) / name
    if not path.is_file():
        pytest.skip(f"llama.cpp's {name} is not built; run `make llama-tools`")
    return path


def repack_flags() -> list[str]:
    """`--no-repack` where mfgguf itself would not repack (its policy, mfgguf.runtime.repack)."""
    from mfgguf.runtime import repack

    return [] if repack.current().repack else ["--no-repack"]


def run(name: str, *args, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Run program NAME with ARGS (no stdin) to its end; its exit status must be 0 unless `check` is False."""
    p = subprocess.run([str(tool(name)), *map(str, args)], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, errors="replace", timeout=timeout)
    if check:
        assert p.returncode == 0, f"{name} exited with {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p


@contextmanager
def server(model: Path, *args, ready_s: float = 60):
    """llama-server on MODEL (plus ARGS) at 127.0.0.1 on a free port, for a `with` block; yields its base URL."""
    port = free_port()
    cmd = [str(tool("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "1",
           "--no-webui", *repack_flags(), *map(str, args)]
    log = tempfile.TemporaryFile("w+", errors="replace")  # a file, not a pipe: a pipe nobody reads fills and blocks it
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"llama-server exited with {proc.returncode}:\n{log.read()[-4000:]}")
            assert time.monotonic() < deadline, f"llama-server not ready after {ready_s} s"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
