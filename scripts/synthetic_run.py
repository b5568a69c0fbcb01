"""Build a RUN directory of random-weight modules of any preset shape, for benchmarks and converter tests.

Real pieces where they matter to the assembler: a real byte-level BPE tokenizer trained on text
that ships with Python (stdlib docs and sources), module files written by `mfgguf.run.write_module`
(so their format and manifest are the real ones), and router statistics that are valid moments
(a mean per layer and expert; the pooled second moment, modules/router_stats.safetensors, the mean
of a positive-definite uncentred moment per expert). Weights are Gaussian with std 1/sqrt(fan_in)
so activations and logits have order-one scale.

    python scripts/synthetic_run.py OUT --preset tiny --experts 3 [--vocab 512] [--seed 0] [--shared attn]

`--shared CHOICE` (config.SHARED_CHOICES) gives every expert what `train-expert --shared` writes:
a perturbed private copy of the chosen trunk tensors (`shared.<name>`, delta ~ 0.1 x the
tensor's std, different per expert), listed in its JSON as `shared_tensors`, and a distinct
`tokens_seen` (1000 x expert index) for the token-weighted merge.

Torch-free (numpy + safetensors + tokenizers). Used by tests/converters and scripts/bench/bench_assemble.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mfgguf.config import get_preset, shared_tensor_names  # noqa: E402
from mfgguf.run import (RUN_FORMAT, RUN_VERSION, SHARED_PREFIX, RunDir, write_json, write_module,  # noqa: E402
                        write_router_stats)


def corpus_text(max_chars: int = 3_000_000) -> list[str]:
    """Real English and code that every Python install carries: pydoc topics, then stdlib sources."""
    import pydoc_data.topics as topics

    texts = list(topics.topics.values())
    n = sum(map(len, texts))
    stdlib = Path(json.__file__).resolve().parents[1]
    for p in sorted(stdlib.glob("*.py")):
        if n >= max_chars:
            break
        t = p.read_text(encoding="utf-8", errors="replace")
        texts.append(t)
        n += len(t)
    return texts


def train_tokenizer(vocab: int, max_chars: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_text(max_chars), trainer)
    return tok


def _gauss(rng, shape, fan_in):
    return (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in)))


def _stats(rng, dim: int, rank: int = 32) -> tuple[np.ndarray, np.ndarray]:
    mu = rng.standard_normal(dim, dtype=np.float32) * 0.5  # (dim,)
    B = rng.standard_normal((dim, rank), dtype=np.float32) / np.float32(np.sqrt(rank))  # (dim, rank)
    M = np.outer(mu, mu) + B @ B.T + 0.1 * np.eye(dim, dtype=np.float32)  # (dim, dim) PSD
    return mu, M.astype(np.float32)


def build(out: Path, *, preset: str = "tiny", n_experts: int = 3, vocab: int | None = None, seed: int = 0,
          tokenizer: Path | None = None, max_chars: int = 3_000_000, stats_count: int = 10_000, shared: str = "none",
          **overrides) -> Path:
    """Write RUN `out` with a trunk and `n_experts` random experts (with `shared` copies); returns `out`.

    The router's pooled second moment is the mean of the experts' random ones (equal counts).
    """
    out = Path(out)
    rd = RunDir(out)
    rd.modules.mkdir(parents=True, exist_ok=True)
    p = get_preset(preset)
    if tokenizer is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer))
    else:
        tok = train_tokenizer(vocab or p.model.vocab_size, max_chars)
    tok.save(str(rd.tokenizer))
    cfg = replace(p.model, vocab_size=tok.get_vocab_size(), n_experts=n_experts, **overrides)
    write_json(rd.run_json, {"format": RUN_FORMAT, "version": RUN_VERSION, "n_experts": n_experts,
                             "partition": "synthetic", "domains": [f"d{i}" for i in range(1, n_experts + 1)],
                             "vocab_size": cfg.vocab_size})
    rng = np.random.default_rng(seed)
    C, hd = cfg.dim, cfg.head_dim
    t = {"token_embd.weight": rng.standard_normal((cfg.vocab_size, C), dtype=np.float32),
         "output_norm.weight": 1 + 0.1 * rng.standard_normal(C, dtype=np.float32),
         "output.weight": _gauss(rng, (cfg.vocab_size, C), C)}
    for l in range(cfg.n_layers):
        b = f"blk.{l}."
        t.update({
            b + "attn_norm.weight": 1 + 0.1 * rng.standard_normal(C, dtype=np.float32),
            b + "attn_q.weight": _gauss(rng, (cfg.n_heads * hd, C), C),
            b + "attn_k.weight": _gauss(rng, (cfg.n_kv_heads * hd, C), C),
            b + "attn_v.weight": _gauss(rng, (cfg.n_kv_heads * hd, C), C),
            b + "attn_output.weight": _gauss(rng, (C, cfg.n_heads * hd), cfg.n_heads * hd * cfg.n_layers),
            b + "ffn_norm.weight": 1 + 0.1 * rng.standard_normal(C, dtype=np.float32),
            b + "ffn_gate_shexp.weight": _gauss(rng, (cfg.anchor_ff, C), C),
            b + "ffn_up_shexp.weight": _gauss(rng, (cfg.anchor_ff, C), C),
            b + "ffn_down_shexp.weight": _gauss(rng, (C, cfg.anchor_ff), cfg.anchor_ff * cfg.n_layers),
        })
    trunk = write_module(rd, 0, t, {"kind": "trunk", "preset": preset, "config": cfg.to_dict(), "synthetic": True})
    names = shared_tensor_names(cfg, shared)
    src = {n: (t[n], float(t[n].std())) for n in names}  # the trunk tensors experts train copies of
    del t
    pooled = [np.zeros((C, C), np.float64) for _ in range(cfg.n_layers)]
    for i in range(1, n_experts + 1):
        e = {}
        for l in range(cfg.n_layers):
            b = f"blk.{l}."
            e[b + "ffn_gate.weight"] = _gauss(rng, (cfg.expert_ff, C), C)
            e[b + "ffn_up.weight"] = _gauss(rng, (cfg.expert_ff, C), C)
            e[b + "ffn_down.weight"] = _gauss(rng, (C, cfg.expert_ff), cfg.expert_ff * cfg.n_layers)
            mu, M = _stats(rng, C)
            e[f"router_stats.blk.{l}.mean"] = mu
            pooled[l] += M / n_experts
        for n, (w, sd) in src.items():  # (shape of the trunk tensor)
            e[SHARED_PREFIX + n] = w + np.float32(0.1 * sd) * rng.standard_normal(w.shape, dtype=np.float32)
        write_module(rd, i, e, {"kind": "expert", "preset": preset, "config": cfg.to_dict(), "shard": i,
                                "trunk_sha256": trunk["sha256"], "router_stats_count": stats_count, "synthetic": True,
                                "tokens_seen": 1000 * i, "shared_tensors": names})
        del e
    write_router_stats(rd, {f"router_stats.blk.{l}.second_moment": g.astype(np.float32) for l, g in enumerate(pooled)},
                       {"trunk_sha256": trunk["sha256"], "router_stats_count": stats_count * n_experts, "synthetic": True,
                        "source": "experts", "experts": {f"expert_{i:03d}": json.loads(rd.module_meta(i).read_text())["sha256"]
                                                         for i in range(1, n_experts + 1)}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--experts", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=None, help="BPE size (default: the preset's)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="reuse this tokenizer.json instead of training one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shared", default="none", help="experts hold perturbed copies of these trunk tensors: none|norms|attn|all")
    a = ap.parse_args()
    build(a.out, preset=a.preset, n_experts=a.experts, vocab=a.vocab, seed=a.seed, tokenizer=a.tokenizer, shared=a.shared)
    print(a.out)


if __name__ == "__main__":
    main()
