"""The train verbs' training options, built from TrainOptions' fields (mfgguf/options.py).

`@train_options("trunk")` (or "expert") gives a verb one CLI option per TrainOptions field, named
`flag(field)`, typed as the field, default None (the preset's), its help the field's declared help;
the verb receives them gathered as one `options: TrainOptions` parameter. The options of the other
kind are there too, hidden from --help, so that the library function the verb calls refuses one
given in one line (`TrainOptions.check`: "--rounds is an expert option; train-trunk does not take it").
So an option declared in TrainOptions is an option of train-trunk, train-expert and train-experts at once.
"""

from __future__ import annotations

import functools
import inspect
import typing

import typer

from mfgguf.options import TrainOptions, flag, option_help, option_names, option_types


def _option(name: str, typ: type, help: str, hidden: bool) -> typer.models.OptionInfo:
    f = flag(name)
    return typer.Option(None, f"{f}/--no-{f[2:]}" if typ is bool else f, help=help, hidden=hidden)


def train_options(kind: str, help: dict[str, str] | None = None):
    """Decorator: replace the verb's `options: TrainOptions` parameter by the CLI options of a `kind` job (and,
    hidden, the others, for the library's one-line refusal); `help` replaces an option's help where the verb's
    default is not the preset's."""
    taken, types = option_names(kind), option_types()
    helps = {n: (help or {}).get(n) or option_help(n) for n in types}

    def deco(fn):
        extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=types[n],
                                   default=_option(n, types[n], helps[n], hidden=n not in taken)) for n in types]
        return gathered(fn, "options", extra, lambda kw: TrainOptions(**{n: kw.pop(n) for n in types}))

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


__all__ = ["gathered", "train_options"]
