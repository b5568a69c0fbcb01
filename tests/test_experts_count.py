"""scripts/studies/experts_count.py: its summary from study.jsonl rows.

No study is trained here: a synthetic study.jsonl of three N (the baselines trained in the first N's run only, a
second seed at N = 100, the per-document routing at N = 100 only) whose figures make each rule show: the baselines
are every N's reference, ratios are of seed means, a row that scored another test split or spent other FLOPs is
flagged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts" / "studies"), str(ROOT / "scripts" / "bench")]

import experts_count as ec  # noqa: E402

DOMAINS = ("c", "python")


def _m(ppl: float, **kw) -> dict:
    return {"ppl": ppl, "domains": {d: ppl + i / 10 for i, d in enumerate(DOMAINS)}, **kw}


def _row(n: int, seed: int, moe: float, *, baselines: bool = False, routed: bool = False, digest: str = "a",
         flops: float = 2.0e14) -> dict:
    methods = {"moe": _m(moe), "moe top-1": _m(moe), "moe top-2": _m(moe + 0.05), "base": _m(5.0),
               "oracle": {"ppl": moe - 0.1}}
    if baselines:
        methods |= {"flop": _m(4.0, flops=flops), "lora": _m(4.2, flops=flops)}
    if routed:
        methods |= {"cluster-routed": _m(moe - 0.4), "moe by document": _m(moe - 0.2)}
    return {"n": n, "seed": seed, "tokens": 409_600, "tokens_per_expert": 409_600 // n, "expert_ff": 192,
            "batch_size": 4, "expert_params": 9_953_280, "training_flops": flops, "methods": methods,
            "train_wall_s": 1000.0 + n, "critical_path_s": 10.0, "eval_wall_s": 100.0,
            "clusters": {"tokens_min": 10, "tokens_median": 20, "tokens_max": 30, "purity_mean": 0.9},
            "test_split_sha256": digest, "test_tokens": {d: 100 for d in DOMAINS},
            "machine": {"model": "CPU", "flags": ["avx2"], "cores": 2}}


ROWS = [_row(4, 1, 4.4, baselines=True), _row(16, 1, 4.1), _row(100, 1, 4.6, routed=True),
        _row(100, 2, 4.8, routed=True)]


def test_baselines_of_one_run_are_every_ns_reference():
    s = ec.summarize(ROWS)
    assert s["reference"]["flop"]["mean"] == 4.0 and s["reference"]["lora"]["mean"] == 4.2
    assert s["table"][100]["moe"] == {"mean": pytest.approx(4.7), "min": 4.6, "max": 4.8, "n": 2}
    assert s["one_test_split"] and s["flops_spread"] == 0
    md = ec.markdown(ROWS, s)
    line = next(x for x in md.splitlines() if x.startswith("| 100 |"))
    cells = [c.strip() for c in line.split("|")]
    assert cells[4] == "4.700 (4.600-4.800)"  # the seeds' mean and range
    # the ratio of seed means, then the range of the seeds' ratios (a seed without its own baseline: their mean)
    assert cells[8] == f"{4.7 / 5.0:.3f} ({4.6 / 5.0:.3f}-{4.8 / 5.0:.3f})"
    assert cells[9] == f"{4.7 / 4.0:.3f} ({4.6 / 4.0:.3f}-{4.8 / 4.0:.3f})"
    assert cells[10] == f"{4.7 / 4.2:.3f} ({4.6 / 4.2:.3f}-{4.8 / 4.2:.3f})"
    assert cells[11] == f"{4.5 / 4.3:.3f}"  # by document: the MoE over its cluster-routed oracle
    line16 = next(x for x in md.splitlines() if x.startswith("| 16 |"))
    assert line16.split("|")[11].strip() == ""  # no per-document routing at N = 16


def test_a_row_of_another_split_or_budget_is_flagged(tmp_path):
    rows = [*ROWS, _row(16, 2, 4.0, digest="b", flops=2.2e14)]
    s = ec.summarize(rows)
    assert not s["one_test_split"] and s["flops_spread"] == pytest.approx(0.1)
    assert "the same test split at every N: NO" in ec.markdown(rows, s)
    (tmp_path / "study.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ec.write_summary(tmp_path)
    assert (tmp_path / "study.md").is_file() and (tmp_path / "study.png").stat().st_size > 1000


def test_summary_of_nothing_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no finished run"):
        ec.write_summary(Path(tmp_path))


def test_a_later_seed_scored_moe_alone_joins_the_first_seeds_references(tmp_path):
    """--score moe: the row holds the MoE at the top-k validation chose; base and baselines come from the eval run."""
    got = tmp_path / "eval" / "measured"
    got.mkdir(parents=True)
    figures = lambda ppl: {"overall": {"ppl": ppl}, "domains": {d: {"ppl": ppl} for d in DOMAINS}}  # noqa: E731
    for k, valid, test in ((1, 4.9, 4.5), (2, 4.7, 4.3)):
        (got / f"top{k}.validation.json").write_text(json.dumps(figures(valid)))
    (got / "top2.test.json").write_text(json.dumps(figures(4.3)))
    (got / "chosen").write_text("2\n")
    methods = ec.measured_methods(tmp_path)
    assert methods["moe"]["ppl"] == 4.3 and methods["moe"]["label"] == "moe ridge top-2"
    assert "moe top-1" not in methods and methods["moe top-2"]["validation_ppl"] == 4.7
    later = {**_row(16, 2, 4.3), "methods": methods}
    rows = [later, *ROWS]
    s = ec.summarize(rows)
    assert s["table"][16]["moe"]["n"] == 2 and s["reference"]["base"]["n"] == 4
    line = next(x for x in ec.markdown(rows, s).splitlines() if x.startswith("| 16 |"))
    # MoE / continued, over both seeds; the later seed's MoE over the first seed's baseline
    assert line.split("|")[9].strip() == f"{(4.1 + 4.3) / 2 / 4.0:.3f} ({4.1 / 4.0:.3f}-{4.3 / 4.0:.3f})"


def test_baselines_with_seeds_of_their_own_pair_with_the_moe_of_their_seed():
    """A second seed's eval trained the baselines again: each seed's MoE is divided by its own seed's baseline, the
    references carry both seeds' range."""
    second = _row(16, 2, 4.3, baselines=True)
    second["methods"]["flop"] = _m(4.4, flops=2.0e14)
    rows = [*ROWS, second]
    s = ec.summarize(rows)
    assert s["reference"]["flop"] == {"mean": pytest.approx(4.2), "min": 4.0, "max": 4.4, "n": 2}
    assert s["paired"][16]["flop"] == {"mean": pytest.approx((4.1 / 4.0 + 4.3 / 4.4) / 2), "min": 4.3 / 4.4,
                                       "max": 4.1 / 4.0, "n": 2}
    md = ec.markdown(rows, s)
    line = next(x for x in md.splitlines() if x.startswith("| 16 |"))
    assert line.split("|")[9].strip() == f"{4.2 / 4.2:.3f} ({4.3 / 4.4:.3f}-{4.1 / 4.0:.3f})"
    assert "| continued pretraining, FLOP-matched | 4.200 (4.000-4.400) |" in md
