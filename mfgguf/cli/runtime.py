"""CLI verbs that run a GGUF with llama.cpp: chat, generate, serve, perplexity."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from mfgguf.runtime.chat import chat
from mfgguf.runtime.generate import generate
from mfgguf.runtime.perplexity import perplexity_files
from mfgguf.runtime.route import route_text
from mfgguf.runtime.serve import serve
from mfgguf.cli.app import command
from mfgguf.cli.benchmark_options import Benchmarks, benchmark_options
from mfgguf.errors import MfggufError

_MODEL = typer.Argument(..., help="A .gguf written by `mfgguf assemble`.")
_CTX = typer.Option(None, "--ctx", help="Context length (default and maximum: the model's trained context).")
_EXPERTS = typer.Option(None, "--experts-per-token", help="Experts each token uses, instead of the file's own count"
                        " (a MoE file; llama.cpp's metadata override, nothing rewritten).")


@command("chat", chat)
def chat_cmd(
    model: Path = _MODEL,
    temperature: float = typer.Option(0.8, help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling: keep the smallest set of tokens with this total probability."),
    top_k: int = typer.Option(40, "--top-k", help="Sample among the k most likely tokens; 0 turns it off."),
    seed: int = typer.Option(0, help="Random seed: the same seed replays the same conversation."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Longest reply, in tokens."),
    ctx: int = _CTX,
    lora: Path = typer.Option(None, "--lora", help="A llama.cpp LoRA adapter GGUF of MODEL to apply."),
    experts_per_token: int = _EXPERTS,
    show_experts: bool = typer.Option(False, "--show-experts", help="After each reply, a line naming the experts it"
                                      " went through."),
):
    chat(model, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens, n_ctx=ctx,
         lora=lora, experts_per_token=experts_per_token, show_experts=show_experts)


@command("generate", generate)
def generate_cmd(
    model: Path = _MODEL,
    prompt: str = typer.Argument(..., help="The text to continue."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.8, help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling threshold."),
    top_k: int = typer.Option(40, "--top-k", help="Sample among the k most likely tokens; 0 turns it off."),
    seed: int = typer.Option(0, help="Random seed: the same seed gives the same text."),
    ctx: int = _CTX,
    experts_per_token: int = _EXPERTS,
    show_experts: bool = typer.Option(False, "--show-experts", help="Then print on stderr which experts the prompt"
                                      " and the text went through."),
):
    ran: list[int] = []
    for piece in generate(model, prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=seed, stream=True, n_ctx=ctx, experts_per_token=experts_per_token, ran=ran):
        sys.stdout.write(piece)  # only the generated text: scripts read stdout
        sys.stdout.flush()
    sys.stdout.write("\n")
    if show_experts:
        from mfgguf.runtime.route import routes

        print_routes(routes(model, ids=ran, experts_per_token=experts_per_token), tokens=False, err=True)


@command("serve", serve)
def serve_cmd(
    model: Path = _MODEL,
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 exposes the API to the network)."),
    port: int = typer.Option(8000, help="TCP port."),
    ctx: int = _CTX,
    api_key: str = typer.Option(None, "--api-key", help="Require this bearer token from clients."),
    parallel: int = typer.Option(4, "--parallel", help="Requests decoded together (llama-server's slots)."),
    engine: str = typer.Option("auto", "--engine", help="llama-server (`make llama-tools`), llama-cpp-python, or"
                               " auto (the first where it is built)."),
    threads: int = typer.Option(None, "--threads", help="CPU threads (default: every core)."),
    experts_per_token: int = _EXPERTS,
    lora: Path = typer.Option(None, "--lora", help="A llama.cpp LoRA adapter GGUF of MODEL to apply."),
):
    serve(model, host=host, port=port, n_ctx=ctx, api_key=api_key, parallel=parallel, engine=engine, threads=threads,
          experts_per_token=experts_per_token, lora=lora)


@command("perplexity", perplexity_files)
@benchmark_options({"hellaswag": "default 400, as llama-perplexity", "winogrande": "default all",
                    "multiple-choice": "default all"}, ": score it as llama-perplexity does")
def perplexity_cmd(
    model: Path = _MODEL,
    data: list[Path] = typer.Option(None, "--data", help="UTF-8 text file to score (repeat for several domains)."),
    run: Path = typer.Option(None, "--run", help="A RUN directory: score each held-out domain."),
    ctx: int = typer.Option(None, "--ctx", help="Window in tokens (default 1024, or the model's trained context where"
                            " shorter; at most the trained context)."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON instead of a table."),
    lora: Path = typer.Option(None, "--lora", help="A llama.cpp LoRA adapter GGUF of MODEL to apply (`train-base"
                              " --mode lora` writes OUT/lora.gguf for the base's `assemble --experts none` file)."),
    chunks: int = typer.Option(None, "--chunks", help="Score only each domain's first N windows (llama.cpp's"
                               " --chunks): a quick look."),
    engine: str = typer.Option("auto", "--engine", help="Who scores the benchmarks: llama-perplexity (`make"
                               " llama-tools`), llama-cpp-python, or auto (the first where it is built)."),
    out: Path = typer.Option(None, "--out", help="Write the benchmarks' results (accuracy, interval, each task's"
                             " verdict) to this JSON file."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out file."),
    paired_with: Path = typer.Option(None, "--paired-with", help="An --out file of another model on the same"
                                     " benchmarks: the difference to it, paired over the same tasks."),
    threads: int = typer.Option(None, "--threads", help="CPU threads (default: every core)."),
    experts_per_token: int = _EXPERTS,
    benchmarks: Benchmarks = Benchmarks(),
):
    files = benchmarks.files
    if (out is not None or force or paired_with is not None) and not files:
        raise MfggufError("--out, --force and --paired-with are for benchmark results; pass --hellaswag, --winogrande"
                          " or --multiple-choice FILE too")
    r = {}
    if files:
        from mfgguf.runtime.choice.benchmark import benchmarks as score_benchmarks
        from mfgguf.runtime.choice.benchmark import read_results

        other = read_results(paired_with, files) if paired_with is not None else None  # a bad file stops here, first
        r["benchmarks"] = score_benchmarks(model, files, tasks=benchmarks.tasks, lora=lora, ctx=ctx, threads=threads,
                                           engine=engine, out=out, force=force, paired_with=other,
                                           progress=not as_json and sys.stderr.isatty(),
                                           experts_per_token=experts_per_token)
    if not files or data or run:
        r.update(perplexity_files(model, data=data or None, run=run, ctx=ctx, threads=threads,
                                  progress=not as_json and sys.stderr.isatty(), lora=lora, chunks=chunks,
                                  experts_per_token=experts_per_token))
    if as_json:
        typer.echo(json.dumps(r, indent=2))
        return
    if "benchmarks" in r:
        _benchmark_table(model, lora, r["benchmarks"])
        if out is not None:
            typer.echo(f"results: {out}")
    if "overall" in r:
        _perplexity_table(model, lora, r)


def _benchmark_table(model: Path, lora: Path | None, results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    name = model.name + (f" + {lora.name}" if lora else "")
    t = Table(title=f"benchmarks of {name} (scored as llama-perplexity scores them)")
    for col in ("benchmark", "tasks", "right", "accuracy", "95% interval", "engine", "seconds"):
        t.add_column(col, justify="left" if col in ("benchmark", "engine") else "right")
    for b, v in results.items():
        lo, hi = v["ci95"]
        t.add_row(b, f"{v['tasks']:,}", f"{v['correct']:,}", f"{v['accuracy']:.2%}", f"{lo:.2%}-{hi:.2%}",
                  v["engine"], f"{v['seconds']:.1f}")
    Console().print(t)
    for b, v in results.items():
        p = v.get("paired_with")
        if p:
            typer.echo(f"{b}: {p['points']:+.2f} points against {p['model']} (paired over {p['tasks']:,} tasks, 95%"
                       f" interval {p['low']:+.2f} to {p['high']:+.2f}; only this model right on {p['only_a']}, only"
                       f" {p['model']} on {p['only_b']}; McNemar p {p['mcnemar_p']:.3f})")


def _perplexity_table(model: Path, lora: Path | None, r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    o = r["overall"]
    name = model.name + (f" + {lora.name}" if lora else "")
    t = Table(title=f"perplexity of {name} (llama.cpp, ctx {o['ctx']}, second half of each window scored)")
    for col in ("domain", "perplexity", "nll/token", "scored tokens", "input tokens", "windows"):
        t.add_column(col, justify="left" if col == "domain" else "right")
    row = lambda name, v, **kw: t.add_row(name, f"{v['ppl']:.3f}", f"{v['nll']:.4f}", f"{v['n_tokens']:,}",
                                          f"{v['n_input_tokens']:,}", f"{v['n_windows']:,}", **kw)
    for name, v in r["domains"].items():
        row(name, v)
    if len(r["domains"]) > 1:
        row("overall", o, style="bold")
    Console().print(t)


@command("route", route_text)
def route_cmd(
    model: Path = _MODEL,
    text: str = typer.Argument(None, help="The text to route (or --file)."),
    file: Path = typer.Option(None, "--file", help="A UTF-8 text file to route instead."),
    experts_per_token: int = _EXPERTS,
    png: Path = typer.Option(None, "--png", help="Draw tokens x layers coloured by each one's first expert here."),
    as_json: bool = typer.Option(False, "--json", help="Print every token's experts and weights in every layer as JSON."),
    threads: int = typer.Option(None, "--threads", help="CPU threads (default: every core)."),
):
    r = route_text(model, text, file=file, experts_per_token=experts_per_token, png=png, threads=threads)
    if as_json:
        typer.echo(json.dumps(r.as_json()))
        return
    print_routes(r)
    if png is not None:
        typer.echo(f"heat map: {png}")


def print_routes(r, tokens: bool = True, err: bool = False) -> None:
    """The experts' shares and (with `tokens`) each token's most chosen experts, as tables."""
    from rich.console import Console
    from rich.table import Table

    from mfgguf.runtime.route import per_token, summary

    s = summary(r)
    L, k = r.slots.shape[1], r.slots.shape[2]
    t = Table(title=f"experts of {len(r.ids):,} tokens x {L} layers ({k} a token; the anchor runs for every token)")
    for col in ("expert", "share of token-layers, first choice", "share of the routing weight"):
        t.add_column(col, justify="left" if col == "expert" else "right")
    for label, v in s["experts"].items():
        t.add_row(label, f"{v['top1']:.1%}", f"{v['weight']:.1%}")
    console = Console(stderr=err)
    console.print(t)
    if tokens:
        pt = Table(title="each token's most chosen experts (first choice, layers)")
        pt.add_column("token")
        pt.add_column("experts")
        for piece, experts in per_token(r):
            pt.add_row(repr(piece), experts)
        console.print(pt)
