"""CLI verbs `assemble` (modules -> one GGUF), `extend` (experts in or out of a finished GGUF) and `inspect`
(what is in a GGUF). Torch-free imports."""

from __future__ import annotations

from pathlib import Path

import typer

from mfgguf.converters.assemble import assemble
from mfgguf.converters.extend import extend
from mfgguf.converters.routing.guard import Guard
from mfgguf.gguf.inspect import format_inspect, inspect_gguf
from mfgguf.modules.merge import MERGES
from mfgguf.gguf.schema import LAYOUTS, ROUTERS, USER_QUANTS
from mfgguf.errors import MfggufError
from mfgguf.options import parse_experts
from mfgguf.cli.app import command


@command("assemble", assemble)
def assemble_cmd(
    run: Path = typer.Argument(..., help="The RUN directory (trunk and experts trained)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .gguf file."),
    quant: str = typer.Option("q8_0", "--quant", help=f"Weight type: {'|'.join(USER_QUANTS)}."),
    top_k: int = typer.Option(None, "--top-k", help="Experts used per token (default 1 = the exact trained function)."),
    router: str = typer.Option("ridge", "--router", help=f"Router: {'|'.join(ROUTERS)}."),
    layout: str = typer.Option("auto", "--layout", help=f"GGUF layout: auto|{'|'.join(LAYOUTS)} (auto: the model"
                               " family's own: shared-expert (granitemoe) for llama and qwen2 (qwen2moe), folded (qwen3moe) for qwen3;"
                               " folded writes a llama or qwen2 trunk as llama, exact at any top-k; granitemoe and mixtral,"
                               " the earlier names, are still accepted)."),
    experts: str = typer.Option(None, "--experts", help="Experts to include, e.g. 1,3,7 or 1-4"
                                 " (default all; 'none' = trunk alone)."),
    merge: str = typer.Option("mean", "--merge", help=f"Experts' trained copies of trunk tensors: {'|'.join(MERGES)}"
                              " (mean = token-weighted; none = the trunk as trained)."),
    seed_gate: float = typer.Option(None, "--seed-gate", help="Route the untrained seed FFN too, as expert 0: a token no"
                                    " expert claims computes the trunk alone, on an imported base the base's own"
                                    " FFN. The seed wins where no expert's ridge logit reaches this share of the"
                                    " experts' summed logits (0.5: no expert has a majority); choose it on"
                                    " validation (`eval --seed-gates`)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output file."),
    threads: int = typer.Option(None, "--threads", help="Quantizer threads (default: all cores)."),
    fast_quant: bool = typer.Option(False, "--fast-quant", help="q8_0 with ggml's vectorised quantizer: ~8x faster,"
                                    " a few bytes per million differ from llama.cpp's reference quantizer."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
):
    r = assemble(run, out, quant=quant, top_k=top_k, router=router, layout=layout, experts=parse_experts(experts),
                 merge=merge, force=force, threads=threads, fast_quant=fast_quant,
                 progress=not quiet, seed_gate=seed_gate)
    n = len(r["experts"])
    what = f"{n} experts, top-{r['top_k']}, router {r['router']}" if n else "trunk alone (dense)"
    if r["seed_gate"] is not None:
        what += f", the seed routed as expert 0 (gate {r['seed_gate']:g})"
    if r["merged_tensors"]:
        what += f", {r['merged_tensors']} trunk tensors merged ({r['merge']})"
    typer.echo(f"wrote {r['path']}: {r['arch']} ({r['layout']}), {what}, {r['quant']}, "
               f"{r['bytes'] / 1e6:.1f} MB in {r['seconds']:.1f} s")


@command("extend", extend)
def extend_cmd(
    model: Path = typer.Argument(..., help="A .gguf written by `mfgguf assemble` (any MoE architecture: granitemoe, qwen2moe, llama with experts, qwen3moe)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .gguf file."),
    add: Path = typer.Option(None, "--add", help="A RUN whose experts were trained against the model's trunk."),
    experts: str = typer.Option(None, "--experts", help="Experts of the --add RUN to add, e.g. 1,3 or 2-4 (default all)."),
    remove: str = typer.Option(None, "--remove", help="Experts to remove by position, e.g. 2 or 1,4 (1..N in the file's order; `inspect` lists slot K-1)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output file."),
    threads: int = typer.Option(None, "--threads", help="Quantizer threads (default: all cores)."),
    keep_routing: bool = typer.Option(False, "--keep-routing", help="Keep the router rows of the experts already in"
                                      " the file; only added experts get new rows."),
    guard: float = typer.Option(None, "--guard", help="Implies --keep-routing: lower the added experts' logits until"
                                " no old expert's training shard moves by more than this many percent (e.g. 0.5)."),
    guard_run: Path = typer.Option(None, "--guard-run", help="The RUN the file's experts were trained in, for their"
                                   " shards (default: the --add RUN)."),
):
    if guard_run is not None and guard is None:
        raise MfggufError("--guard-run names the RUN --guard reads the old experts' shards from; pass --guard PCT too")
    r = extend(model, out, add=add, experts=parse_experts(experts), remove=_slots(remove), force=force, threads=threads,
               keep_routing=keep_routing, guard=None if guard is None else Guard(max_move=guard / 100, run=guard_run))
    how = "rows kept, new ones from" if r["keep_routing"] else "recomputed from"
    typer.echo(f"wrote {r['path']}: {r['experts']} experts ({r['added']} added, {r['removed']} removed), router"
               f" {r['router']} {how} {r['sources']} source{'s' * (r['sources'] != 1)}, "
               f"{r['bytes'] / 1e6:.1f} MB in {r['seconds']:.1f} s")
    if (g := r["guard"]) is not None:
        typer.echo(f"guard: new rows {g['bias']:+g} nats; old experts' shards moved at most {100 * g['max_move']:+.2f}%"
                   f" (limit {100 * g['limit']:.2f}%{'' if g['met'] else ': NOT met'}), the new ones' "
                   + ", ".join(f"{k} {100 * v:+.2f}%" for k, v in g["new"].items()))


def _slots(spec: str | None) -> list[int] | None:
    if spec is None:
        return None
    try:
        return [int(k) for k in spec.split(",")]
    except ValueError:
        raise MfggufError(f"bad --remove {spec!r}: give expert slots such as 2 or 1,4") from None


@command("inspect", inspect_gguf)
def inspect_cmd(path: Path = typer.Argument(..., help="A .gguf file.")):
    typer.echo(format_inspect(inspect_gguf(path)))
