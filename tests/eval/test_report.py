"""report.md from a report's figures: titled by the run's name, goals checked against the Goals passed in."""

from __future__ import annotations

import math

from mfgguf.eval.report import Goals, goals, report_markdown


def _report() -> dict:
    res = lambda ppl: {"domains": {"python": {"ppl": ppl}}, "overall": {"ppl": ppl}, "prompt_tps": 100.0,  # noqa: E731
                       "decode_tps": 10.0, "peak_rss_mb": 50.0}
    return {
        "run": "/some/machine/path/n4-r4", "domains": ["python"], "recipe": {"experts": 4},
        "config": {"base_quant": "f16", "max_tokens_per_domain": 2048},
        "results": {"moe ridge top-1": res(9.0), "trunk alone": res(10.0), "oracle python": res(8.9)},
        "oracle": {"experts": {"python": 1}, "mixed": {"ppl": 8.9}},
        "goals": {"moe_over_trunk_worst_domain": 0.9, "moe_over_flop_dense_mixed": 0.97,
                  "moe_over_wallclock_dense_mixed": 0.85, "best_router_vs_oracle": 9.0 / 8.9, "q8_0_over_f16": 1.001},
        "flops": {"rounds": 1, "models": {}, "total": 1.0, "critical_path": 0.5, "modules": {}, "formulas": {}},
        "best": "moe ridge top-1", "best_stats_router": "moe ridge top-1", "routing": {}, "wall_s": 3.0,
    }


def _met(md: str, goal: str) -> str:
    return next(line for line in md.splitlines() if line.startswith(f"| {goal}")).rsplit("|", 2)[-2].strip()


def test_title_names_the_run_not_the_path():
    md = report_markdown(_report())
    assert md.startswith("# mfgguf evaluation: n4-r4\n") and "/some/machine" not in md


def test_goals_come_from_the_configuration():
    md = report_markdown(_report())
    assert "0.9x the wall-clock-matched dense model" in md and "1.0x the FLOP-matched dense model" in md
    assert _met(md, "MoE at most 1.0x the FLOP") == "yes" and _met(md, "stretch: MoE at most 0.95x") == "no"
    assert _met(md, "best statistics-only router (moe ridge top-1) within 2%") == "yes"
    md = report_markdown(_report(), Goals(flop_dense=0.96, flop_dense_stretch=0.98, router_vs_oracle=1.005))
    assert _met(md, "MoE at most 0.96x the FLOP") == "no" and _met(md, "stretch: MoE at most 0.98x") == "yes"
    assert _met(md, "best statistics-only router (moe ridge top-1) within 0.5%") == "no"
    assert _met(md, "q8_0 within 0.5% of f16") == "yes"


def _stream(ppl: float, after: float, **extra) -> dict:
    fig = lambda p, n: {"ppl": p, "nll": math.log(p), "n_tokens": n}  # noqa: E731
    return {"overall": fig(ppl, 300), "after_choice": fig(after, 200), "choose_tokens": 128, "ctx": 1024,
            "domains": {"python": {**fig(ppl, 300), "documents": 3, "after_choice": fig(after, 200)}}, **extra}


def test_the_unknown_domain_stream_is_a_goal_on_the_tokens_after_the_choice():
    r = _report()
    st = {"lora": "loras", "moe": r["best"], "results": {
        "loras": _stream(10.0, 10.5, choice={"python": {"base": 1, "lora-shard1": 2}}, own_choice={"python": 2 / 3}),
        r["best"]: _stream(9.0, 9.5)}}
    quant = {"f16": r["results"][r["best"]]}
    g = goals(r["results"], r["best"], None, r["oracle"]["mixed"], quant, "f16", (), r["domains"], [], st)
    assert g["moe_over_lora-domain_stream_after_choice"] == 9.5 / 10.5
    assert g["moe_over_lora-domain_stream_whole_documents"] == 9.0 / 10.0
    r = {**r, "goals": g, "domain_stream": st}
    goal = "MoE at most 0.97x a LoRA per domain, domain unknown"
    assert _met(report_markdown(r), goal) == "yes"
    md = report_markdown(r, Goals(lora_domain_stream=0.9))
    assert _met(md, "MoE at most 0.9x a LoRA per domain, domain unknown") == "no"
    assert "| loras | 10.500 | 10.500 | 10.000 |" in md and "python 0.67" in md
    assert "domain unknown" not in report_markdown(_report())  # no per-domain LoRAs: neither row nor section


def test_test_scores_the_seed_gate_validation_chose_of_each_router_and_top_k():
    """Of each router and top-k only the gate (or none) of lowest validation perplexity is a final model: test never
    scores the others, and the report lists every candidate's validation figure and whether test saw it."""
    from mfgguf.eval.evaluate import finalists

    def moe(k: int, gate: float | None = None, router: str = "ridge") -> dict:
        return {"kind": "moe", "router": router, "top_k": k, **({} if gate is None else {"seed_gate": gate})}

    models = {"moe ridge top-1": moe(1), "moe ridge top-2": moe(2), "moe ridge seed-gate 0.4 top-1": moe(1, 0.4),
              "moe ridge seed-gate 0.4 top-2": moe(2, 0.4), "moe uniform top-1": moe(1, router="uniform")}
    val = dict(zip(models, (4.2, 4.18, 4.19, 4.17, 5.0)))
    validation = {k: {"overall": {"ppl": v}} for k, v in val.items()}
    assert finalists(models, validation) == {"moe ridge seed-gate 0.4 top-1", "moe ridge seed-gate 0.4 top-2",
                                             "moe uniform top-1"}
    r = {**_report(), "validation": {k: v["overall"] for k, v in validation.items()}}
    md = report_markdown(r)
    assert "| moe ridge seed-gate 0.4 top-2 | 4.1700 | no |" in md  # not in this report's results
    assert "| moe ridge top-1 | 4.2000 | best |" in md
    assert md.index("| moe ridge seed-gate 0.4 top-2 |") < md.index("| moe uniform top-1 | 5.0000 |")


def test_the_spread_over_test_documents_is_a_section_of_its_own():
    from mfgguf.eval.spread import ratio_spread

    doc = lambda sums: {"python": {"ppl": 0.0, "documents": [[s, 100] for s in sums]}}  # noqa: E731
    r = {**_report(), "test_spread": {"flop": ratio_spread(doc([210, 190, 230]), doc([200, 200, 220]), ["python"])}}
    md = report_markdown(r)
    s = r["test_spread"]["flop"]
    assert "## Spread over test documents" in md and "documents scored: python 3" in md
    assert f"| flop | {s['ratio']:.4f} | {s['low']:.4f}-{s['high']:.4f} |" in md
    assert "Spread over test documents" not in report_markdown(_report())  # measured before documents were kept
