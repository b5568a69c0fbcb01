"""CLI verbs `questions` (closed-book questions about a RUN's documents) and `import-questions` (a user's own)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from mfgguf.cli.app import command
from mfgguf.data.own_questions import import_questions
from mfgguf.data.question_sets import PER_DOMAIN, make_questions


@command("questions", make_questions)
def questions_cmd(
    run: Path = typer.Argument(..., help="The RUN directory (made by `mfgguf prepare`)."),
    sources: List[str] = typer.Argument(None, help="The sources prepare read (default: the ones run.json records)."),
    text_field: str = typer.Option("text", help="Field holding the text in JSONL / datasets records, as prepare's."),
    per_domain: int = typer.Option(PER_DOMAIN, "--per-domain", help="Questions a set holds of one domain at most."),
    seed: int = typer.Option(None, "--seed", help="Seed of the draws (default: the RUN's)."),
    force: bool = typer.Option(False, "--force", help="Replace the questions made before."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars."),
):
    summary = make_questions(run, sources or None, text_field=text_field, per_domain=per_domain, seed=seed,
                             force=force, progress=progress)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{Path(run) / 'questions'}: questions a set (seed {summary['seed']})")
    for col in ("set", "documents", "domain", "kind", "questions"):
        t.add_column(col, justify="right" if col in ("documents", "questions") else "left")
    for name, by_domain in summary["sets"].items():
        rows = [(d, k, n) for d, kinds in by_domain.items() for k, n in kinds.items()] or [("-", "-", 0)]
        for j, (d, k, n) in enumerate(rows):
            t.add_row(name if j == 0 else "", f"{summary['documents'][name]:,}" if j == 0 else "", d, k, f"{n:,}")
    Console().print(t)
    return summary


@command("import-questions", import_questions)
def import_questions_cmd(
    jsonl: Path = typer.Argument(..., help="JSONL: one {\"question\", \"choices\" (four), \"answer\" (0-3)} a line."),
    out: Path = typer.Argument(..., help="The file to write, e.g. RUN/questions/NAME.txt (eval scores it)."),
    force: bool = typer.Option(False, "--force", help="Replace OUT."),
):
    r = import_questions(jsonl, out, force=force)
    typer.echo(f"{r['questions']} questions written to {r['out']}")
    return r
