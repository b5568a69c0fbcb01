"""Many users on one `mfgguf serve`: concurrent chat clients on loopback against llama-server and llama-cpp-python's
server, each engine started the way a user starts it (`mfgguf serve FILE --engine E --parallel N`).

For each engine, two phases on the same prompts: one client alone sends its requests one after another, then N
clients at once each send theirs, while one more client opens a streamed reply and disconnects after a few tokens
(the others must not notice). Every request is a chat turn answered to at most --max-tokens tokens. Per phase: the
requests answered and lost, each request's latency (p50, p95), and the aggregate completion tokens/s (all clients'
tokens over the phase's wall), with the concurrent phase over the one client alone. Bounded in requests and time
(each request has a timeout, each phase a deadline), loopback only.

Prints JSON lines and appends them to OUT/bench_serve.jsonl: a line per phase and engine, then a line per engine with
the ratio.

    python scripts/bench/bench_serve.py demo-run/model-q8_0.gguf --clients 8 --requests 2 --max-tokens 48 --out bench-out/serve
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS = ["What is a list in Python?", "How do I open a file?", "Explain a for loop.", "What does a compiler do?",
           "Name three sorting algorithms.", "What is a pointer?", "How does a hash table work?",
           "What is recursion?", "Write a haiku about code.", "What is an operating system?",
           "Why are tests useful?", "What is a function?", "How do I read a CSV file?", "What is a thread?",
           "Explain what an API is.", "What is version control?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: Path, engine: str, parallel: int, port: int, threads: int | None, ready_s: float = 120):
    """`mfgguf serve` in a process of its own, once /v1/models answers."""
    cmd = [sys.executable, "-m", "mfgguf", "serve", str(model), "--engine", engine, "--parallel", str(parallel),
           "--port", str(port), *(("--threads", str(threads)) if threads else ())]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench_serve: `mfgguf serve` exited with {proc.returncode}: {proc.stderr.read()[-500:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    stop(proc)
    raise SystemExit(f"bench_serve: the {engine} server was not ready after {ready_s:.0f} s")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ask(base: str, prompt: str, max_tokens: int, timeout: float, seed: int) -> dict:
    """One chat turn: {"ok", "latency_s", "tokens"} (tokens: the reply's completion tokens)."""
    t0 = time.perf_counter()
    try:
        r = httpx.post(f"{base}/v1/chat/completions", timeout=timeout, json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.8,
            "seed": seed})
        ok = r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        tokens = int(r.json()["usage"]["completion_tokens"]) if ok else 0
    except (httpx.HTTPError, ValueError, KeyError):
        ok, tokens = False, 0
    return {"ok": ok, "latency_s": time.perf_counter() - t0, "tokens": tokens}


def walk_away(base: str, after: int, timeout: float) -> dict:
    """A streamed reply abandoned after `after` chunks: the client closes the connection mid-stream."""
    got = 0
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=timeout, json={
                "messages": [{"role": "user", "content": "Tell me a long story about a compiler."}],
                "max_tokens": 512, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and "content" in line:
                    got += 1
                    if got >= after:
                        break  # leaving the block closes the connection
    except httpx.HTTPError:
        pass
    return {"chunks_before_leaving": got}


def load(base: str, clients: int, requests: int, max_tokens: int, timeout: float = 300, deadline_s: float = 900,
         disconnect: bool = False) -> dict:
    """`clients` threads each sending `requests` chat turns (and, with `disconnect`, one more client that leaves
    mid-stream): every result, the phase's wall, and its summary."""
    results: list[dict] = []
    lock, t_end = threading.Lock(), time.monotonic() + deadline_s

    def client(c: int) -> None:
        for k in range(requests):
            if time.monotonic() > t_end:
                r = {"ok": False, "latency_s": 0.0, "tokens": 0, "skipped": True}
            else:
                r = ask(base, PROMPTS[(c * requests + k) % len(PROMPTS)], max_tokens, timeout, seed=c * 100 + k)
            with lock:
                results.append({**r, "client": c})

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    left: dict = {}
    if disconnect:
        threads.append(threading.Thread(target=lambda: left.update(walk_away(base, 4, timeout))))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(r["latency_s"] for r in results if r["ok"])
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "answered": sum(r["ok"] for r in results),
            "lost": sum(not r["ok"] for r in results), "wall_s": round(wall, 2), "tokens": tokens,
            "tokens_per_s": tokens / wall if wall else 0.0,
            "p50_s": statistics.median(lat) if lat else None,
            "p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None, **left}


def emit(out: Path, **rec) -> dict:
    print(json.dumps(rec), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench_serve.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def main(argv=None) -> None:
    from mfgguf.machine import cpu

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--engines", default="llama-server,llama-cpp-python")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2, help="requests each client sends")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None, help="the server's threads (default: every core)")
    ap.add_argument("--out", type=Path, default=Path("bench-out/serve"))
    a = ap.parse_args(argv)
    machine = cpu()
    for engine in a.engines.split(","):
        port = free_port()
        proc = start(a.model, engine, a.clients, port, a.threads)
        try:
            base = f"http://127.0.0.1:{port}"
            ask(base, "Hello", 4, 120, 0)  # warm: the first request pays the model's first decode
            one = load(base, 1, a.clients * a.requests // 2 or 1, a.max_tokens)
            emit(a.out, engine=engine, phase="one client", model=a.model.name, cpu=machine, **one)
            many = load(base, a.clients, a.requests, a.max_tokens, disconnect=True)
            emit(a.out, engine=engine, phase=f"{a.clients} clients", model=a.model.name, cpu=machine, **many)
            emit(a.out, engine=engine, summary=True, model=a.model.name, cpu=machine,
                 all_answered=many["lost"] == 0 and one["lost"] == 0,
                 aggregate_over_one=many["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] else None)
        finally:
            stop(proc)


if __name__ == "__main__":
    main()
