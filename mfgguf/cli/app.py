"""The typer app. Thin: each verb calls one typed library function whose docstring is its help.

Verbs live beside this file, one area each (data.py, base.py, train.py, convert.py, runtime.py,
eval/evaluate.py); they register themselves with `command`. Only here is MfggufError caught: it is
printed as one line on stderr and the process exits 1, without a traceback.
"""

from __future__ import annotations

import functools
import inspect

import typer

from mfgguf.errors import MfggufError

app = typer.Typer(
    name="mfgguf",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Build a Mixture-of-Experts LLM from independently trained small modules; run it with llama.cpp.",
)


def doc_help(fn) -> str:
    """The library function's docstring up to its 'Example' section: the verb's help text."""
    doc = (inspect.getdoc(fn) or "").split("\nExample")[0].strip()
    # typer keeps single newlines inside a paragraph; join them so help text reflows.
    return "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))


def command(name: str, library_fn=None, **kw):
    """Register a CLI verb; MfggufError becomes one line on stderr and exit code 1."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except MfggufError as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(1) from None
            except KeyboardInterrupt:
                typer.echo("interrupted", err=True)
                raise typer.Exit(130) from None

        if library_fn is not None and "help" not in kw:
            kw["help"] = doc_help(library_fn)
        app.command(name, **kw)(wrapper)
        return fn

    return deco


def _register() -> None:
    import importlib

    for area in ("data", "questions", "base", "train", "convert", "export", "calibrate", "runtime", "evaluate"):
        try:
            importlib.import_module(f"{__package__}.{area}")
        except ModuleNotFoundError as e:  # an area not written yet must not break the others
            if e.name != f"{__package__}.{area}":
                raise


_register()


def main() -> None:
    from mfgguf.machine import count_startup

    count_startup()  # the first job's record counts this process's start (imports) in its wall
    app()
