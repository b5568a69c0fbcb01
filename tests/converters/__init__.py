"""Converter tests: shared helpers (synthetic RUNs, llama.cpp logits, the real text sample)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def synthetic_run(out: Path, **kw) -> Path:
    """scripts/synthetic_run.build: random-weight modules, real BPE tokenizer, real module files."""
    spec = importlib.util.spec_from_file_location("synthetic_run", ROOT / "scripts" / "synthetic_run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kw.setdefault("max_chars", 400_000)
    return mod.build(out, **kw)


def text_sample(n_chars: int = 4000) -> str:
    """Real English prose that ships with Python (pydoc topics)."""
    import pydoc_data.topics as t

    return (t.topics["assignment"] + t.topics["for"] + t.topics["exceptions"])[:n_chars]


def llama_logits(path: Path, ids: list[int], n_ctx: int) -> np.ndarray:
    """llama.cpp's logits (T, V) for `ids`; f32 KV cache so only the arithmetic differs from torch."""
    from llama_cpp import Llama

    from mfgguf.runtime import repack

    repack.apply()  # as every mfgguf verb does: no AMX repacking (llama.cpp's AMX matmul crashes)
    llm = Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def llama_tokenize(path: Path, text: str) -> list[int]:
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=64, vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    finally:
        llm.close()


def nll(logits: np.ndarray, ids: list[int]) -> float:
    """Mean next-token negative log-likelihood of ids[1:] under logits[:-1]."""
    x = logits[:-1].astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    return float(np.mean(lse - x[np.arange(len(x)), ids[1:]]))


def reference_logits(run: Path, gguf_path: Path, ids: list[int]) -> tuple[np.ndarray, object]:
    import torch

    from mfgguf.reference import reference_model

    model, route = reference_model(run, gguf_path)
    with torch.no_grad():
        return model(torch.tensor([ids]), route=route)[0].float().numpy(), model


def rel_diff(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).mean() / np.abs(ref).mean())


def repool(run: Path, trunk_sha256: str | None = None) -> None:
    """Re-record the run's pooled router statistics for its experts as they are now (and for `trunk_sha256`
    if given): after a test rewrites a module, only what it changed on purpose is wrong."""
    import json

    from safetensors.numpy import load_file

    from mfgguf.run import RunDir, write_router_stats

    rd = RunDir(run)
    meta = json.loads(rd.router_stats_meta.read_text())
    n = json.loads(rd.run_json.read_text())["n_experts"]
    experts = {f"expert_{i:03d}": json.loads(rd.module_meta(i).read_text())["sha256"] for i in range(1, n + 1)
               if rd.module_meta(i).is_file()}
    write_router_stats(rd, load_file(str(rd.router_stats)),
                       {**meta, "trunk_sha256": trunk_sha256 or meta["trunk_sha256"], "experts": experts})


def flip_byte(path: Path, from_end: int = 10) -> None:
    """Damage a file in place: invert one byte near its end (inside the last tensor's data)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size - from_end)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
