"""An OpenAI-compatible HTTP API for a GGUF: llama-cpp-python's own server, run by uvicorn.

Endpoints include /v1/completions, /v1/chat/completions (with the GGUF's chat template),
/v1/models and /docs. Bound to 127.0.0.1 unless told otherwise: there is no authentication.

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


def serve(model: Path, *, host: str = "127.0.0.1", port: int = 8000, n_ctx: int | None = None,
          threads: int | None = None, api_key: str | None = None) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API until Ctrl-C.

    Listens on 127.0.0.1:8000 by default (--host 0.0.0.0 exposes it to the network, without
    authentication unless --api-key is set). Clients use base URL http://HOST:PORT/v1 with
    /v1/completions and /v1/chat/completions; the model is named after the file.

    Example:
        >>> serve("model.gguf", port=8080)
    """
    header = read_header(model)
    n_ctx = check_ctx(header, n_ctx)
    _check_listen(host, port)
    try:
        import uvicorn
        from llama_cpp.server import app as server_app
        from llama_cpp.server.settings import ModelSettings, ServerSettings
    except ImportError as e:
        raise MfggufError(f"the server needs llama-cpp-python's server extra ({e.name} is missing);"
                          " pip install 'llama-cpp-python[server]==0.3.36'") from None

    quiet_llama_logs(False)
    repack.apply()  # the server's own Llama(...) gets the same AMX protection as every other verb
    threads = threads or os.cpu_count()
    model_settings = ModelSettings(
        model=str(header["path"]), model_alias=Path(model).stem, n_ctx=n_ctx, n_batch=min(n_ctx, 512),
        n_ubatch=min(n_ctx, 512), n_threads=threads, n_threads_batch=threads, verbose=False,
    )
    server_settings = ServerSettings(host=host, port=port, api_key=api_key)
    app = server_app.create_app(server_settings=server_settings, model_settings=[model_settings])
    print(f"serving {header['path'].name} ({header['arch']}, context {n_ctx}) on http://{host}:{port}/v1"
          " (OpenAI-compatible); Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        proxy = server_app._llama_proxy
        if proxy is not None:  # close explicitly: Llama.__del__ at exit prints a traceback
            proxy.free()
            server_app._llama_proxy = None
