"""CLI verbs that retune a finished GGUF's routing on training tokens: `calibrate` (top-k and temperature by
search) and `tune-router` (the router rows by gradient steps)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from mfgguf.converters.routing.calibrate import CalibrationGrid, calibrate
from mfgguf.errors import MfggufError
from mfgguf.options import parse_floats
from mfgguf.train.whole.router_tune import RouterTuning, tune_router
from mfgguf.cli.app import command


def _floats(s: str | None, what: str, default: tuple) -> tuple:
    if s is None:
        return default
    return () if s.strip().lower() == "none" else parse_floats(s, what)


@command("calibrate", calibrate)
def calibrate_cmd(
    model: Path = typer.Argument(..., help="A MoE .gguf written by `mfgguf assemble`."),
    run: Path = typer.Option(..., "--run", help="The RUN it was assembled from (its data/train.npy is the sample)."),
    out: Path = typer.Option(..., "-o", "--out", help="The calibrated .gguf to write."),
    top_k: str = typer.Option(None, "--top-k", help="Top-k values to try, e.g. 1,2,3 (default 1..min(experts, 4))."),
    temperature: str = typer.Option(None, "--temperature", help="Router temperatures tried with top-k >= 2 (default 0.5,1,2)."),
    tokens: int = typer.Option(8192, "--tokens", help="Calibration sample: training tokens scored per candidate."),
    ctx: int = typer.Option(None, "--ctx", help="Window length (default and maximum: the model's context)."),
    threads: int = typer.Option(None, "--threads", help="llama.cpp threads (default: all cores)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output file."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-candidate lines."),
):
    d = CalibrationGrid()
    ks = _floats(top_k, "--top-k", ())
    if any(k != int(k) for k in ks):
        raise MfggufError(f"--top-k {top_k!r} must list whole numbers, e.g. 1,2")
    grid = CalibrationGrid(top_k=tuple(int(k) for k in ks) or None,
                           temperature=_floats(temperature, "--temperature", d.temperature) or (1.0,))
    r = calibrate(model, run, out, grid=grid, tokens=tokens, ctx=ctx, threads=threads, force=force, progress=not quiet)
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    c = r["chosen"]
    typer.echo(f"{'top-k':>5} {'temp':>5} {'ppl':>9}")
    for x in r["candidates"]:
        typer.echo(f"{x['top_k']:>5} {x['temperature']:>5g} {x['ppl']:>9.4f}")
    typer.echo(f"wrote {r['path']}: top-{c['top_k']}, temperature {c['temperature']:g}; calibration sample"
               f" ({r['tokens']} training tokens) ppl {r['ppl_before']:.4f} -> {r['ppl_after']:.4f}")


@command("tune-router", tune_router)
def tune_router_cmd(
    model: Path = typer.Argument(..., help="A MoE .gguf written by `mfgguf assemble`."),
    run: Path = typer.Option(..., "--run", help="The RUN it was assembled from (its experts' shards are the data)."),
    out: Path = typer.Option(..., "-o", "--out", help="The tuned .gguf to write (MODEL itself with --force)."),
    tokens: int = typer.Option(None, "--tokens", help="Tuning tokens in all (default: 1% of the experts' training tokens)."),
    epochs: int = typer.Option(RouterTuning.epochs, "--epochs", help="Passes over the tuning windows."),
    lr: float = typer.Option(RouterTuning.lr, "--lr", help="Adam's learning rate on the router rows."),
    batch_size: int = typer.Option(RouterTuning.batch_size, "--batch-size", help="Windows per step."),
    micro_batch: int = typer.Option(RouterTuning.micro_batch, "--micro-batch", help="Windows per forward and backward (memory)."),
    ctx: int = typer.Option(None, "--ctx", help="Tuning window (default: the experts' training context)."),
    val_tokens: int = typer.Option(RouterTuning.val_tokens, "--val-tokens", help="Validation tokens llama.cpp scores before and after."),
    seed: int = typer.Option(RouterTuning.seed, "--seed", help="Which tuning windows, in which order."),
    precision: str = typer.Option(RouterTuning.precision, "--precision", help="auto (bf16 where native), bf16 or fp32."),
    threads: int = typer.Option(None, "--threads", help="llama.cpp threads for the validation (default: all cores)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output file."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
):
    t = RouterTuning(tokens=tokens, epochs=epochs, lr=lr, batch_size=batch_size, micro_batch=micro_batch, ctx=ctx, val_tokens=val_tokens,
                     seed=seed, precision=precision)
    r = tune_router(model, run, out, tuning=t, threads=threads, force=force, progress=progress)
    if as_json:
        typer.echo(json.dumps({k: v for k, v in r.items() if k != "history"}, indent=2))
        return
    what = "tuned rows kept" if r["kept"] else "tuned rows did not help: the file's router written back"
    typer.echo(f"wrote {r['path']}: {what}; {r['steps']} steps on {r['tokens']:,} tokens in {r['tune_s']:.1f} s "
               f"(loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}); validation ({r['val_tokens']:,} tokens) "
               f"ppl {r['ppl_before']:.4f} -> {r['ppl_tuned']:.4f}")
