"""CLI verb `prepare`: sources -> RUN directory (tokenizer, expert shards, validation and test splits)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from mfgguf.data.prepare import prepare
from mfgguf.cli.app import command
from mfgguf.run import RunInfo


@command("prepare", prepare)
def prepare_cmd(
    sources: List[str] = typer.Argument(..., help="Files, dirs, globs, JSONL (text, or conversations: a `messages` list), hf:NAME[:CONFIG][:SPLIT], builtin, study; LABEL=SOURCE names a domain."),
    out: Path = typer.Option(..., "--out", help="The RUN directory to create."),
    experts: int = typer.Option(..., "--experts", help="Number of expert shards N."),
    partition: str = typer.Option("label", help="How documents go to experts: label, random or cluster."),
    vocab_size: int = typer.Option(4096, help="BPE vocabulary size (EOS included)."),
    overlap: float = typer.Option(0.0, help="Probability that a document also joins a second expert (random, cluster)."),
    test_frac: float = typer.Option(0.05, help="Fraction of each domain's documents held out as the test split (scored once per final model)."),
    old_test_frac: float = typer.Option(None, "--heldout-frac", hidden=True, help="--test-frac's earlier name."),
    valid_frac: float = typer.Option(0.05, help="Fraction of the rest held out as the validation split (every choice made on data reads it)."),
    seed: int = typer.Option(0, help="Seed for the test and validation splits, the partition and the shuffles."),
    max_chars_per_domain: int = typer.Option(None, help="Cap on each domain's characters (default: no cap)."),
    text_field: str = typer.Option("text", help="Field holding the text in JSONL / datasets records."),
    force: bool = typer.Option(False, "--force", help="Replace an existing RUN directory (only once the new one is complete)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars."),
):
    test_frac = test_frac if old_test_frac is None else old_test_frac  # scripts written before the rename
    info = prepare(sources, out, n_experts=experts, partition=partition, vocab_size=vocab_size,
                   test_frac=test_frac, valid_frac=valid_frac, overlap=overlap, seed=seed, max_chars_per_domain=max_chars_per_domain,
                   text_field=text_field, force=force, progress=progress)
    _summary(RunInfo.from_json(info), out)
    return info


def _summary(info: RunInfo, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    domains = info.domains
    t = Table(title=f"{out}: {info.n_experts} experts, partition={info.partition}, vocab={info.vocab_size}")
    t.add_column("shard")
    t.add_column("docs", justify="right")
    t.add_column("tokens", justify="right")
    for d in domains:
        t.add_column(d, justify="right")
    for s in info.shards:
        t.add_row(f"expert {s['id']}", f"{s['docs']:,}", f"{s['tokens']:,}",
                  *(f"{s['domains'].get(d, 0):,}" for d in domains))
    t.add_section()
    t.add_row("trunk (all)", f"{info.train_docs:,}", f"{info.train_tokens:,}", *("" for _ in domains))
    for label, held in (("validation", info.valid), ("test", info.test)):
        t.add_row(label, f"{sum(h['docs'] for h in held.values()):,}", f"{sum(h['tokens'] for h in held.values()):,}",
                  *(f"{held[d]['tokens']:,}" if d in held else "-" for d in domains))
    Console().print(t)
