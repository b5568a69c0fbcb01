"""CLI verbs `demo` (the main job) and `eval` (the comparison report)."""

from __future__ import annotations

from pathlib import Path

import typer

from mfgguf.eval.baselines.sides import parse_baselines
from mfgguf.demo import DemoConfig, check_demo_dir, demo
from mfgguf.eval.evaluate import EvalConfig, evaluate
from mfgguf.cli.app import command
from mfgguf.cli.benchmark_options import Benchmarks, benchmark_options
from mfgguf.errors import MfggufError
from mfgguf.options import parse_floats


@command("demo", demo)
def demo_cmd(
    out: Path = typer.Option(Path("demo-run"), "--out", help="Directory for the run, the GGUFs and the summary."),
    preset: str = typer.Option(DemoConfig.preset, help="Model preset: tiny, small or 1b."),
    experts: int = typer.Option(DemoConfig.experts, help="Number of expert modules."),
    trunk_tokens: int = typer.Option(None, help="Trunk training tokens (default: the preset's)."),
    expert_tokens: int = typer.Option(None, help="Training tokens per expert (default: the preset's)."),
    token_frac: float = typer.Option(DemoConfig.token_frac, "--token-frac", help="Share of the preset's training"
                                     " tokens when --trunk-tokens/--expert-tokens are not given (1 = the preset's)."),
    eval_tokens: int = typer.Option(DemoConfig.eval_tokens, "--eval-tokens", help="At most this many held-out tokens"
                                    " per domain scored by training (router statistics use 4x of the shard)."),
    max_chars_per_domain: int = typer.Option(DemoConfig.max_chars_per_domain, help="Cap on each built-in domain's text."),
    seed_expert: bool = typer.Option(DemoConfig.seed_expert, "--seed-expert/--no-seed-expert",
                                     help="Train the trunk with a seed FFN the experts start from."),
    shared: str = typer.Option(DemoConfig.shared, "--shared", help="Trunk tensors each expert also trains a private"
                               " copy of, merged by `mfgguf sync`: none, norms, attn or all."),
    shared_lr_scale: float = typer.Option(DemoConfig.shared_lr_scale, "--shared-lr-scale",
                                          help="Peak LR of the shared copies = the expert LR x this."),
    rounds: int = typer.Option(DemoConfig.rounds, "--rounds", help="Sync rounds (with --shared)."),
    minutes: float = typer.Option(DemoConfig.minutes, "--minutes", help="Wall-clock budget: the training tokens are"
                                  " scaled down to fit it from the speed measured on this CPU first; 0 = no budget."),
):
    check_demo_dir(out)
    demo(out, DemoConfig(preset=preset, experts=experts, trunk_tokens=trunk_tokens, expert_tokens=expert_tokens,
                         max_chars_per_domain=max_chars_per_domain, shared=shared, shared_lr_scale=shared_lr_scale,
                         rounds=rounds, seed_expert=seed_expert, token_frac=token_frac, eval_tokens=eval_tokens, minutes=minutes))


@command("eval", evaluate)
@benchmark_options({"hellaswag": "default 2,000, or every task of a smaller file", "winogrande": "default all",
                    "multiple-choice": "default all"},
                   ": every final model (the base, the MoEs test scores, every baseline) scored on the same tasks, each"
                   " against the base, paired over them")
def eval_cmd(
    run: Path = typer.Argument(..., help="The RUN directory (trunk and all experts trained; on an imported base, the"
                               " experts trained so far)."),
    out: Path = typer.Option(None, "--out", help="Report directory (default: RUN/eval)."),
    routers: str = typer.Option(",".join(EvalConfig.routers), help="Router methods to compare, comma-separated."),
    top_k: str = typer.Option(",".join(map(str, EvalConfig.top_ks)), "--top-k", help="Top-k values to compare."),
    seed_gates: str = typer.Option("", "--seed-gates", help="Also the ridge MoE with the base's own FFN routable"
                                   " (`assemble --seed-gate C`) at each C given, comma-separated, e.g. 0.4,0.5,0.6;"
                                   " compared like every MoE, the best on validation is the MoE."),
    baselines: str = typer.Option("auto", "--baselines", help="Dense baselines to train, comma-separated: flop"
                                  " (FLOP-matched), wallclock (critical-path FLOPs), total (the MoE's total"
                                  " parameters, FLOP-matched); auto = flop,wallclock (+ total while the MoE's"
                                  " FFN width is at most 4x the anchor's); none. On an imported base they are the"
                                  " base trained further on the experts' data instead: flop and wallclock"
                                  " (continued pretraining), lora (one peft LoRA on every trained domain,"
                                  " FLOP-matched), lora-domain (a LoRA per expert's shard for that expert's FLOPs,"
                                  " served as llama.cpp adapters: each domain through its own, and a stream of"
                                  " documents whose domain is unknown, each through the one its opening picks);"
                                  " auto = all four."),
    no_dense: bool = typer.Option(False, "--no-dense", help="Train no dense baseline (same as --baselines none)."),
    dense_schedules: str = typer.Option(",".join(EvalConfig.dense_schedules), "--dense-schedules",
                                        help="LR schedules each dense baseline trains with, comma-separated (cosine,"
                                        " wsd); the better held-out loss is kept and the report says which. One"
                                        " schedule halves the dense training time."),
    quants: str = typer.Option(",".join(EvalConfig.quants), "--quants", help="Quantized copies of the best MoE compared"
                               " with the base type, comma-separated (empty: none)."),
    max_tokens: int = typer.Option(EvalConfig.max_tokens_per_domain, help="Held-out tokens scored per domain."),
    ctx: int = typer.Option(None, help="Perplexity window (default 1024, or the model's context where shorter)."),
    force: bool = typer.Option(False, "--force", help="Rebuild every model and retrain the dense baselines."),
    full_lrs: str = typer.Option("", "--full-lrs", help="An imported base's continued-pretraining LR grid,"
                                 " comma-separated (default 1e-4,3e-4,1e-3); one value trains that LR alone, as"
                                 " when a later seed reuses what an earlier one chose on validation."),
    lora_lrs: str = typer.Option("", "--lora-lrs", help="An imported base's LoRA LR grid, comma-separated (default"
                                 " 1e-3,3e-3,1e-2)."),
    seed: int = typer.Option(None, "--seed", help="Seed of every baseline's training (its data order; a LoRA's or a"
                             " dense model's initialisation); a baseline trained with another is trained again."
                             " Default: the trunk's seed (from scratch), train-base's default (an imported base)."
                             " The experts' seed is train-expert's --seed."),
    questions: bool = typer.Option(True, "--questions/--no-questions", help="Score every final model on the RUN's"
                                   " closed-book questions too (RUN/questions/, made by `mfgguf questions`), where"
                                   " there are any."),
    budget_flops: str = typer.Option("", "--budget-flops", help="SHARD:FLOPS,... (e.g. 4:2e14,5:2e14): on an imported"
                                     " base, train and score only the --baselines (flop, lora, lora-domain) at these"
                                     " training FLOPs, each shard's as if an expert had spent them on it, no expert"
                                     " trained: no MoE is assembled, nor the base scored; each benchmark task's"
                                     " verdict is kept in report.json to pair with another eval's models."),
    benchmarks: Benchmarks = Benchmarks(),
):
    cfg = EvalConfig(routers=tuple(r for r in routers.split(",") if r), top_ks=tuple(int(k) for k in top_k.split(",")),
                     seed_gates=parse_floats(seed_gates, "--seed-gates"),
                     quants=tuple(q for q in quants.split(",") if q), dense=not no_dense,
                     baselines=parse_baselines(baselines), max_tokens_per_domain=max_tokens, ctx=ctx,
                     dense_schedules=tuple(s.strip() for s in dense_schedules.split(",") if s.strip()), seed=seed,
                     baseline_lrs=_grid(full=parse_floats(full_lrs, "--full-lrs"),
                                        lora=parse_floats(lora_lrs, "--lora-lrs")),
                     benchmarks={k: str(v) for k, v in benchmarks.files.items()} or None,
                     benchmark_tasks=benchmarks.tasks or None, questions=questions,
                     budget_flops=_budget(budget_flops))
    if cfg.budget_flops:
        from mfgguf.eval.baselines.budgeted import evaluate_baselines

        r = evaluate_baselines(run, out, cfg, force=force)
        typer.echo(f"report: {Path(out) if out else Path(run) / 'eval'}/report.json (the baselines alone)")
        return r
    r = evaluate(run, out, cfg, force=force)
    out = Path(out) if out else Path(run) / "eval"
    from rich.console import Console
    from rich.markdown import Markdown

    Console().print(Markdown((out / "report.md").read_text().split("## Routing")[0]))
    typer.echo(f"report: {out / 'report.md'} (raw figures: report.json; plots: *.png)")
    return r


def _grid(**lrs: tuple[float, ...]) -> dict[str, tuple[float, ...]] | None:
    """The LR grids given (a mode left empty keeps eval's default); a rate that cannot train is refused here."""
    bad = next((f"--{mode}-lrs {lr:g}" for mode, v in lrs.items() for lr in v if not 0 < lr < 1), None)
    if bad:
        raise MfggufError(f"{bad} is not a learning rate; give peak LRs between 0 and 1, e.g. 1e-4,3e-4")
    return {mode: v for mode, v in lrs.items() if v} or None


def _budget(text: str) -> dict[int, float] | None:
    """--budget-flops SHARD:FLOPS,... as {shard: FLOPs}; None where empty; anything else refused in one line."""
    out = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        shard, _, flops = item.partition(":")
        try:
            out[int(shard)] = float(flops)
        except ValueError:
            raise MfggufError(f"--budget-flops {item!r}: give SHARD:FLOPS pairs, e.g. 4:2e14,5:2e14") from None
        if out[int(shard)] <= 0:
            raise MfggufError(f"--budget-flops {item!r}: a budget is a positive number of FLOPs")
    return out or None
