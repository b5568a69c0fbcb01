"""scripts/studies/experts_forgetting.py: which models it scores, and its table. No model is scored here (the scoring is
`mfgguf perplexity --data`, tested in tests/runtime); the study's folder is laid out as experts_count.py leaves it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts" / "studies"), str(ROOT / "scripts" / "bench")]

import experts_forgetting as ef  # noqa: E402


def _run(out: Path, n: int, seed: int, files: tuple[str, ...], *, report_k: int | None = None,
         chosen: int | None = None) -> dict:
    ev = out / f"n{n}-s{seed}" / "run" / "eval"
    (ev / "models").mkdir(parents=True)
    for f in files:
        (ev / "models" / f).write_bytes(b"")
    if report_k is not None:  # eval ran: its report names the best MoE
        (ev / "report.json").write_text(json.dumps({"best": "moe ridge top-x", "models": {
            "moe ridge top-x": {"top_k": report_k, "file": f"moe-ridge-top{report_k}-f16.gguf"}}}))
    if chosen is not None:  # --score moe: the MoE alone
        (ev / "measured").mkdir()
        (ev / "measured" / "chosen").write_text(f"{chosen}\n")
    methods = {"moe": {"ppl": 4.0}, "base": {"ppl": 5.0}}
    methods |= {m: {"ppl": 4.1} for m, f in ef.REFERENCES.items() if f in files and m != "base"}
    return {"n": n, "seed": seed, "methods": methods}


def test_each_runs_chosen_moe_and_each_seeds_references_once(tmp_path):
    refs = ("trunk-f16.gguf", "base-flop-f16.gguf", "base-lora-f16.gguf")
    rows = [_run(tmp_path, 4, 1, refs + ("moe-ridge-top1-f16.gguf",), report_k=1),
            _run(tmp_path, 16, 1, ("trunk-f16.gguf",), chosen=2),
            _run(tmp_path, 16, 2, refs, report_k=2)]
    got = [(m, s, n, p.name) for m, s, n, p in ef.models(tmp_path, rows)]
    assert got == [("moe", 1, 4, "moe-ridge-top1-f16.gguf"), ("base", 1, None, "trunk-f16.gguf"),
                   ("flop", 1, None, "base-flop-f16.gguf"), ("lora", 1, None, "base-lora-f16.gguf"),
                   ("moe", 1, 16, "moe-ridge-top2-f16.gguf"),
                   ("moe", 2, 16, "moe-ridge-top2-f16.gguf"),  # the base again: not scored twice
                   ("flop", 2, None, "base-flop-f16.gguf"), ("lora", 2, None, "base-lora-f16.gguf")]


def test_table_gives_seed_ranges_and_the_ratio_to_the_base(tmp_path):
    scored = [{"method": "base", "seed": 1, "n": None, "ppl": 10.0, "n_tokens": 4088},
              {"method": "flop", "seed": 1, "n": None, "ppl": 11.0, "n_tokens": 4088},
              {"method": "flop", "seed": 2, "n": None, "ppl": 13.0, "n_tokens": 4088},
              {"method": "moe", "seed": 1, "n": 16, "ppl": 10.5, "n_tokens": 4088}]
    ef.write_table(tmp_path, scored)
    md = (tmp_path / "forgetting.md").read_text()
    assert "| the base | 1 | 10.000 | 1.000 |" in md
    assert "| continued pretraining, FLOP-matched | 2 | 12.000 (11.000-13.000) | 1.200 |" in md
    assert "| MoE N=16 | 1 | 10.500 | 1.050 |" in md
