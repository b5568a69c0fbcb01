"""llama.cpp's own path to the same GGUF, for scripts/bench/bench_assemble.py: a Hugging Face checkpoint written
from the very weights mfgguf assembled, `convert_hf_to_gguf.py`, and `llama_model_quantize`.

The checkpoint is `GraniteMoeSharedForCausalLM`: the same shape as mfgguf's granitemoe file (the anchor
is the shared expert, the routed experts are stacked, the router is `router.layer`), so both paths
produce the same tensors. (A Mixtral checkpoint cannot hold the anchor except folded into every
expert: for the `1b` preset that is 100 x (6144 + 256)-wide experts, ~94 GB in f32.) It is written
from mfgguf's own f32 GGUF of the run, with q/k un-permuted to Hugging Face's rotary layout (the
converter permutes them back), so a q8_0 conversion can be compared with mfgguf's byte for byte.

The converter ships in llama-cpp-python's source distribution; `converter_dir` fetches that with
`pip download` from the package registry (the version installed here) and unpacks the converter,
its `conversion/` package and its `gguf-py` into a cache. It needs the `bench` extra (transformers,
sentencepiece) for the tokenizer. One change to the converter's run: our byte-level BPE is not in
its table of known pre-tokenizer hashes, so `get_vocab_base_pre` answers "gpt-2" (what mfgguf
writes); that touches only the vocabulary, not the tensor path being timed.

Nothing comes from a model hub.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def converter_dir(cache: Path) -> Path:
    """vendor/llama.cpp of the installed llama-cpp-python's sdist, unpacked under `cache` (fetched once)."""
    from importlib.metadata import version

    ver = version("llama-cpp-python")
    dest = cache / f"llama.cpp-{ver}"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{ver}.tar.gz"
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={ver}", "--no-binary", ":all:",
                        "--no-deps", "-q", "-d", str(cache)], check=False)
        if not sdist.is_file():
            raise SystemExit(f"could not fetch llama-cpp-python {ver}'s source distribution with pip download")
    prefix = f"llama_cpp_python-{ver}/vendor/llama.cpp/"
    tmp = cache / f".unpack-{ver}"
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(prefix) and m.name[len(prefix):].startswith(KEEP)]
        tf.extractall(tmp, members=members, filter="data")
    (tmp / prefix).rename(dest)
    return dest


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute: llama.cpp's rope row order -> Hugging Face's."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_hf_checkpoint(gguf_path: Path, tokenizer_json: Path, out: Path, shard_bytes: int = 2 << 30) -> Path:
    """A GraniteMoeShared checkpoint (f32 safetensors shards + config + tokenizer) from mfgguf's f32 granitemoe GGUF."""
    import gguf
    from safetensors.numpy import save_file

    r = gguf.GGUFReader(gguf_path)
    kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("tokenizer.ggml.")}
    a = kv["general.architecture"]
    assert a == "granitemoe", f"expected a granitemoe file, got {a}"
    t = {x.name: x.data for x in r.tensors}  # numpy order, memory-mapped
    L, H, KV = kv[f"{a}.block_count"], kv[f"{a}.attention.head_count"], kv[f"{a}.attention.head_count_kv"]
    dim, N = kv[f"{a}.embedding_length"], kv[f"{a}.expert_count"]
    ff, shff = kv[f"{a}.feed_forward_length"], kv[f"{a}.expert_shared_feed_forward_length"]
    # (HF name, GGUF tensors it is made of, how): "cat" joins gate and up rows (gate first, as JetMoe splits them)
    plan: list[tuple[str, list[str], str]] = [("model.embed_tokens.weight", ["token_embd.weight"], "")]
    for l in range(L):
        b, h = f"blk.{l}.", f"model.layers.{l}."
        plan += [
            (h + "input_layernorm.weight", [b + "attn_norm.weight"], ""),
            (h + "self_attn.q_proj.weight", [b + "attn_q.weight"], "q"),
            (h + "self_attn.k_proj.weight", [b + "attn_k.weight"], "k"),
            (h + "self_attn.v_proj.weight", [b + "attn_v.weight"], ""),
            (h + "self_attn.o_proj.weight", [b + "attn_output.weight"], ""),
            (h + "post_attention_layernorm.weight", [b + "ffn_norm.weight"], ""),
            (h + "block_sparse_moe.router.layer.weight", [b + "ffn_gate_inp.weight"], ""),
            (h + "block_sparse_moe.input_linear.weight", [b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"], "cat"),
            (h + "block_sparse_moe.output_linear.weight", [b + "ffn_down_exps.weight"], ""),
            (h + "shared_mlp.input_linear.weight", [b + "ffn_gate_shexp.weight", b + "ffn_up_shexp.weight"], "cat"),
            (h + "shared_mlp.output_linear.weight", [b + "ffn_down_shexp.weight"], ""),
        ]
    plan += [("model.norm.weight", ["output_norm.weight"], ""), ("lm_head.weight", ["output.weight"], "")]

    def build(parts: list[str], how: str) -> np.ndarray:
        x = [np.asarray(t[p]) for p in parts]
        if how == "cat":  # (N, ff, dim) x2 -> (N, 2 ff, dim); (ff, dim) x2 -> (2 ff, dim)
            return np.concatenate(x, axis=-2)
        return _unpermute(x[0], H if how == "q" else KV) if how else x[0]

    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, list[str], str]]] = [[]]
    size = 0
    for item in plan:  # one shard's arrays in memory at a time
        nbytes = sum(t[p].nbytes for p in item[1])
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: np.ascontiguousarray(build(parts, how), dtype=np.float32) for n, parts, how in shard},
                  str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n, _, _ in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    cfg = {
        "architectures": ["GraniteMoeSharedForCausalLM"], "model_type": "granitemoeshared",
        "hidden_size": dim, "intermediate_size": ff, "shared_intermediate_size": shff, "num_hidden_layers": L,
        "num_attention_heads": H, "num_key_value_heads": KV, "num_local_experts": N,
        "num_experts_per_tok": kv[f"{a}.expert_used_count"], "rms_norm_eps": kv[f"{a}.attention.layer_norm_rms_epsilon"],
        "rope_theta": kv[f"{a}.rope.freq_base"], "max_position_embeddings": kv[f"{a}.context_length"],
        "vocab_size": kv[f"{a}.vocab_size"], "tie_word_embeddings": False, "torch_dtype": "float32",
        "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
        "attention_multiplier": float(dim // H) ** -0.5, "hidden_act": "silu",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
        "add_prefix_space": False}))
    return out


def convert_code(conv: Path, hf: Path, out: Path, outtype: str) -> str:
    """Python source that runs convert_hf_to_gguf.py HF --outfile OUT --outtype OUTTYPE (in a child process)."""
    return f"""
import runpy, sys
sys.path.insert(0, {str(conv)!r}); sys.path.insert(1, {str(conv / 'gguf-py')!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # our BPE: not in its hash table
sys.argv = ["convert_hf_to_gguf.py", {str(hf)!r}, "--outfile", {str(out)!r}, "--outtype", {outtype!r}]
runpy.run_path({str(conv / 'convert_hf_to_gguf.py')!r}, run_name="__main__")
print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])
"""


def quantize_code(inp: Path, out: Path, ftype: int, threads: int) -> str:
    """Python source that runs llama.cpp's quantizer (llama_model_quantize, as llama-quantize does) INP -> OUT."""
    return f"""
import ctypes, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = {ftype}
p.nthread = {threads}
rc = llama_cpp.llama_model_quantize({str(inp).encode()!r}, {str(out).encode()!r}, ctypes.byref(p))
assert rc == 0, rc
print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])
"""
