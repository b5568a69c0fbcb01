"""export-hf tests: tiny assembled MoEs of every layout, transformers' logits and llama.cpp's on the same file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.converters import text_sample

TOL = 1e-3  # max |difference| / max |logit|, the parity goal at f32


def max_rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def family_run(d: Path, tokenizer_json: Path, save_hf, n_experts: int = 3) -> Path:
    """An imported qwen2 / qwen3 base (`save_hf`: a random transformers model of that family), prepared with
    `n_experts` experts whose FFNs are random and distinct (so a wrong expert, weight or order shows)."""
    from mfgguf.run import RunDir, write_module
    from tests.base.test_import_base import cli

    hf, run = save_hf(d / "base-hf", tokenizer_json), d / "run"
    for args in (("import-base", hf, "--out", run, "--expert-ff", "32"),
                 ("prepare", "builtin", "--out", run, "--experts", n_experts, "--max-chars-per-domain", "20000",
                  "--no-progress")):
        r = cli(*args)
        assert r.exit_code == 0, r.output
    rd = RunDir(run)
    trunk = json.loads(rd.module_meta(0).read_text())
    cfg, rng = trunk["config"], np.random.default_rng(1)
    C, F = cfg["dim"], cfg["expert_ff"]
    for i in range(1, n_experts + 1):
        t = {}
        for l in range(cfg["n_layers"]):
            t[f"blk.{l}.ffn_gate.weight"] = rng.standard_normal((F, C), dtype=np.float32) / np.float32(np.sqrt(C))
            t[f"blk.{l}.ffn_up.weight"] = rng.standard_normal((F, C), dtype=np.float32) / np.float32(np.sqrt(C))
            t[f"blk.{l}.ffn_down.weight"] = rng.standard_normal((C, F), dtype=np.float32) / np.float32(np.sqrt(F))
        write_module(rd, i, t, {"kind": "expert", "config": cfg, "trunk_sha256": trunk["sha256"]})
    return run


def assembled(run: Path, out: Path, *flags: str) -> Path:
    """`mfgguf assemble RUN -o out --quant f32 flags...`, through the CLI."""
    from tests.base.test_import_base import cli

    r = cli("assemble", run, "-o", out, "--quant", "f32", "-q", *flags)
    assert r.exit_code == 0, r.output
    return out


def hf_ids(hf: Path, n: int) -> list[int]:
    """The exported tokenizer's ids of real prose, no special tokens."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf)(text_sample(), add_special_tokens=False)["input_ids"][:n]


def hf_logits(hf: Path, ids: list[int]) -> np.ndarray:
    """transformers' logits (T, V) of `ids`, the directory loaded as a user loads it, in f32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()
