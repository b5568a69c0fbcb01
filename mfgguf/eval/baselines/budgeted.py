"""`mfgguf eval RUN --budget-flops SHARD:FLOPS,...`: an imported base's baselines alone, at a FLOP budget given
rather than read from trained experts.

eval matches its baselines to the FLOPs the trained experts spent (eval/baselines/imported.py). A study that prices
each method in its own sitting knows those FLOPs before any expert trains (the shard's tokens x epochs x an expert
step's FLOPs a token, mfgguf/flops.py), so it gives them instead: each shard named stands for the expert that would
train on it (its domains, as run.json describes them; an expert's batch), carrying its FLOPs. The baselines asked
(flop, lora, lora-domain: the wall-clock-matched one needs the experts' walls) train exactly as eval trains them
against experts, then each is scored as eval scores its final models: test perplexity per domain and every
benchmark (the RUN's question sets, --hellaswag...), each task's verdict kept so another eval's models (the base,
the MoE) pair with them over the same tasks. No MoE is assembled, nor the base scored.

Example:
    >>> evaluate_baselines(run, None, EvalConfig(baselines=("flop",), budget_flops={4: 2e14, 5: 2e14}))
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from mfgguf.errors import MfggufError
from mfgguf.eval.evaluate import EvalConfig, Evaluation, baseline_models, check_windows, measure_model, train_baselines
from mfgguf.eval.general import check_benchmarks, score_general, with_questions
from mfgguf.run import ModuleMeta, RunDir, read_module, write_json

BUDGETED = ("flop", "lora", "lora-domain")  # the baselines a FLOP budget sets (wallclock reads the experts' walls)


def planned_metas(rd: RunDir, budget: dict[int, float]) -> dict[int, ModuleMeta]:
    """{0: the trunk's record, i: the record an expert on shard i would leave, as far as its baselines read it (its
    shard, domains, batch and `planned_flops`)}; budget: {shard: FLOPs}."""
    from mfgguf.options import TrainOptions
    from mfgguf.train.experts.config import expert_config

    trunk, info = read_module(rd, 0), rd.run_info()
    if trunk.source != "base":
        raise MfggufError(f"--budget-flops is for an imported base's baselines; {rd.root}'s trunk was trained here")
    bad = [i for i in budget if not 0 < i <= info.n_experts]
    if bad:
        raise MfggufError(f"--budget-flops names shard {bad[0]}; {rd.root} has shards 1 to {info.n_experts}")
    batch = expert_config(trunk, TrainOptions()).tc.batch_size
    return {0: trunk, **{i: ModuleMeta.from_json({
        "kind": "expert", "index": i, "shard": i, "shard_domains": info.shard_domains(i), "config": trunk.config,
        "train": {"batch_size": batch}, "tokens_seen": 0, "planned_flops": float(f)}) for i, f in sorted(budget.items())}}


def evaluate_baselines(run: Path, out: Path | None = None, cfg: EvalConfig = EvalConfig(), *,
                       force: bool = False) -> dict:
    """Train (or reuse) the baselines `cfg.baselines` at `cfg.budget_flops` and score them; writes OUT/report.json
    (default RUN/eval) and returns it: {"models", "results" (test split), "general", "flops", "base_baselines"...}."""
    budget, which = cfg.budget_flops or {}, cfg.baselines or ()
    if not budget or not which or any(k not in BUDGETED for k in which):
        raise MfggufError(f"--budget-flops trains {', '.join(BUDGETED)} (give them with --baselines) at the FLOPs it"
                          " gives a shard, e.g. --budget-flops 4:2e14,5:2e14")
    cfg = with_questions(cfg, Path(run))
    check_benchmarks(cfg.benchmarks, cfg.benchmark_tasks)
    rd = RunDir(run)
    metas = planned_metas(rd, budget)
    check_windows(rd, cfg.ctx, cfg.max_tokens_per_domain)
    out = Path(out) if out else rd.root / "eval"
    (out / "models").mkdir(parents=True, exist_ok=True)
    ev = Evaluation(rd, cfg, force, metas, sorted(budget), rd.test_tokens(cfg.max_tokens_per_domain), out)
    t0 = time.perf_counter()
    baselines = train_baselines(ev)
    models = baseline_models(ev, baselines)
    results = {k: measure_model(ev, m["path"], m.get("domains", ev.domains), adapters=m.get("adapters"))
               for k, m in models.items()}
    report = {"run": str(rd.root), "config": asdict(cfg), "domains": ev.domains,
              "models": {k: {**{kk: v for kk, v in m.items() if kk != "path"}, "file": m["path"].name}
                         for k, m in models.items()},
              "results": results, "budget_flops": {str(i): f for i, f in budget.items()},
              "flops": {"models": {t.label: t.flops for t in baselines.trained}}, **baselines.sections}
    if cfg.benchmarks:
        report["general"] = score_general(ev, models, set(), say=_say)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(out / "report.json", report)
    return report


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]eval[/] {msg}", highlight=False)


__all__ = ["BUDGETED", "evaluate_baselines", "planned_metas"]
