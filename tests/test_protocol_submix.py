"""scripts/studies/protocol_submix.py: protocol studies read on a common mix of domains.

No study is trained: two synthetic sources, a four-domain study.jsonl (no reports beside it) and a two-domain study
directory whose run has an eval report with per-document figures, put on the man + python axis.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts" / "studies"), str(ROOT / "scripts" / "bench")]

import protocol_submix as sm  # noqa: E402

DOMS4, DOMS2 = ["c", "cpp", "man", "python"], ["man", "python"]
# method -> per-domain test perplexity; the MoE behind on c and cpp, ahead on man and python
PPL = {"moe top-1": {"c": 2.6, "cpp": 2.1, "man": 4.4, "python": 4.8, "english": 12.0},
       "flop": {"c": 2.5, "cpp": 2.0, "man": 4.6, "python": 5.0, "english": 12.5},
       "base": {"c": 3.5, "cpp": 3.8, "man": 10.0, "python": 6.0, "english": 13.4}}


def row(tokens: int, seed: int, domains: list[str], scale: float = 1.0) -> dict:
    methods = {m: {"label": m, "ppl_trained": 0.0, "ppl_held_out": p["english"], "flops": 4 * tokens * 7e8 * (m != "base"),
                   "wall_s": 1.0, "domains": {d: v * (scale if m == "moe top-1" else 1) for d, v in p.items()}}
               for m, p in PPL.items()}
    return {"tokens_per_domain": tokens, "seed": seed, "run": f"t{tokens}-s{seed}", "trained_domains": domains,
            "held_out": "english", "moe_chosen": "moe top-1", "moe_chosen_top1": "moe top-1", "methods": methods,
            "goals": {}, "test_split_sha256": "ab" * 32, "recipe": {}, "machines": []}


def geo(vals: list[float]) -> float:
    return math.exp(sum(map(math.log, vals)) / len(vals))


@pytest.fixture
def sources(tmp_path) -> tuple[Path, Path]:
    four = tmp_path / "study4.jsonl"
    four.write_text("".join(json.dumps(row(65536, s, DOMS4, 1 + 0.01 * s)) + "\n" for s in (1, 2)))
    two = tmp_path / "study2"
    run = two / "t1048576-s1"
    (run / "eval").mkdir(parents=True)
    (two / "study.jsonl").write_text(json.dumps(row(1048576, 1, DOMS2, 0.9)) + "\n")
    # the report: man scored on three times python's tokens, each domain's documents kept
    n = {"man": 300, "python": 100}

    def doms(m: str) -> dict:
        out = {}
        for d in DOMS2:
            p = PPL[m][d] * (0.9 if m == "moe top-1" else 1)
            docs = [[math.log(p) * n[d] / 4, n[d] / 4] for _ in range(4)]
            out[d] = {"ppl": p, "nll": math.log(p), "n_tokens": n[d], "documents": docs}
        return out

    rep = {"best": "moe top-1", "results": {m: {"domains": doms(m)} for m in PPL}}
    (run / "eval" / "report.json").write_text(json.dumps(rep))
    return four, two


def test_each_row_on_the_common_mix_weighted_by_its_reports_tokens(sources, tmp_path):
    four, two = sources
    sm.main(["--studies", str(four), str(two), "--domains", "man,python", "--out", str(tmp_path / "out")])
    out = json.loads((tmp_path / "out" / "submix.json").read_text())
    r65, r1m = out["sizes"]["65536"], out["sizes"]["1048576"]
    # no report beside study4.jsonl: equal weights, the mean over its two seeds of the MoE's ratio
    want = sum(geo([PPL["moe top-1"][d] * (1 + 0.01 * s) for d in DOMS2]) for s in (1, 2)) / 2 / geo([4.6, 5.0])
    assert r65["ratios_top1"]["flop"] == pytest.approx(want)
    assert r65["verdicts_top1"]["flop"] == "ahead"  # 0.973 of it: further below than the MoE seeds' range (0.01 of it)
    # the report's tokens weigh man three times python: (3 ln 0.9*4.4 + ln 0.9*4.8) / 4 against flop's
    moe = math.exp((3 * math.log(0.9 * 4.4) + math.log(0.9 * 4.8)) / 4)
    flop = math.exp((3 * math.log(4.6) + math.log(5.0)) / 4)
    assert r1m["ratios_top1"]["flop"] == pytest.approx(moe / flop)
    assert r1m["study"] == "study2" and out["domains"] == DOMS2
    md = (tmp_path / "out" / "submix.md").read_text()
    assert "## 65,536 tokens a domain: study4, 4 domains trained (c, cpp, man, python), seeds 1, 2" in md
    assert "## 1,048,576 tokens a domain: study2, 2 domains trained (man, python), seeds 1" in md
    line = next(l for l in md.split("## 1,048,576")[1].splitlines() if l.startswith("| continued pretraining, FLOP"))
    assert "| one seed |" in line and "-" in line.split("|")[9]  # the document interval of the run with a report
    assert (tmp_path / "out" / "submix.png").stat().st_size > 0


def test_a_row_that_did_not_train_the_mix_is_left_out(sources, tmp_path):
    four, two = sources
    sm.main(["--studies", str(four), str(two), "--domains", "c,man", "--out", str(tmp_path / "out")])
    assert list(json.loads((tmp_path / "out" / "submix.json").read_text())["sizes"]) == ["65536"]


def test_one_size_from_two_sources_is_refused(sources, tmp_path):
    four, _ = sources
    other = tmp_path / "again.jsonl"
    other.write_text(four.read_text())
    with pytest.raises(SystemExit, match="both ran 65,536 tokens a domain"):
        sm.main(["--studies", str(four), str(other), "--domains", "man,python", "--out", str(tmp_path / "out")])
