"""The benchmark options `perplexity` and `eval` share: a file and a task count for each of llama.cpp's benchmarks.

`@benchmark_options(tasks_default)` gives a verb `--hellaswag FILE --hellaswag-tasks N`, `--winogrande ...` and
`--multiple-choice ...` (runtime/choice/tasks.py reads the files), and hands it one `benchmarks: Benchmarks`
parameter: the files given and their task counts. `tasks_default` says, per benchmark, what the verb scores when
no count is given.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import typer

from mfgguf.cli.options import gathered

LAYOUTS = {"hellaswag": "A HellaSwag file in llama-perplexity's layout (six lines a task)",
           "winogrande": "A WinoGrande CSV in llama-perplexity's layout",
           "multiple-choice": "A multiple-choice .bin in llama-perplexity's layout (ARC, MMLU, TruthfulQA)"}


@dataclass(frozen=True)
class Benchmarks:
    files: dict[str, Path] = field(default_factory=dict)  # benchmark -> its file, the ones given
    tasks: dict[str, int] = field(default_factory=dict)  # benchmark -> the task count given


def _param(name: str) -> str:
    return name.replace("-", "_")


def benchmark_options(tasks_default: dict[str, str], what: str = ""):
    """Decorator: replace the verb's `benchmarks: Benchmarks` parameter by the benchmark options; `what` ends each
    file option's help (what the verb does with it), `tasks_default` each count's."""

    def deco(fn):
        extra = []
        for name, layout in LAYOUTS.items():
            extra += [inspect.Parameter(_param(name), inspect.Parameter.KEYWORD_ONLY, annotation=Path,
                                        default=typer.Option(None, f"--{name}", help=f"{layout}{what}.")),
                      inspect.Parameter(_param(name) + "_tasks", inspect.Parameter.KEYWORD_ONLY, annotation=int,
                                        default=typer.Option(None, f"--{name}-tasks", help=f"Tasks of it to score"
                                                             f" ({tasks_default[name]}; llama-perplexity's draw)."))]

        def gather(kw: dict) -> Benchmarks:
            files = {n: kw.pop(_param(n)) for n in LAYOUTS}
            tasks = {n: kw.pop(_param(n) + "_tasks") for n in LAYOUTS}
            return Benchmarks({n: Path(v) for n, v in files.items() if v is not None},
                              {n: int(v) for n, v in tasks.items() if v is not None})

        return gathered(fn, "benchmarks", extra, gather)

    return deco


__all__ = ["Benchmarks", "LAYOUTS", "benchmark_options"]
