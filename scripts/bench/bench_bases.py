"""The expert step at the published shapes of the bases people have, against what they run instead, in one run.

For each family (random weights at the published configuration, built here by transformers' own class:
Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B with its llama3 rope scaling), the directory goes through the
user's path (`mfgguf import-base DIR`, `mfgguf prepare builtin`), then each configuration runs its
timed steps in its own process (its own peak RSS), at the same batch, context and precision (bf16
autocast where the CPU has it natively):

  - `expert`: mfgguf's expert step as `train-expert` runs it (scripts/bench/bench_train_real.py's, on the
    imported base: its activation plan, micro-batches or recompute);
  - `full`, `full-micro2`, `full-ckpt`: transformers' full fine-tune (AdamW on every parameter): the
    whole batch, micro-batches of 2, gradient checkpointing;
  - `lora-bf16`, `lora-bf16-micro2`: peft LoRA rank 16 on every linear, its frozen base in bf16 as a
    practitioner loads it.

A configuration whose estimated memory passes `--max-gb` is not run and says so (that is a result: it
does not fit this machine). The tokenizer is one trained here on local text (a few thousand tokens;
the embedding keeps the published row count, so the head's cost is the real one).

Prints JSON lines: the CPU, then per family and configuration tokens/s and peak RSS, then the expert
step's ratio to the fastest full fine-tune and the fastest LoRA that ran.

    python scripts/bench/bench_bases.py --families qwen2.5-0.5b              # ~25 minutes on 2 cores
    python scripts/bench/bench_bases.py --families qwen2.5-0.5b,qwen3-0.6b,llama-3.2-1b --steps 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192}
# the published configurations (config.json of each model), as plain data: (transformers class, config)
FAMILIES = {
    "qwen2.5-0.5b": ("Qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, vocab_size=151_936, rope_theta=1e6, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True, max_position_embeddings=32_768)),
    "qwen3-0.6b": ("Qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151_936, rope_theta=1e6, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True, max_position_embeddings=40_960)),
    "llama-3.2-1b": ("Llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=64, vocab_size=128_256, rope_theta=5e5,
                                   rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131_072,
                                   rope_scaling=LLAMA3_ROPE)),
}
CONFIGS = ("expert", "full", "full-micro2", "full-ckpt", "lora-bf16", "lora-bf16-micro2")
LEVERS = ("expert-micro1", "expert-micro2", "expert-recompute", "expert-unfused-head", "expert-micro2-unfused-head")
#          on request: the expert's activation plan forced; the head's loss as autograd makes it from whole logits
TOKENIZER_VOCAB = 4096


def hf_config(family: str):
    import transformers

    cls, kw = FAMILIES[family]
    return getattr(transformers, f"{cls}Config")(bos_token_id=0, eos_token_id=0, **kw)


def build(family: str, work: Path) -> tuple[Path, Path]:
    """(the HF directory, the imported and prepared RUN), made once under `work`."""
    from mfgguf.stages import run_stage

    hf, run = build_hf(family, work), work / family / "run"
    if not (run / "data" / "train.npy").is_file():
        run_stage("import-base", ["import-base", hf, "--out", run, "--force"])
        run_stage("prepare", ["prepare", "builtin", "--out", run, "--experts", 1, "--max-chars-per-domain", 400_000,
                              "--no-progress", "--force"])
    return hf, run


def build_hf(family: str, work: Path) -> Path:
    """The Hugging Face directory of `family` at its published configuration, random weights, made once under `work`."""
    import torch
    from transformers import AutoModelForCausalLM

    from mfgguf.data.study import study_texts
    from mfgguf.data.tokenizer import train_tokenizer

    hf = work / family / "hf"
    if not hf.is_dir():  # built beside, then renamed: a killed build leaves no directory that looks finished
        part = hf.with_name("hf.part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        texts = (t for _, t in itertools.islice(study_texts(), 400))
        train_tokenizer(texts, TOKENIZER_VOCAB).save(str(part / "tokenizer.json"))
        (part / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                "eos_token": "<|endoftext|>"}))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.bfloat16)  # bf16 on disk: half the bytes
        model.save_pretrained(part)
        del model
        part.rename(hf)
    return hf


def needs_gb(family: str, kind: str, batch: int, ctx: int) -> float:
    """A rough peak for a configuration: weights, gradients and AdamW moments of what trains, the bf16
    frozen weights, and the logits of one forward (f32, with their gradient) as transformers keeps them."""
    cfg = hf_config(family)
    params = cfg.vocab_size * cfg.hidden_size + cfg.num_hidden_layers * (
        3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size * cfg.hidden_size
        + 2 * cfg.hidden_size * cfg.num_key_value_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
    rows = (1 if kind.startswith("expert") else 2 if kind.endswith("micro2") else batch) * ctx  # the expert: its plan
    logits = 3 * rows * cfg.vocab_size * 4
    weights = {"full": 16 * params, "lora": 2 * params}.get(kind.split("-")[0], 4 * params)
    return (weights + logits) / 2**30 + 1.0


def run_child(family: str, kind: str, run: Path, hf: Path, a) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", f"{family}:{kind}", "--batch", str(a.batch), "--ctx",
                        str(a.ctx), "--steps", str(a.steps), "--warm", str(a.warm), "--work", str(a.work)],
                       capture_output=True, text=True)
    line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if r.returncode or not line.startswith("{"):
        return {"family": family, "config": kind, "error": (r.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return {"family": family, **json.loads(line)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"of {tuple(FAMILIES)}")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {CONFIGS + LEVERS}")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warm", type=int, default=1)
    ap.add_argument("--max-gb", type=float, default=20.0, help="skip a configuration estimated to need more")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-out" / "bases")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        from transformers import AutoConfig

        from bench_train_real import child

        family, kind = a.child.split(":")
        run, hf = a.work / family / "run", a.work / family / "hf"
        print(json.dumps(child(kind, run, a.batch, a.ctx, a.steps, a.warm, peer_config=AutoConfig.from_pretrained(hf))))
        return

    from bench_train import cpu_flags

    print(json.dumps({"bench": "bases", **cpu_flags(), "cores": os.cpu_count()}), flush=True)
    for family in a.families.split(","):
        if family not in FAMILIES:
            sys.exit(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
        t0 = time.perf_counter()
        hf, run = build(family, a.work)
        print(json.dumps({"family": family, "built_s": round(time.perf_counter() - t0, 1)}), flush=True)
        rows = []
        for kind in a.configs.split(","):
            gb = needs_gb(family, kind, a.batch, a.ctx)
            row = ({"family": family, "config": kind, "skipped": f"estimated {gb:.1f} GB, over --max-gb {a.max_gb:g}"}
                   if gb > a.max_gb else run_child(family, kind, run, hf, a))
            rows.append(row)
            print(json.dumps(row), flush=True)
        speed = {r["config"]: r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
        if "expert" in speed:
            for peer in ("full", "lora"):
                best = max((c for c in speed if c.startswith(peer)), key=speed.get, default=None)
                if best:
                    print(json.dumps({"family": family, "ratio": f"expert / fastest {peer} ({best})",
                                      "tokens_per_s": round(speed["expert"] / speed[best], 3)}), flush=True)


if __name__ == "__main__":
    main()
