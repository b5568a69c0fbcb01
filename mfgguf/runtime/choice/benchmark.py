"""One benchmark on one GGUF (with an adapter, or each task through the adapter its context picks): a result record.

The engine is llama.cpp's own `llama-perplexity` where `make llama-tools` built it (tool.py) and llama-cpp-python
otherwise (score.py); both score the same tasks the same way (tests/runtime/choice hold them to it). Routing tasks
between adapters needs switching them between tasks, which only llama-cpp-python does here.

The record (JSON): the benchmark, the data file and its sha256, the model, the adapter(s), the engine and its
settings, the task count, the count right, the accuracy with llama-perplexity's Wilson interval, and per task
its index in the file (`task_ids`, in the order scored) and its verdict (`right`), so two models are compared task
by task (choice/paired.py pairs them); llama-cpp-python's records also hold each task's candidate scores.

Example:
    >>> r = benchmark(Path("model.gguf"), "hellaswag", Path("hellaswag_val_full.txt"), tasks=400)
    >>> r["accuracy"], r["ci95"]
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable

from mfgguf.errors import MfggufError
from mfgguf.runtime.choice import score as own
from mfgguf.runtime.choice.tasks import BENCHMARKS, read_tasks, selected

ENGINES = ("auto", "llama-perplexity", "llama-cpp-python")
DEFAULT_TASKS = {"hellaswag": 400, "winogrande": None, "multiple-choice": None}  # llama-perplexity's: None = all
CTX = 512  # llama-perplexity's own -c for these benchmarks
BATCH = 2048  # and its -b (bounded there by n_parallel x ctx)
Z95 = 1.95996398454


def wilson(right: int, n: int) -> tuple[float, float]:
    """The Wilson score interval (Z95: a 0.95 level) of a share right, as llama-perplexity prints it."""
    if n == 0:
        return 0.0, 1.0
    f, z = right / n, Z95 * Z95 / n
    c = z * math.sqrt(n * (4.0 * f * (1 - f) + z)) / (Z95 + Z95)
    return (f + z * 0.5 - c) / (1.0 + z), (f + z * 0.5 + c) / (1.0 + z)


def benchmark(model: Path, name: str, data: Path, *, tasks: int | None = None, lora: Path | None = None,
              adapters: dict[str, Path] | None = None, ctx: int = CTX, batch: int = BATCH, threads: int | None = None,
              engine: str = "auto", progress: Callable[[int, int, int], None] | None = None,
              experts_per_token: int | None = None) -> dict:
    """Score MODEL on a benchmark file as llama-perplexity does; with `adapters` ({name: lora.gguf}) each task goes
    through the candidate (the model alone or with one adapter) of lowest loss on its context.
    `progress(done, right, total)` is called as tasks are scored; `experts_per_token` overrides the file's own."""
    from mfgguf.runtime.llm import read_header
    from mfgguf.runtime.tools import program
    from mfgguf.run import sha256_file

    if name not in BENCHMARKS:
        raise MfggufError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
    if engine not in ENGINES:
        raise MfggufError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if ctx < 8 or batch < 1:
        raise MfggufError(f"--ctx {ctx} / batch {batch} cannot hold a task; pass --ctx 8 or more")
    from mfgguf.runtime.llm import experts_override

    header = read_header(model)
    overrides = experts_override(header, experts_per_token)
    all_tasks = read_tasks(name, data)
    n = DEFAULT_TASKS[name] if tasks is None else tasks
    n = min(n, len(all_tasks)) if tasks is None and n is not None else n  # llama-perplexity's default, capped there
    chosen = selected(name, all_tasks, n)
    n_parallel = max(own.N_PARALLEL, *(len(t.candidates) for t in chosen))
    threads = threads or os.cpu_count()
    if adapters and engine == "llama-perplexity":
        raise MfggufError("llama-perplexity applies one adapter to every task; routing tasks between adapters runs"
                          " on llama-cpp-python (--engine auto)")
    use_tool = engine == "llama-perplexity" or (engine == "auto" and not adapters and program("llama-perplexity"))
    t0 = time.perf_counter()
    extra: dict = {}
    if use_tool:
        from mfgguf.runtime.choice.tool import llama_perplexity

        right = llama_perplexity(Path(header["path"]), name, Path(data), n, ctx=ctx, batch=batch, threads=threads,
                                 n_parallel=n_parallel, lora=lora, expected=len(chosen), overrides=overrides,
                                 progress=progress and (lambda done, k: progress(done, k, len(chosen))))
        if len(right) < len(chosen):  # its last lines lost at exit (tool.py): those tasks through llama-cpp-python
            tail, _ = _own(Path(header["path"]), name, chosen[len(right):], ctx=ctx, batch=batch, threads=threads,
                           n_parallel=n_parallel, lora=lora, adapters=None, overrides=overrides)
            extra["tail_by_llama_cpp_python"] = len(tail)
            right = right + tail
    else:
        right, extra = _own(Path(header["path"]), name, chosen, ctx=ctx, batch=batch, threads=threads,
                            n_parallel=n_parallel, lora=lora, adapters=adapters, progress=progress,
                            overrides=overrides)
    k = sum(right)
    lo, hi = wilson(k, len(right))
    return {"benchmark": name, "data": str(data), "data_sha256": sha256_file(Path(data)), "model": Path(model).name,
            "lora": Path(lora).name if lora else None, "engine": "llama-perplexity" if use_tool else "llama-cpp-python",
            "ctx": ctx, "batch": batch, "threads": threads, "n_parallel": n_parallel,
            **({"experts_per_token": experts_per_token} if overrides else {}),
            "tasks_in_file": len(all_tasks), "tasks": len(right), "correct": k, "accuracy": k / len(right),
            "ci95": [lo, hi], "seconds": round(time.perf_counter() - t0, 2),
            "task_ids": [t.index for t in chosen], "right": right, **extra}


def _own(model: Path, name: str, chosen: list, *, ctx: int, batch: int, threads: int, n_parallel: int,
         lora: Path | None, adapters: dict[str, Path] | None, progress=None,
         overrides: dict | None = None) -> tuple[list[int], dict]:
    """Verdicts through llama-cpp-python, and what the record adds: each task's scores (and, routed, its adapter)."""
    loaded = dict(adapters or {}) if adapters else ({"lora": lora} if lora else {})
    done: list[int] = []  # verdicts of the groups scored before the one in progress (routed: one group an adapter)

    def report(part: list, tasks: list) -> None:
        if progress is not None:
            v = own.verdicts(name, tasks, part)
            progress(len(done) + len(v), sum(done) + sum(v), len(chosen))

    with own.engine(model, ctx=ctx, batch=batch, threads=threads, n_parallel=n_parallel, adapters=loaded,
                    overrides=overrides) as e:
        toks = own.tokenize(e, chosen)
        if not adapters:
            e.use("lora" if lora else None)
            scores = own.score_tasks(e, name, chosen, toks, progress=lambda part: report(part, chosen))
            return own.verdicts(name, chosen, scores), {"scores": scores}
        names = [None, *adapters]  # the model alone first: it wins ties, as in eval/domain_stream.py
        pick, nll = own.choose_adapters(e, toks, names)
        scores: list = [None] * len(chosen)
        for j, a in enumerate(names):
            mine = [i for i, p in enumerate(pick) if p == j]
            if mine:
                e.use(a)
                group = [chosen[i] for i in mine]
                got = own.score_tasks(e, name, group, [toks[i] for i in mine],
                                      progress=lambda part, group=group: report(part, group))
                done.extend(own.verdicts(name, group, got))
                for i, s in zip(mine, got):
                    scores[i] = s
    label = lambda j: names[j] or "base"  # noqa: E731
    return own.verdicts(name, chosen, scores), {
        "scores": scores, "chosen": [label(p) for p in pick],
        "choice": {label(j): pick.count(j) for j in range(len(names))}, "context_nll": nll.tolist()}




def benchmarks(model: Path, files: dict[str, Path], *, tasks: dict[str, int | None] | None = None,
               lora: Path | None = None, ctx: int | None = None, threads: int | None = None, engine: str = "auto",
               out: Path | None = None, force: bool = False, progress: bool = False,
               paired_with: dict | None = None, experts_per_token: int | None = None) -> dict:
    """Each benchmark of `files` ({benchmark: its file}) on MODEL, as `benchmark` scores it: {benchmark: record};
    with `out`, also written there as JSON (refused where the file exists, unless `force`). `paired_with` (another
    model's results, `read_results`) adds to each record its difference to that model, paired over the tasks."""
    from mfgguf.runtime.choice.paired import paired

    from mfgguf.run import write_json

    if not files:
        raise MfggufError("no benchmark to score; pass --hellaswag, --winogrande or --multiple-choice FILE")
    if out is not None and Path(out).exists() and not force:
        raise MfggufError(f"{out} exists; pass --force to replace it, or another --out")
    results = {}
    for name, data in files.items():
        with _bar(progress, name) as step:
            results[name] = benchmark(model, name, data, tasks=(tasks or {}).get(name), lora=lora, ctx=ctx or CTX,
                                      threads=threads, engine=engine, progress=step,
                                      experts_per_token=experts_per_token)
        if paired_with is not None:
            theirs = paired_with["benchmarks"][name]
            results[name]["paired_with"] = {"model": theirs["model"] + (f" + {theirs['lora']}" if theirs.get("lora")
                                                                         else ""),
                                            **paired(results[name], theirs)}
    if out is not None:
        write_json(Path(out), {"model": str(model), "lora": str(lora) if lora else None, "benchmarks": results})
    return results


def read_results(path: Path, files: dict[str, Path]) -> dict:
    """Another model's `--out` file, holding every benchmark of `files` on the same data (or one line saying why)."""
    import json

    try:
        r = json.loads(Path(path).read_text())
        got = r["benchmarks"]
    except (OSError, ValueError, KeyError, TypeError):
        raise MfggufError(f"{path} is not a results file of `mfgguf perplexity --out`; pass one it wrote") from None
    from mfgguf.run import sha256_file

    for name, data in files.items():
        if name not in got:
            raise MfggufError(f"{path} holds no {name} result; score that model on {name} first")
        if got[name].get("data_sha256") != sha256_file(Path(data)):
            raise MfggufError(f"{path} scored {name} on another file than {data}; pass results of the same data")
    return r


def _bar(enabled: bool, name: str):
    """A rich bar over the tasks (running accuracy, tasks/s, ETA) on stderr; a no-op when disabled."""
    from contextlib import contextmanager, nullcontext

    if not enabled:
        return nullcontext(None)

    @contextmanager
    def bar():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        cols = (TextColumn(name), BarColumn(), MofNCompleteColumn(), TextColumn("accuracy {task.fields[acc]}"),
                TextColumn("{task.fields[rate]} tasks/s"), TimeRemainingColumn())
        with Progress(*cols, transient=True, console=Console(stderr=True)) as p:
            task, t0 = p.add_task(name, total=None, acc="-", rate="-"), time.perf_counter()

            def step(done: int, right: int, total: int) -> None:
                p.update(task, completed=done, total=total, acc=f"{right / max(done, 1):.1%}",
                         rate=f"{done / max(time.perf_counter() - t0, 1e-9):.2f}")

            yield step

    return bar()


__all__ = ["BATCH", "CTX", "DEFAULT_TASKS", "ENGINES", "benchmark", "benchmarks", "read_results", "wilson"]
