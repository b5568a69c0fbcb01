"""`mfgguf serve`: llama-cpp-python's OpenAI-compatible server answering real requests."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from .conftest import MFGGUF, free_port
from .llama_tools import tool


def _wait_ready(proc, base: str, limit: float = 60.0, headers: dict | None = None) -> None:
    """Until /v1/models answers 200: llama-server listens before its model is loaded, and answers 503 meanwhile."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{base}/v1/models", timeout=2, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"server not ready after {limit} s")


def _stderr_until(proc, text: str, limit: float = 30.0) -> str:
    """The server's stderr lines up to the first holding `text` (or all it wrote in `limit` s): a server polled
    every fraction of a second may not have said it yet when a tiny model's requests are already answered.
    A thread reads them, so lines the pipe's buffer already holds are not waited for."""
    import threading

    said: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            said.append(line)
            if text in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(limit)
    return "".join(said)


def test_serve_completions_and_chat(tiny_gguf):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([MFGGUF, "serve", str(tiny_gguf), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(proc, base)
        models = httpx.get(f"{base}/v1/models").json()
        assert models["data"][0]["id"] == tiny_gguf.stem
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "def ", "max_tokens": 12, "temperature": 0, "seed": 1},
                       timeout=60)
        assert r.status_code == 200, r.text
        c = r.json()
        assert c["object"] == "text_completion" and c["choices"][0]["text"]
        assert 0 < c["usage"]["completion_tokens"] <= 12
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "seed": 1})
        assert r.status_code == 200, r.text
        m = r.json()["choices"][0]["message"]
        assert m["role"] == "assistant" and isinstance(m["content"], str)
    finally:
        proc.terminate()  # SIGTERM: uvicorn shuts down, the model is closed
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert "Traceback" not in err, err
    assert "127.0.0.1" in err  # it says where it listens


def test_port_in_use_is_one_error_line(tiny_gguf):
    import socket

    from typer.testing import CliRunner

    from mfgguf.cli.app import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = CliRunner().invoke(app, ["serve", str(tiny_gguf), "--port", str(port)])
    assert r.exit_code == 1
    assert r.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port} (Address already in use); pass another --port or --host"


def _load_client():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).parents[2] / "scripts" / "bench" / "bench_serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("engine", ["llama-server", "llama-cpp-python"])
def test_eight_concurrent_clients_are_all_answered_and_one_leaving_mid_stream_stops_nobody(tiny_gguf, engine):
    """scripts/bench/bench_serve.py's load on `mfgguf serve --parallel 8`: every request of eight clients at once is
    answered, while a ninth walks away from its streamed reply; llama-server needs `make llama-tools`."""
    if engine == "llama-server":
        tool("llama-server")
    bench = _load_client()
    port = free_port()
    proc = bench.start(tiny_gguf, engine, 8, port, threads=2)
    try:
        r = bench.load(f"http://127.0.0.1:{port}", 8, 1, 8, timeout=120, deadline_s=300, disconnect=True)
    finally:
        bench.stop(proc)
    assert r["answered"] == r["requests"] == 8 and r["lost"] == 0, r
    assert r["chunks_before_leaving"] >= 1 and r["tokens"] > 0


def test_serve_refuses_a_bad_parallel_and_engine_in_one_line(tiny_gguf):
    from typer.testing import CliRunner

    from mfgguf.cli.app import app

    for args, msg in ((["--parallel", "0"], "--parallel 0 serves nobody"), (["--engine", "vllm"], "unknown engine"),
                      (["--experts-per-token", "9"], "--experts-per-token 9 is out of range")):
        r = CliRunner().invoke(app, ["serve", str(tiny_gguf), *args])
        assert r.exit_code == 1 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("engine", ["llama-server", "llama-cpp-python"])
def test_api_key_is_required_by_either_server(tiny_gguf, engine):
    if engine == "llama-server":
        tool("llama-server")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([MFGGUF, "serve", str(tiny_gguf), "--port", str(port), "--engine", engine, "--api-key",
                             "s3cret"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        key = {"Authorization": "Bearer s3cret"}
        _wait_ready(proc, base, headers=key)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).status_code == 401
        ok = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60, headers=key)
        assert ok.status_code == 200, ok.text
        # it says when the model is loaded, not only where it will listen: llama-server answers 503 until then
        ready = "ready: http://127.0.0.1" if engine == "llama-server" else "the model loaded"
        said = _stderr_until(proc, ready)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    said += err
    assert ready in said and said.index(ready) > said.index(f"127.0.0.1:{port}/v1"), said
