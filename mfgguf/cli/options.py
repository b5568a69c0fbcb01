"""The train verbs' training options, built from TrainOptions' fields (mfgguf/options.py).

`@train_options("trunk")` (or "expert") gives a verb one CLI option per field it takes, named
`flag(field)`, typed as the field, default None (the preset's), its help the field's comment;
the verb receives them gathered as one `options: TrainOptions` parameter. So a TrainConfig field
added in mfgguf/config.py is an option of train-trunk, train-expert and train-experts at once.
"""

from __future__ import annotations

import functools
import inspect
import typing

import typer

from mfgguf.options import EXPERT_ONLY, MODEL_OPTIONS, TrainOptions, flag, option_help, option_types

SCOPES = ("trunk", "expert")


def scope_fields(scope: str) -> list[str]:
    """The TrainOptions fields a verb of this scope takes: the trunk trains no expert-only field and the
    experts change no model shape (they use the trunk's)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}")
    skip = EXPERT_ONLY if scope == "trunk" else MODEL_OPTIONS
    return [n for n in option_types() if n not in skip]


def _option(name: str, kind: type, help: str) -> typer.models.OptionInfo:
    f = flag(name)
    return typer.Option(None, f"{f}/--no-{f[2:]}" if kind is bool else f, help=help)


def train_options(scope: str, help: dict[str, str] | None = None):
    """Decorator: replace the verb's `options: TrainOptions` parameter by the CLI options of `scope`;
    `help` replaces an option's help where the verb's default is not the preset's."""
    names = scope_fields(scope)
    types = option_types()
    helps = {n: (help or {}).get(n) or option_help(n) for n in names}

    def deco(fn):
        extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=_option(n, types[n], helps[n]),
                                   annotation=types[n]) for n in names]
        return gathered(fn, "options", extra, lambda kw: TrainOptions(**{n: kw.pop(n) for n in names}))

    return deco


def gathered(fn, name: str, extra: list[inspect.Parameter], gather):
    """`fn` as typer sees a verb whose parameter `name` is the keyword options `extra` instead; `gather(kw)` pops
    them from the keywords given and returns the one value `fn` takes for `name`."""
    hints = typing.get_type_hints(fn)
    params = [p.replace(annotation=hints.get(p.name, p.annotation))
              for p in inspect.signature(fn).parameters.values() if p.name != name] + extra

    @functools.wraps(fn)
    def verb(*args, **kw):
        value = gather(kw)
        return fn(*args, **{name: value}, **kw)

    verb.__signature__ = inspect.Signature(params)
    verb.__annotations__ = {p.name: p.annotation for p in params}
    return verb


__all__ = ["gathered", "train_options", "scope_fields", "SCOPES"]
