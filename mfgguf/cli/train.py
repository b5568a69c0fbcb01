"""CLI verbs `train-trunk`, `train-expert`, `train-experts`, `sync`, `restat` and `router-stats`.

Their training options (tokens, lr, --shared, ...) are TrainOptions' fields, one CLI option each
(cli/options.py), handed to the library as one `TrainOptions`.

torch is imported only when a verb runs: the help text is read from the library docstrings with
`ast`, so other verbs (assemble, chat) never pay for torch's import time and memory.
"""

from __future__ import annotations

import ast
from pathlib import Path

import typer

from mfgguf.config import DEFAULT_PRESET
from mfgguf.errors import MfggufError
from mfgguf.options import JobOptions, TrainOptions
from mfgguf.run.records import ModuleMeta
from mfgguf.cli.app import command
from mfgguf.cli.options import train_options

def _doc(module: str, fn: str) -> str:
    """The docstring of mfgguf.train.<module>.<fn> up to 'Example', without importing it."""
    src = (Path(__file__).parent.parent / "train" / f"{module.replace('.', '/')}.py").read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name == fn:
            doc = (ast.get_docstring(node) or "").split("\nExample")[0].strip()
            return "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))  # reflow paragraphs
    return ""


_RUN = typer.Argument(..., help="The RUN directory made by `mfgguf prepare`.")
_DEVICE = typer.Option("cpu", "--device", help="cpu or cuda.")
_PRECISION = typer.Option("auto", "--precision", help="auto (bf16 where native, else fp32), bf16 or fp32.")
_RESTART = typer.Option(False, "--restart", help="Delete this module's checkpoint and start over.")
_PROGRESS = typer.Option(True, "--progress/--no-progress", help="Show a progress bar.")


def _line(m: ModuleMeta, run: Path) -> str:
    held, extra = m.validation_loss, ""
    if m.kind == "expert":
        base = m.trunk_validation_loss
        own = [d for d in (m.shard_domains or []) if d in held and d in base]
        if own:
            extra = " | own domain " + ", ".join(f"{d} {base[d]:.3f}->{held[d]:.3f}" for d in own)
    score = (f"validation loss {m.validation_loss_mean:.3f} (mean of {len(held)} domains)" if held
             else "not scored (a round before the last)")
    epochs = f" ({m.epochs:g} epochs of its data)" if m.epochs else ""  # older modules lack it
    return (f"{m.name}: final loss {m.final_loss:.3f}, {score}{extra}, {m.tokens_seen:,} tokens{epochs},"
            f" {Path(run) / 'modules' / m.file}, {m.wall_s:.1f} s")


@command("train-trunk", help=_doc("whole.trunk", "train_trunk"))
@train_options("trunk")
def train_trunk_cmd(
    run: Path = _RUN,
    preset: str = typer.Option(DEFAULT_PRESET, "--preset", help="Model size: tiny, small or 1b."),
    device: str = _DEVICE, precision: str = _PRECISION, restart: bool = _RESTART, progress: bool = _PROGRESS,
    memory_budget: str = typer.Option(None, "--memory-budget", help="Train layer-streamed (weights and optimizer"
                                      " state on disk, one block in RAM) when the in-memory estimate exceeds this,"
                                      " like 1.5G (default: the RAM available)."),
    stream: bool = typer.Option(None, "--stream/--no-stream", help="Force layer-streamed or in-memory training"
                                " (default: chosen by --memory-budget)."),
    accum: int = typer.Option(None, "--accum", help="Sequences per step = --batch-size x this, micro-batched"
                              " (default: 4 when streamed, 1 in memory)."),
    *, options: TrainOptions,
):
    from mfgguf.train.whole.trunk import train_trunk

    meta = train_trunk(run, preset=preset, options=options, device=device, progress=progress, precision=precision,
                       restart=restart, memory_budget=memory_budget, stream=stream, accum=accum)
    typer.echo(_line(ModuleMeta.from_json(meta), run))


@command("train-expert", help=_doc("experts.expert", "train_expert"))
@train_options("expert")
def train_expert_cmd(
    run: Path = _RUN,
    expert: int = typer.Option(..., "--expert", help="Expert index, 1..N."),
    device: str = _DEVICE, precision: str = _PRECISION, restart: bool = _RESTART, progress: bool = _PROGRESS,
    *, options: TrainOptions,
):
    from mfgguf.train.experts.expert import train_expert

    meta = train_expert(run, expert, options=options, device=device, progress=progress, precision=precision,
                        restart=restart)
    m = ModuleMeta.from_json(meta)
    line = _line(m, run)
    if m.rounds > 1:
        line += f" (round {m.round} of {m.rounds})"
    typer.echo(line)


@command("train-base", help=_doc("whole.continued", "train_continued"))
def train_base_cmd(
    run: Path = typer.Argument(..., help="A RUN whose trunk is an imported base (`mfgguf import-base`)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory of the RUN written (its trunk is the trained base)."),
    mode: str = typer.Option("full", "--mode", help="full (every parameter) or lora (peft, every linear)."),
    tokens: int = typer.Option(..., "--tokens", help="Training tokens."),
    lr: float = typer.Option(..., "--lr", help="Peak learning rate."),
    shards: str = typer.Option(None, "--shards", help="Shards whose union it trains on, e.g. 1,2,4 (default: all)."),
    rank: int = typer.Option(16, "--rank", help="LoRA rank (alpha = 2 x rank)."),
    seed: int = typer.Option(None, "--seed", help="Data order and LoRA initialisation seed (default: the preset's"
                             " data order; the LoRA's initialisation as torch's generator stands)."),
    compile: str = typer.Option("off", "--compile", help="torch.compile the step: on, off, or auto (as train-expert)."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists (a checkpoint of this very training"
                               " there resumes, with or without it)."),
    device: str = _DEVICE, precision: str = _PRECISION, progress: bool = _PROGRESS,
):
    from mfgguf.options import parse_experts
    from mfgguf.run import RunDir
    from mfgguf.train.whole.continued import train_continued

    rd = RunDir(run)
    ids = parse_experts(shards) or list(range(1, rd.run_info().n_experts + 1))  # 1,2,4 or 1-3 (train_continued checks them)
    view = train_continued(rd, out, mode=mode, tokens=tokens, lr=lr, shards=ids, rank=rank, seed=seed, device=device,
                           precision=precision, compile=compile, progress=progress, force=force)
    from mfgguf.run import read_module

    typer.echo(_line(read_module(view, 0), view.root))  # the trained base's record is a trunk's, as the base's


@command("train-experts", help=_doc("fanout.schedule", "train_experts"))
@train_options("expert", help={"rounds": "Sync rounds R: every expert's round, then `sync`, R times (default: what"
                                         " the run's experts were started with, else 1)."})
def train_experts_cmd(
    run: Path = _RUN,
    experts: str = typer.Option(None, "--experts", help="Which experts, e.g. 1-40,45 (default: all)."),
    workers: int = typer.Option(None, "--workers", help="Local jobs at once (default: as many as cores and memory"
                                " allow)."),
    ray: str = typer.Option(None, "--ray", help="Run one Ray task per expert on this cluster: auto (the one"
                            " `ray start` made), local (start one here) or an address. Needs the ray extra."),
    transfer: str = typer.Option("auto", "--transfer", help="Ray: how workers get the trunk and shards: auto, shared"
                                 " (RUN on a shared filesystem) or copy (through Ray's object store)."),
    retries: int = typer.Option(2, "--retries", help="Times a job killed from outside is started again."),
    in_process: bool = typer.Option(None, "--in-process/--processes", help="Run the local jobs in this process, one"
                                    " after another (no process start per job, one compile for all; a higher peak"
                                    " RSS), or one child process per job (default: in this process where the jobs"
                                    " run one at a time, one worker)."),
    device: str = _DEVICE, precision: str = _PRECISION, progress: bool = _PROGRESS,
    keep_free: float = typer.Option(1.0, "--keep-free", help="GB to leave free on RUN's filesystem beyond what the"
                                    " run will write (estimated before it starts; it refuses to start where that"
                                    " does not fit). 0 lets it use every free byte."),
    *, options: TrainOptions,
):
    from mfgguf.train.fanout.schedule import train_experts

    if keep_free < 0:
        raise MfggufError(f"--keep-free is in GB and at least 0, got {keep_free}")
    s = train_experts(run, experts=experts, workers=workers, ray=ray, transfer=transfer, retries=retries,
                      progress=progress, job=JobOptions(options, device=device, precision=precision),
                      in_process=in_process,
                      keep_free=int(keep_free * 1e9))
    n = len(s["jobs"])
    typer.echo(f"train-experts: {n} job(s) on {s['backend']}, {s['syncs']} sync(s), {s['wall_s']:.1f} s;"
               f" summary in {Path(run) / 'logs' / 'train-experts.json'}" if n or s["syncs"] else
               "train-experts: every selected expert is already trained; nothing to do")


@command("sync", help=_doc("rounds.sync", "sync"))
def sync_cmd(
    run: Path = _RUN,
    merge: str = typer.Option("mean", "--merge", help="How the experts' shared copies merge: mean (token-weighted)."),
    restat: bool = typer.Option(True, "--restat/--no-restat", help="After the last round, recompute every expert's"
                                " router statistics here (--no-restat: run `mfgguf restat RUN --expert I` per expert)."),
    experts: str = typer.Option(None, "--experts", help="Only these experts take part, e.g. 1,2,4,5 (one"
                                          " held out of training); later syncs keep the first one's set. Default:"
                                          " every expert."),
    stats_from: str = typer.Option("train", "--stats-from", help="After the last round, the router statistics:"
                                   " train = those the last round's training steps recorded (no pass), pass = a"
                                   " forward pass of merged trunk + each expert (also re-scores each expert)."),
    device: str = _DEVICE, progress: bool = _PROGRESS,
):
    from mfgguf.options import parse_experts
    from mfgguf.train.rounds.sync import sync

    r = sync(run, merge=merge, restat=restat, device=device, progress=progress,
             experts=parse_experts(experts), stats_from=stats_from)
    before, after = r["before_validation_loss"], r["validation_loss"]
    held = ", ".join(f"{d} {before[d]:.3f}->{after[d]:.3f}" for d in after if d in before) or "not scored (a middle round)"
    if not r["final"]:
        what = f"experts continue with round {r['round'] + 1}"
    elif restat:
        n, kept = len(r["restated"]), len(r["adopted"])
        what = (f"final: router statistics of {n} experts from their last round's steps" if kept == n else
                f"final: router statistics of {n} experts recomputed on the merged trunk" if not kept else
                f"final: router statistics of {n} experts ({kept} from their last round's steps)")
    else:
        what = f"final: now `mfgguf restat {run} --expert I` for each expert"
    typer.echo(f"sync {r['round']}/{r['rounds']}: {r['merged_tensors']} trunk tensors merged ({r['merge']}) from"
               f" {r['experts']} experts; trunk validation loss {held}; {what}; {r['wall_s']:.1f} s")


@command("restat", help=_doc("rounds.restat", "restat"))
def restat_cmd(
    run: Path = _RUN,
    expert: int = typer.Option(..., "--expert", help="Expert index, 1..N."),
    device: str = _DEVICE,
):
    from mfgguf.train.rounds.restat import restat

    m = restat(run, expert, device=device)
    if not m["restated"]:
        typer.echo(f"{m['name']}: already has statistics on the final trunk")
        return
    typer.echo(f"{m['name']}: router statistics over {m['router_stats_count']:,} tokens on the merged trunk,"
               f" validation loss {m['premerge']['validation_loss_mean']:.3f} (own trunk copy) -> {m['validation_loss_mean']:.3f},"
               f" {m['restat_s']:.1f} s")


@command("router-stats", help=_doc("experts.pooled", "pool_router_stats"))
def router_stats_cmd(
    run: Path = _RUN,
    tokens: int = typer.Option(None, "--tokens", help="Tokens per expert; default: each expert's own statistics'"
                               " sample (16,384 for every preset; 4 x its eval tokens)."),
    experts: str = typer.Option(None, "--experts", help="Experts to pool over, e.g. 1,3 or 1-4 (default all; the ones"
                                " `assemble --experts` takes)."),
    forward_pass: bool = typer.Option(False, "--forward-pass", help="Measure every expert with a forward pass over"
                                      " its shard, even where its training recorded its second moments."),
    device: str = _DEVICE, progress: bool = _PROGRESS,
):
    from mfgguf.options import parse_experts
    from mfgguf.train.experts.pooled import pool_router_stats

    m = pool_router_stats(run, tokens=tokens, device=device, progress=progress,
                          experts=parse_experts(experts), forward_pass=forward_pass)
    typer.echo(f"router statistics: second moments over {m['router_stats_count']:,} tokens ({m['router_stats_on']}),"
               f" {Path(run) / 'modules' / m['file']}, {m['seconds']:.1f} s")
