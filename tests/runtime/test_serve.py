"""`mfgguf serve`: llama-cpp-python's OpenAI-compatible server answering real requests."""

from __future__ import annotations

import subprocess
import time

import httpx

from .conftest import MFGGUF, free_port


def _wait_ready(proc, base: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"server not ready after {limit} s")


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
