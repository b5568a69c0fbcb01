"""`mfgguf export-hf`: an assembled MoE GGUF -> a Hugging Face model directory (config, safetensors, tokenizer).

Each layout becomes the transformers class that computes what llama.cpp computes for it (one file
each beside this one): granitemoe -> GraniteMoeSharedForCausalLM, mixtral (llama with experts) ->
MixtralForCausalLM, qwen2moe -> Qwen2MoeForCausalLM, qwen3moe -> Qwen3MoeForCausalLM. Tensors are
dequantized and written a chunk of rows at a time (shards.py), so memory stays near one chunk and one
attention tensor, whatever the model's size. The directory is built beside `out` and renamed into
place when complete; an existing non-empty `out` is replaced only with `force`.

Example:
    >>> r = export_hf(Path("model.gguf"), Path("model-hf"), dtype="bf16")
    >>> r["hf_class"], r["bytes"]
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from mfgguf.converters.hf.granitemoeshared import GraniteMoeShared
from mfgguf.converters.hf.mixtral import Mixtral
from mfgguf.converters.hf.qwen2moe import Qwen2Moe
from mfgguf.converters.hf.qwen3moe import Qwen3Moe
from mfgguf.converters.hf.shards import DTYPES, nbytes, plan_shards, write_shards
from mfgguf.converters.hf.source import GGUFSource
from mfgguf.converters.hf.target import Target
from mfgguf.converters.hf.tokenizer import tokenizer_files
from mfgguf.errors import MfggufError
from mfgguf.run.files import swap_dir_into_place

TARGETS: dict[str, type[Target]] = {c.arch: c for c in (GraniteMoeShared, Mixtral, Qwen2Moe, Qwen3Moe)}
SUPPORTED = "granitemoe, qwen2moe, qwen3moe, and the folded layout (llama with experts)"


def target_for(src: GGUFSource) -> Target:
    """The output architecture of a file, or one line saying which layouts export-hf writes."""
    cls = TARGETS.get(src.arch)
    if cls is None:
        raise MfggufError(f"{src.path} is a {src.arch or 'nameless'} file; export-hf writes {SUPPORTED} MoE files")
    t = cls(src)
    used = {p.tensor for x in t.tensors() for p in x.pieces} | t.config_tensors()
    extra = [n for n in src.tensors if n not in used]
    if extra:
        raise MfggufError(f"{src.path}: tensor {extra[0]} has no place in {t.hf_class}; export-hf cannot write this file")
    return t


def _out_ready(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise MfggufError(f"{out} is a file; give a directory path for the Hugging Face model")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise MfggufError(f"{out} exists and is not empty; pass --force to replace it")


def export_hf(model: Path, out: Path, *, dtype: str = "f32", max_shard_gb: float = 4.0, force: bool = False) -> dict:
    """Export an assembled MoE GGUF as a Hugging Face model directory that transformers loads with
    AutoModelForCausalLM.from_pretrained: config.json, safetensors shards, tokenizer files with the
    chat template. Each layout becomes the class that computes the same function: granitemoe ->
    GraniteMoeShared, mixtral -> Mixtral, qwen2moe -> Qwen2-MoE, qwen3moe -> Qwen3-MoE. Weights are
    dequantized tensor by tensor (f32 keeps them exact; bf16 halves the size for GPU serving).

    Example:
        mfgguf export-hf model.gguf -o model-hf --dtype bf16
    """
    if dtype not in DTYPES:
        raise MfggufError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if max_shard_gb <= 0:
        raise MfggufError(f"--max-shard-gb must be positive, not {max_shard_gb}")
    out = Path(out)
    _out_ready(out, force)
    t0 = time.perf_counter()
    with GGUFSource(model) as src:
        target = target_for(src)
        tensors = target.tensors()
        shards = plan_shards(tensors, dtype, int(max_shard_gb * 1e9))
        files = {"config.json": json.dumps(target.config(dtype), indent=2) + "\n",
                 "generation_config.json": json.dumps(_generation(src), indent=2) + "\n", **tokenizer_files(src)}
        out.parent.mkdir(parents=True, exist_ok=True)
        need = sum(nbytes(x, dtype) for x in tensors)
        if shutil.disk_usage(out.parent).free < need:
            raise MfggufError(f"not enough disk space for the export: it needs {need / 1e9:.2f} GB in {out.parent};"
                              " free some space, write it elsewhere, or use --dtype bf16")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        try:
            _, total = write_shards(tmp, src, shards, dtype)
            for name, text in files.items():
                (tmp / name).write_text(text, encoding="utf-8")
            _fsync_dir(tmp)
            _out_ready(out, force)  # still true now that the export is complete
            swap_dir_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return {"path": str(out), "arch": src.arch, "hf_class": target.hf_class, "tensors": len(tensors),
            "shards": len(shards), "bytes": total, "dtype": dtype, "seconds": time.perf_counter() - t0}


def _generation(src: GGUFSource) -> dict:
    """generation_config.json: the file's BOS / EOS / padding tokens."""
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "padding": "pad_token_id"}
    return {v: int(x) for k, v in keys.items() if (x := src.kv(f"tokenizer.ggml.{k}_token_id", None)) is not None}


def _fsync_dir(d: Path) -> None:
    """Every file of the finished directory on disk (the shards were synced as they were written)."""
    for p in d.iterdir():
        if not p.name.endswith(".safetensors"):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
