"""`mfgguf demo`: the whole pipeline on the built-in corpus, one command, resumable.

prepare -> train the trunk -> train each expert in its own process (its FFNs; with `--shared`,
also a private copy of trunk tensors, in `--rounds` rounds with a `sync` after each) -> assemble
q8_0 (and the trunk alone, for comparison) -> perplexity by llama.cpp -> a sample generation -> a summary
table of every stage (wall time, peak RSS, sizes, perplexities), saved as JSON and Markdown.

Each stage is a child process (`mfgguf.stages`), so its peak RSS is its own and each expert
really trains alone. Finished stages are skipped when the demo is re-run; an interrupted
training stage resumes from its checkpoint.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mfgguf.budget import MAX_FACTOR, plan_tokens
from mfgguf.config import DEFAULT_PRESET, get_preset
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, RunInfo, module_record, read_module, router_stats_current, write_json, write_text
from mfgguf.stages import StageResult, run_stage


@dataclass(frozen=True)
class DemoConfig:
    preset: str = DEFAULT_PRESET  # model shape and training lengths (see mfgguf.config.PRESETS)
    experts: int = 3  # one per built-in domain (python, english, c) with partition=label
    partition: str = "label"  # how documents are split into expert shards
    vocab_size: int = 4096  # BPE vocabulary
    max_chars_per_domain: int = 3_000_000  # caps the built-in corpus so the demo stays within 15 minutes
    trunk_tokens: int | None = None  # None: token_frac x the preset's
    expert_tokens: int | None = None  # per expert; None: token_frac x the preset's
    token_frac: float = 0.8  # share of the preset's training tokens (small: 1.2M trunk, 320k per expert): within 15 min
    eval_tokens: int = 16_384  # at most this many held-out tokens per domain scored by training (and 4x that of the
    #                            shard for router statistics; small's default is 65,536); llama.cpp's perplexity is separate
    seed_expert: bool = True  # the trunk also trains the seed FFN every expert starts from (BTX upcycling);
    #                           docs/results/README.md: 70.4 vs 95.2 mixed held-out perplexity with the settings below
    shared: str = "all"  # trunk tensors each expert also trains a private copy of (merged by `sync`);
    #                      all + 4 rounds measured best (docs/results/README.md: 95.2 vs 109.0 at R=1); none = FFN only
    shared_lr_scale: float = 1.0  # peak LR of the shared copies = the expert LR x this (0.1 is best at R=1)
    schedule: str = "wsd"  # LR schedule of trunk and experts: experts branch from the trunk's stable phase
    #                        (docs/regime.md: built-in corpus, R=4, 70.40 -> 60.88 mixed at top-1, against
    #                        dense baselines that also got their better schedule)
    rounds: int = 4  # sync rounds (R syncs, the last one final: router statistics on the merged trunk)
    quant: str = "q8_0"  # quantization of the assembled GGUF
    top_k: int = 2  # experts per token in the assembled GGUF: top-2 beat top-1 at every point of the regime
    #                 sweep and `mfgguf calibrate` chose it on the demo's model (docs/regime.md; 1 = the exact
    #                 function each expert trained, assemble's own default)
    minutes: float = 13.0  # wall-clock budget: trunk and expert tokens are scaled down (never up) to fit it, from
    #                        the training speed measured on this CPU first (budget.py); 0 = the tokens as asked
    prompt: str = "def main():"  # the sample generation's prompt


def demo(out: Path = Path("demo-run"), cfg: DemoConfig = DemoConfig(), *, sample_tokens: int = 64) -> dict:
    """Run the whole pipeline on the built-in corpus: prepare, train trunk and experts, assemble, evaluate.

    Re-running resumes: finished stages are skipped and a killed training stage continues from
    its last checkpoint. Ends with a summary table and the commands to chat with and evaluate
    the model.
    """
    t_start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run = RunDir(out / "run")
    moe = out / f"model-{cfg.quant}.gguf"
    trunk_gguf = out / f"trunk-{cfg.quant}.gguf"
    results: list[StageResult] = []

    def stage(name: str, done: bool, args: list[str], module: int | None = None) -> None:
        if done:
            results.append(StageResult(name, 0.0, 0.0, skipped=True))
            return
        _banner(name)
        results.append(run_stage(name, args)[0])
        if module is not None:  # a training stage: its steps' share of the wall, from the module it wrote
            results[-1].train_s = round(float(read_module(run, module).train_s or 0.0), 2)

    stage("prepare", run.run_json.is_file(), [
        "prepare", "builtin", "--out", run.root, "--experts", cfg.experts, "--partition", cfg.partition,
        "--vocab-size", cfg.vocab_size, "--max-chars-per-domain", cfg.max_chars_per_domain,
    ])
    n = run.run_info().n_experts
    p = get_preset(cfg.preset)
    eval_tokens = min(cfg.eval_tokens, p.trunk.eval_tokens)
    ev = ["--eval-tokens", eval_tokens]
    trunk_tokens = cfg.trunk_tokens or int(cfg.token_frac * p.trunk.tokens)
    expert_tokens = cfg.expert_tokens or int(cfg.token_frac * p.expert.tokens)
    plan = _fit_budget(out, run, cfg, results, trunk_tokens, expert_tokens, eval_tokens, time.perf_counter() - t_start)
    if plan:
        trunk_tokens, expert_tokens = plan["trunk_tokens"], plan["expert_tokens"]
    tok = ["--tokens", trunk_tokens, "--schedule", cfg.schedule, *ev]
    seed = ["--seed-expert"] if cfg.seed_expert else []
    stage("train-trunk", run.module_meta(0).is_file(), ["train-trunk", run.root, "--preset", cfg.preset, *tok, *seed], 0)
    if plan and "refit" not in plan and not results[-1].skipped and not run.module_meta(1).is_file():
        plan = _refit(out, run, cfg, plan, cfg.expert_tokens or int(cfg.token_frac * p.expert.tokens), eval_tokens,
                      time.perf_counter() - t_start)
        expert_tokens = plan["expert_tokens"]
    etok = ["--tokens", expert_tokens, "--schedule", cfg.schedule, *ev]
    shared = ["--shared", cfg.shared, "--shared-lr-scale", cfg.shared_lr_scale, "--rounds", cfg.rounds]
    for r in range(1, cfg.rounds + 1):
        for i in range(1, n + 1):
            name = f"train-expert {i}" + (f" round {r}" if cfg.rounds > 1 else "")
            stage(name, _round_of(run, i) >= r, ["train-expert", run.root, "--expert", i, *shared, *etok], i)
        if cfg.shared != "none":  # merge the copies; the last sync also recomputes router statistics
            stage(f"sync {r}", _round_of(run, 0) >= r, ["sync", run.root])
    stage("router-stats", router_stats_current(run), ["router-stats", run.root, "--no-progress"])  # the last sync did it
    stamp = run.manifest.stat().st_mtime
    fresh = lambda p: p.is_file() and p.stat().st_mtime >= stamp  # noqa: E731  (stale after retraining)
    stage("assemble", fresh(moe), ["assemble", run.root, "-o", moe, "--quant", cfg.quant, "--top-k",
                                   min(cfg.top_k, n), "--force"])
    stage("assemble trunk", fresh(trunk_gguf), ["assemble", run.root, "-o", trunk_gguf, "--quant", cfg.quant,
                                                 "--experts", "none", "--force"])

    ppl, sample = _measure(run, trunk_gguf, moe, cfg.prompt, sample_tokens, results)

    summary = {
        "config": asdict(cfg),
        "budget": plan,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "run": str(run.root),
        "stages": [r.to_dict() for r in results],
        "files": {p.name: p.stat().st_size for p in (moe, trunk_gguf)},
        "perplexity": ppl,
        "sample": {"prompt": cfg.prompt, "text": sample},
    }
    write_json(out / "summary.json", summary)
    write_text(out / "summary.md", summary_markdown(summary))
    _print_summary(summary, moe, run.root)
    return summary


def _measure(run: RunDir, trunk_gguf: Path, moe: Path, prompt: str, sample_tokens: int,
             results: list[StageResult]) -> tuple[dict, str]:
    """Both models' held-out perplexity (each a stage of its own) and a sample of the MoE's text."""
    ppl = {}
    for label, path in (("trunk alone", trunk_gguf), ("assembled MoE", moe)):
        _banner(f"perplexity: {label}")
        res, text = run_stage(f"perplexity {label}", ["perplexity", path, "--run", run.root, "--json"], capture=True)
        results.append(res)
        ppl[label] = json.loads(text)

    _banner("sample generation")
    from mfgguf.runtime.generate import generate

    t0 = time.perf_counter()
    sample = generate(moe, prompt, max_tokens=sample_tokens, temperature=0.7, seed=0)
    results.append(StageResult("generate", round(time.perf_counter() - t0, 2), float("nan")))
    return ppl, sample


def _fit_budget(out: Path, run: RunDir, cfg: DemoConfig, results: list, trunk_tokens: int, expert_tokens: int,
                eval_tokens: int, elapsed_s: float) -> dict | None:
    """The token counts that fit `cfg.minutes` on this CPU (budget.py), decided once, before the trunk
    trains, and kept in OUT/budget.json: a resumed demo trains what it planned."""
    saved = out / "budget.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    if not cfg.minutes or run.module_meta(0).is_file():
        return None
    _banner("measure this CPU's training speed")
    info = run.run_info()
    res, text = run_stage("measure speed", [sys.executable, "-m", "mfgguf.train.engine.speed", cfg.preset, "--vocab-size",
                                            str(info.vocab_size), *(["--seed-expert"] if cfg.seed_expert else [])],
                          capture=True)
    results.append(res)
    speed = json.loads(text)
    expert_tps = speed["tokens_per_s"] * _expert_over_trunk(cfg, info)
    rounds = cfg.rounds if cfg.shared != "none" else 1
    tp = plan_tokens(budget_s=60 * cfg.minutes, elapsed_s=elapsed_s + res.wall_s, trunk_tps=speed["tokens_per_s"],
                     expert_tps=expert_tps, trunk_tokens=trunk_tokens, expert_tokens=expert_tokens,
                     n_experts=info.n_experts, rounds=rounds, eval_tokens=eval_tokens,
                     n_domains=len(info.domains) or 1, syncs=rounds if cfg.shared != "none" else 0)
    plan = {**tp.to_dict(), "minutes": cfg.minutes, "precision": speed["precision"],
            "trunk_tokens_per_s": round(speed["tokens_per_s"], 1), "expert_tokens_per_s": round(expert_tps, 1)}
    from rich.console import Console

    Console(stderr=True).print(
        f"budget {cfg.minutes:g} min: this CPU trains {speed['tokens_per_s']:,.0f} trunk tokens/s ({speed['precision']});"
        f" training {tp.trunk_tokens:,} trunk tokens and {tp.expert_tokens:,} per expert ({tp.factor:.0%} of"
        f" {trunk_tokens:,} and {expert_tokens:,}), about {tp.predicted_s / 60:.1f} min in all", highlight=False)
    write_json(saved, plan)
    return plan


def _expert_over_trunk(cfg: DemoConfig, info: RunInfo) -> float:
    """An expert's tokens/s over the trunk's: its step costs what its FLOPs say against the trunk's (equal with
    --shared all)."""
    from dataclasses import replace

    from mfgguf.config import shared_tensor_names
    from mfgguf.flops import expert_step_flops, trunk_step_flops

    m = replace(get_preset(cfg.preset).model, vocab_size=int(info.vocab_size), seed_expert=cfg.seed_expert)
    return trunk_step_flops(m).total / expert_step_flops(m, shared_tensor_names(m, cfg.shared)).total


def _refit(out: Path, run: RunDir, cfg: DemoConfig, plan: dict, expert_tokens: int, eval_tokens: int,
           elapsed_s: float) -> dict:
    """The experts' tokens sized again once the trunk has trained: the budget left at the speed the trunk really
    trained at (budget.py `refit_experts`), kept in OUT/budget.json beside the first plan."""
    from mfgguf.budget import refit_experts

    trunk = read_module(run, 0)
    tps = float(trunk.tokens_seen) / max(float(trunk.train_s or 0.0), 1e-9)
    info = run.run_info()
    rounds = cfg.rounds if cfg.shared != "none" else 1
    tp = refit_experts(budget_s=60 * cfg.minutes, elapsed_s=elapsed_s, expert_tps=tps * _expert_over_trunk(cfg, info),
                       expert_tokens=expert_tokens, n_experts=info.n_experts, rounds=rounds,
                       eval_tokens=eval_tokens, n_domains=len(info.domains) or 1,
                       syncs=rounds if cfg.shared != "none" else 0)
    plan = {**plan, "expert_tokens": tp.expert_tokens, "predicted_s": tp.predicted_s,
            "refit": {"after_trunk_s": round(elapsed_s, 1), "trunk_tokens_per_s": round(tps, 1),
                      "expert_factor": tp.factor, "first_expert_tokens": plan["expert_tokens"],
                      "first_predicted_s": plan["predicted_s"]}}
    from rich.console import Console

    Console(stderr=True).print(
        f"budget {cfg.minutes:g} min: the trunk trained at {tps:,.0f} tokens/s in {elapsed_s / 60:.1f} min so far;"
        f" training {tp.expert_tokens:,} tokens per expert ({tp.factor:.0%} of {expert_tokens:,}), about"
        f" {tp.predicted_s / 60:.1f} min in all", highlight=False)
    write_json(out / "budget.json", plan)
    return plan


def _round_of(run: RunDir, i: int) -> int:
    """Rounds module i has finished (experts), or syncs the trunk has been through (i = 0); 0 if absent."""
    m = module_record(run, i)
    return 0 if m is None else m.syncs if i == 0 else m.round


def _banner(text: str) -> None:
    from rich.console import Console

    Console(stderr=True).rule(f"[bold]{text}")


def _overall(p: dict) -> float:
    return p["overall"]["ppl"]


def summary_markdown(s: dict) -> str:
    lines = ["| stage | wall (s) | of which training (s) | peak RSS (MB) |", "|---|---:|---:|---:|"]
    for r in s["stages"]:
        wall = "done earlier" if r["skipped"] else f"{r['wall_s']:.1f}"
        train = "" if r.get("train_s") is None else f"{r['train_s']:.1f}"
        rss = "" if r["skipped"] or r["peak_rss_mb"] != r["peak_rss_mb"] else f"{r['peak_rss_mb']:.0f}"
        lines.append(f"| {r['stage']} | {wall} | {train} | {rss} |")
    trained = [r for r in s["stages"] if r.get("train_s") is not None]
    if trained:
        w, t = sum(r["wall_s"] for r in trained), sum(r["train_s"] for r in trained)
        lines += ["", f"Training stages: {t:.0f} s of training steps in {w:.0f} s of wall ({t / w:.0%}); the rest is"
                      " process start, held-out scoring, router statistics and saving."]
    b = s.get("budget")
    if b:
        rf = b.get("refit") or {}
        again = (f"; after the trunk ({rf['trunk_tokens_per_s']:,.0f} tokens/s as it trained), {b['expert_tokens']:,}"
                 f" per expert ({rf['expert_factor']:.0%} of the default)") if rf else ""
        took = f", took {s['wall_s'] / 60:.1f} min ({s['wall_s'] / (60 * b['minutes']):.0%} of it)" if s.get("wall_s") else ""
        capped = (f" The budget holds more than the demo trains on this CPU: {MAX_FACTOR:g}x the default tokens at"
                  " most (about the built-in corpus once over), so it ends early."
                  ) if (rf.get("expert_factor") or b["factor"]) >= MAX_FACTOR else ""
        lines += ["", f"Budget {b['minutes']:g} min on this CPU ({b['precision']}, {b['trunk_tokens_per_s']:,.0f} trunk"
                      f" tokens/s measured first): {b['trunk_tokens']:,} trunk tokens"
                      f" ({b['factor']:.0%} of the default){again}; predicted {b['predicted_s'] / 60:.1f} min{took}."
                      + capped]
    lines += ["", "| file | size (MB) |", "|---|---:|"]
    lines += [f"| {k} | {v / 1e6:.1f} |" for k, v in s["files"].items()]
    ppl = s["perplexity"]
    domains = list(next(iter(ppl.values()))["domains"])
    lines += ["", "| held-out perplexity (llama.cpp) | " + " | ".join(domains) + " | mixed |",
              "|---|" + "---:|" * (len(domains) + 1)]
    for label, p in ppl.items():
        lines.append(f"| {label} | " + " | ".join(f"{p['domains'][d]['ppl']:.2f}" for d in domains)
                     + f" | {_overall(p):.2f} |")
    return "\n".join(lines) + "\n"


def _print_summary(s: dict, moe: Path, run: Path) -> None:
    from rich.console import Console
    from rich.markdown import Markdown

    c = Console()
    c.rule("[bold]mfgguf demo: summary")
    c.print(Markdown(summary_markdown(s)))
    c.print(f"\n[bold]sample[/] ({s['sample']['prompt']!r}):\n{s['sample']['prompt']}{s['sample']['text']}\n", highlight=False)
    c.print("[bold]next:[/]", highlight=False)
    c.print(f"  mfgguf chat {moe}", highlight=False)
    c.print(f"  mfgguf eval {run}", highlight=False)
    c.print(f"  mfgguf inspect {moe}", highlight=False)


def check_demo_dir(out: Path) -> None:
    """A demo directory holds our files or nothing: refuse to write into someone else's folder."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "run").exists() and not (out / "summary.json").exists():
        raise MfggufError(f"{out} exists and is not a demo directory; pass --out with a new or demo directory")
