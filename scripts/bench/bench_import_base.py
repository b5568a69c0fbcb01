"""Peak RSS of `mfgguf import-base` on a Hugging Face checkpoint far larger than any one tensor.

Writes a random LlamaForCausalLM-shaped checkpoint (f32 safetensors in two shards, written one
tensor at a time with numpy: no transformers needed) with a byte-level BPE tokenizer, then runs
`mfgguf import-base` on it in a child process and reports the child's peak RSS (VmHWM) next to
the largest tensor, the checkpoint's size, and the RSS of a child that only imports the importer.

    python scripts/bench/bench_import_base.py --dim 1024 --layers 8 --ff 4096 --vocab 32000 --out /tmp/bench-base
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

HWM = "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], rng) -> None:
    """A safetensors file of random f32 tensors, one tensor in memory at a time."""
    header, off = {}, 0
    for k, s in shapes.items():
        n = 4 * int(np.prod(s))
        header[k] = {"dtype": "F32", "shape": list(s), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for s in shapes.values():
            f.write((rng.standard_normal(s, dtype=np.float32) * 0.02).tobytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ff", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    from mfgguf.data.tokenizer import train_tokenizer

    hf = a.out / "hf"
    shutil.rmtree(a.out, ignore_errors=True)
    hf.mkdir(parents=True)
    import pydoc_data.topics as t

    train_tokenizer(list(t.topics.values()), 1000).save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))
    C, hd = a.dim, a.dim // a.heads
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": C, "intermediate_size": a.ff,
        "num_hidden_layers": a.layers, "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
        "vocab_size": a.vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 0}))
    shapes = [{"model.embed_tokens.weight": (a.vocab, C)}, {"lm_head.weight": (a.vocab, C), "model.norm.weight": (C,)}]
    for l in range(a.layers):
        p = f"model.layers.{l}."
        shapes[l * 2 // a.layers].update({
            p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
            p + "self_attn.q_proj.weight": (a.heads * hd, C), p + "self_attn.k_proj.weight": (a.kv_heads * hd, C),
            p + "self_attn.v_proj.weight": (a.kv_heads * hd, C), p + "self_attn.o_proj.weight": (C, a.heads * hd),
            p + "mlp.gate_proj.weight": (a.ff, C), p + "mlp.up_proj.weight": (a.ff, C), p + "mlp.down_proj.weight": (C, a.ff)})
    rng = np.random.default_rng(0)
    wmap = {}
    for i, sh in enumerate(shapes, 1):
        name = f"model-{i:05d}-of-{len(shapes):05d}.safetensors"
        write_safetensors(hf / name, sh, rng)
        wmap.update({k: name for k in sh})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    largest = max(4 * int(np.prod(s)) for sh in shapes for s in sh.values())
    total = sum((hf / n).stat().st_size for n in set(wmap.values()))
    base = subprocess.run([sys.executable, "-c", f"import mfgguf.base.importer, mfgguf.cli.base\n{HWM}"],
                          capture_output=True, text=True, check=True).stdout.split()[-1]
    code = (f"from pathlib import Path\nfrom mfgguf.base.importer import import_base\n"
            f"m = import_base(Path({str(hf)!r}), Path({str(a.out / 'run')!r}))\nprint(m['import_seconds'])\n{HWM}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    print(json.dumps({"checkpoint_bytes": total, "largest_tensor_bytes": largest, "import_seconds": float(r[-2]),
                      "peak_rss_bytes": int(r[-1]) * 1024, "imports_only_rss_bytes": int(base) * 1024,
                      "trunk_bytes": (a.out / "run" / "modules" / "trunk.safetensors").stat().st_size}, indent=1))


if __name__ == "__main__":
    main()
