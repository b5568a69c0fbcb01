"""An OpenAI-compatible HTTP API for a GGUF: llama.cpp's llama-server where `make llama-tools` built it, else
llama-cpp-python's own server (run by uvicorn), with the same options either way.

Endpoints include /v1/completions, /v1/chat/completions (with the GGUF's chat template) and /v1/models.
llama-server (runtime/llama_server.py) answers many clients at once: `--parallel` slots decoded together by
continuous batching; llama-cpp-python's server answers one request at a time. Bound to 127.0.0.1 unless told
otherwise; `--api-key` makes clients send a bearer token.

Example:
    >>> from mfgguf.runtime.serve import serve
    >>> serve("model.gguf", port=8000)   # then: curl http://127.0.0.1:8000/v1/models
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from mfgguf.errors import MfggufError
from mfgguf.runtime import repack
from mfgguf.runtime.llm import quiet_llama_logs, check_ctx, read_header


def _check_listen(host: str, port: int) -> None:
    """Fail with one line, before loading anything, if HOST:PORT cannot be listened on."""
    if not 0 <= port <= 65535:
        raise MfggufError(f"--port {port} is not a TCP port; pass 1..65535")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            s.bind(addr)
    except OSError as e:
        raise MfggufError(f"cannot listen on {host}:{port} ({e.strerror or e}); pass another --port or --host") from None


ENGINES = ("auto", "llama-server", "llama-cpp-python")


def serve(model: Path, *, host: str = "127.0.0.1", port: int = 8000, n_ctx: int | None = None,
          threads: int | None = None, api_key: str | None = None, parallel: int = 4, engine: str = "auto",
          experts_per_token: int | None = None, lora: Path | None = None) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API until Ctrl-C.

    Listens on 127.0.0.1:8000 by default (--host 0.0.0.0 exposes it to the network, without
    authentication unless --api-key is set). Clients use base URL http://HOST:PORT/v1 with
    /v1/completions and /v1/chat/completions; the model is named after the file. With llama.cpp's
    llama-server (`make llama-tools`; --engine auto picks it where built) --parallel N requests are
    answered together, by continuous batching over one KV cache of the model's context; llama-cpp-python's
    server (--engine llama-cpp-python) answers one at a time. Each slot holds --ctx tokens (default the model's
    trained context), so llama-server's KV cache is --ctx x --parallel tokens. --experts-per-token K routes each token to K
    experts (llama.cpp's metadata override); --lora ADAPTER applies an adapter to every request.

    Example:
        >>> serve("model.gguf", port=8080, parallel=8)
    """
    from mfgguf.runtime.llm import experts_override
    from mfgguf.runtime.tools import program

    if engine not in ENGINES:
        raise MfggufError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if parallel < 1:
        raise MfggufError(f"--parallel {parallel} serves nobody; pass 1 or more")
    header = read_header(model)
    n_ctx = check_ctx(header, n_ctx)
    overrides = experts_override(header, experts_per_token)
    if lora is not None:
        from mfgguf.gguf.lora import check_adapter

        if not Path(lora).is_file():
            raise MfggufError(f"LoRA adapter not found: {lora}; pass the lora.gguf that `mfgguf train-base --mode lora`"
                              " wrote")
        check_adapter(Path(lora), Path(header["path"]))
    _check_listen(host, port)
    threads = threads or os.cpu_count()
    if engine == "llama-server" or (engine == "auto" and program("llama-server")):
        from mfgguf.runtime.llama_server import run_llama_server

        print(f"serving {header['path'].name} ({header['arch']}, context {n_ctx}, {parallel} parallel slots) on"
              f" http://{host}:{port}/v1 with llama-server (OpenAI-compatible); loading the model", file=sys.stderr,
              flush=True)
        # each slot gets the whole context (KV: ctx x parallel tokens in all); llama-server splits -c among slots
        run_llama_server(header["path"], host=host, port=port, n_ctx=n_ctx * parallel, parallel=parallel, threads=threads,
                         alias=Path(model).stem, api_key=api_key, overrides=overrides, lora=lora)
        return
    _serve_python(header, host=host, port=port, n_ctx=n_ctx, threads=threads, api_key=api_key, overrides=overrides,
                  lora=lora, model=Path(model))


def _serve_python(header: dict, *, host: str, port: int, n_ctx: int, threads: int, api_key: str | None,
                  overrides: dict, lora: Path | None, model: Path) -> None:
    """llama-cpp-python's server, one request at a time."""
    try:
        import uvicorn
        from llama_cpp.server import app as server_app
        from llama_cpp.server.settings import ModelSettings, ServerSettings
    except ImportError as e:
        raise MfggufError(f"the server needs llama-cpp-python's server extra ({e.name} is missing);"
                          " pip install 'llama-cpp-python[server]==0.3.36'") from None

    quiet_llama_logs(False)
    repack.apply()  # the server's own Llama(...) gets the same AMX protection as every other verb
    model_settings = ModelSettings(
        model=str(header["path"]), model_alias=model.stem, n_ctx=n_ctx, n_batch=min(n_ctx, 512),
        n_ubatch=min(n_ctx, 512), n_threads=threads, n_threads_batch=threads, verbose=False,
        kv_overrides=[f"{k}=int:{v}" for k, v in overrides.items()] or None,
        lora_path=str(lora) if lora is not None else None,
    )
    # its default lets each new request cut off the reply being streamed: with several users, every stream but the last
    server_settings = ServerSettings(host=host, port=port, api_key=api_key, interrupt_requests=False)
    app = server_app.create_app(server_settings=server_settings, model_settings=[model_settings])
    print(f"serving {header['path'].name} ({header['arch']}, context {n_ctx}) on http://{host}:{port}/v1"
          " (OpenAI-compatible, the model loaded); Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        proxy = server_app._llama_proxy
        if proxy is not None:  # close explicitly: Llama.__del__ at exit prints a traceback
            proxy.free()
            server_app._llama_proxy = None
