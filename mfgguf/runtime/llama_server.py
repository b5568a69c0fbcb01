"""`mfgguf serve` on llama.cpp's own llama-server: parallel slots, continuous batching, the file's chat template.

llama-cpp-python's server answers one request at a time; llama-server decodes several conversations in one batch
(`--parallel` slots over one unified KV cache of the model's context, continuous batching on), so concurrent users
share the CPU instead of queueing behind each other. The command is the one a user would type:

    llama-server -m FILE --host 127.0.0.1 --port 8000 -c CTX -np 4 -t THREADS --alias NAME --no-webui
                 [--api-key KEY] [--override-kv ARCH.expert_used_count=int:K] [--lora ADAPTER]

with `--jinja` (its default) rendering the GGUF's `tokenizer.chat_template`, and `--no-repack` where mfgguf's
repacking policy says so (AMX CPUs). The endpoints are OpenAI's (/v1/chat/completions, /v1/completions,
/v1/models) as with llama-cpp-python's server, plus llama-server's own (/health, /slots).

Example:
    >>> run_llama_server(Path("model.gguf"), host="127.0.0.1", port=8000, n_ctx=8192, parallel=4, threads=2)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mfgguf.errors import MfggufError

CACHE_RAM_MIB = 1024  # llama-server's prompt cache in RAM, MiB (its own default is eight times this: a laptop's memory)


def command(model: Path, *, host: str, port: int, n_ctx: int, parallel: int, threads: int, alias: str,
            api_key: str | None = None, overrides: dict | None = None, lora: Path | None = None) -> list[str]:
    from mfgguf.runtime import repack
    from mfgguf.runtime.tools import need

    cmd = [str(need("llama-server")), "-m", str(model), "--host", host, "--port", str(port), "-c", str(n_ctx),
           "-np", str(parallel), "-t", str(threads), "--alias", alias, "--no-webui", "--cache-ram", str(CACHE_RAM_MIB)]
    if api_key:
        cmd += ["--api-key", api_key]
    for k, v in (overrides or {}).items():
        cmd += ["--override-kv", f"{k}=int:{int(v)}"]
    if lora is not None:
        cmd += ["--lora", str(lora)]
    return cmd + ([] if repack.current().repack else ["--no-repack"])


def _wait_loaded(proc: subprocess.Popen, host: str, port: int, every_s: float = 0.2) -> bool:
    """Until llama-server's /health answers 200 (it listens while the model loads, answering 503 meanwhile, and
    /health needs no API key); False if it exits first."""
    import urllib.error
    import urllib.request

    h = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)  # a wildcard is reached on loopback
    url = f"http://{f'[{h}]' if ':' in h else h}:{port}/health"  # an IPv6 literal goes in brackets
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):  # not listening yet, or 503 while loading
            pass
        time.sleep(every_s)
    return False


def run_llama_server(model: Path, *, host: str, port: int, n_ctx: int, parallel: int, threads: int, alias: str,
                     api_key: str | None = None, overrides: dict | None = None, lora: Path | None = None) -> None:
    """Run llama-server in the foreground until Ctrl-C or SIGTERM (passed on to it); one line if it fails to start."""
    cmd = command(model, host=host, port=port, n_ctx=n_ctx, parallel=parallel, threads=threads, alias=alias,
                  api_key=api_key, overrides=overrides, lora=lora)
    with tempfile.TemporaryFile("w+", errors="replace") as log:  # its log: the reason, should it stop
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        previous = signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
        try:
            if _wait_loaded(proc, host, port):
                print(f"ready: http://{host}:{port}/v1 answers (the model is loaded); Ctrl-C stops", file=sys.stderr,
                      flush=True)
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            rc = 0
        finally:
            signal.signal(signal.SIGTERM, previous)
            if proc.poll() is None:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if rc not in (0, -signal.SIGTERM, 143):
            log.seek(0)
            lines = [l for l in log.read().splitlines() if l.strip()]
            why = next((l for l in reversed(lines) if "error" in l.lower()), lines[-1] if lines else "no output")
            raise MfggufError(f"llama-server stopped with exit code {rc} ({why.strip()[-200:]}); run"
                              f" `{' '.join(cmd)}` to see its whole log")
    print("llama-server stopped", file=sys.stderr, flush=True)


__all__ = ["command", "run_llama_server"]
