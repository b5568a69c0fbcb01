"""What every model of `mfgguf eval` keeps of the base's general ability: llama.cpp's multiple-choice benchmarks.

Domain training can cost what a base knew; a standard benchmark scored the same way for every model shows how much.
With `--hellaswag FILE` (and `--winogrande`, `--multiple-choice`), eval scores each benchmark, on the same tasks
(llama-perplexity's draw for the task count), for:
  - the base: the trunk before any expert or sync (on an imported base, the pretrained model itself);
  - every MoE the test split scores (of each router and top-k, the seed gate validation chose);
  - every baseline eval trained: continued pretraining (FLOP- and wall-clock-matched), the one LoRA, the dense
    models of a trunk trained here; and the per-domain LoRAs, each task through the candidate (the base alone or
    with one adapter) of lowest loss on the task's context (runtime/choice/score.py `choose_adapters`), the rule
    of the unknown-domain stream, since a benchmark task has no domain.
Each is scored by runtime/choice (llama-perplexity where built, llama-cpp-python otherwise) and kept in
OUT/measured/ like every measurement (eval/measured.py). The report gives each model's accuracy and interval, its
paired difference to the base in points with its interval (runtime/choice/paired.py), the seconds each took, and a plot.
The RUN's own closed-book questions (RUN/questions/, `mfgguf questions`: data/question_sets.py) are benchmarks of
the same kind, HellaSwag's layout under the name `questions-<set>`, scored the same way where `--questions` (the
default) finds them: every task of each set but the training half's validation one, which only choices read.

Example:
    >>> general = score_general(ev, models, scored)   # in evaluate.py, after the test split is scored
    >>> general["hellaswag"]["paired"]["moe ridge top-1"]["points"]
"""

from __future__ import annotations

from pathlib import Path

from mfgguf.data.question_sets import PREFIX, question_sets
from mfgguf.eval.measured import file_key, kept
from mfgguf.runtime.choice.paired import paired

EVAL_TASKS = {"hellaswag": 2000, "winogrande": None, "multiple-choice": None}  # eval's defaults; None = every task
# (HellaSwag: a paired difference to within about a point; the whole validation set is five times the cost)
BASE_MODELS = ("trunk as trained (before sync)", "trunk alone")  # the first of these a report holds is the base
QUESTIONS_NOTE = {"train-test": "Closed-book questions about training documents (the half no choice read): what"
                                " the models learnt of them.",
                  "test": "Closed-book questions about the test split's documents, which no model trained on: what"
                          " generalises.",
                  "": "Questions brought with `mfgguf import-questions`."}


def layout(name: str) -> str:
    """The layout a benchmark's file is in: a question set (`questions-<set>`, data/question_sets.py) HellaSwag's."""
    return "hellaswag" if name.startswith(PREFIX) else name


def with_questions(cfg, run: Path):
    """`cfg` with the RUN's question sets (RUN/questions/, `mfgguf questions`) among its benchmarks, where
    `cfg.questions` asks for them."""
    from dataclasses import replace

    sets = question_sets(run) if cfg.questions else {}
    return replace(cfg, benchmarks={**(cfg.benchmarks or {}), **{k: str(v) for k, v in sets.items()}}) if sets else cfg


def check_benchmarks(benchmarks: dict | None, tasks: dict | None) -> None:
    """Every benchmark file readable in its layout and holding the tasks asked: one line before anything trains."""
    from mfgguf.runtime.choice.tasks import read_tasks, selected

    for name, data in (benchmarks or {}).items():
        all_tasks = read_tasks(layout(name), Path(data))
        selected(layout(name), all_tasks, task_count(name, tasks, len(all_tasks)))


def task_count(name: str, tasks: dict | None, in_file: int) -> int | None:
    """The tasks eval scores of a benchmark: the count given (more than the file holds is refused), else
    EVAL_TASKS's, or every task of a file that holds fewer (None: every task)."""
    if (tasks or {}).get(name) is not None:
        return tasks[name]
    n = EVAL_TASKS.get(name)
    return None if n is None or n >= in_file else n


def general_models(models: dict, scored: set[str]) -> dict[str, dict]:
    """{model name: {"path", "adapters"?}} of the models benchmarked, the base first (where `models` holds it: a
    baselines-only eval, eval/baselines/budgeted.py, does not)."""
    base = next((n for n in BASE_MODELS if n in models), None)
    out = {base: {"path": models[base]["path"]}} if base else {}
    for name, m in models.items():
        if (m["kind"] == "moe" and name in scored) or m["kind"] == "dense":
            spec = {"path": m["path"]}
            if m.get("adapters"):
                from mfgguf.eval.domain_stream import stream_candidates

                candidates, _ = stream_candidates(m["adapters"], m.get("every_adapter", ()))
                spec["adapters"] = {k: v for k, v in candidates.items() if v is not None}
            out[name] = spec
    return out


def score_general(ev, models: dict, scored: set[str], say=print) -> dict:
    """{benchmark: {"tasks", "base", "models": {name: record summary}, "paired": {name: vs the base}}} for
    eval's benchmarks (`ev.cfg.benchmarks`), every model of `general_models` scored or read back from OUT/measured/
    (without the base: "base" None, nothing paired; each record's verdicts pair it across evals)."""
    from mfgguf.run import sha256_file
    from mfgguf.runtime.choice.benchmark import CTX, benchmark
    from mfgguf.runtime.choice.tasks import read_tasks

    cfg, out = ev.cfg, {}
    targets = general_models(models, scored)
    base = next((n for n in BASE_MODELS if n in targets), None)
    for name, data in (cfg.benchmarks or {}).items():
        n = task_count(name, cfg.benchmark_tasks, len(read_tasks(layout(name), Path(data))))
        sha = sha256_file(Path(data))
        records = {}
        for label, spec in targets.items():
            adapters = spec.get("adapters")
            settings = {"split": name, "data_sha256": sha, "tasks": n, "ctx": CTX,
                        "adapters": {k: file_key(v) for k, v in (adapters or {}).items()}}
            say(f"{name} {label}")
            records[label] = kept(ev.out, spec["path"], settings, lambda p=spec["path"], a=adapters: benchmark(
                p, layout(name), Path(data), tasks=n, adapters=a, engine="auto"), force=ev.force,
                what="routed" if adapters else "")
        first = records[base or next(iter(records))]
        out[name] = {"tasks": first["tasks"], "tasks_in_file": first["tasks_in_file"],
                     "data": str(data), "data_sha256": sha, "base": base,
                     "models": {k: _summary(r) for k, r in records.items()},
                     "paired": {k: paired(r, records[base]) for k, r in records.items() if base and k != base},
                     "verdicts": {k: {"task_ids": r["task_ids"], "right": r["right"]} for k, r in records.items()}}
    return out


def _summary(r: dict) -> dict:
    keep = ("accuracy", "ci95", "correct", "tasks", "seconds", "engine", "choice")
    return {k: r[k] for k in keep if k in r}


def general_markdown(general: dict, moe: str, points: float) -> list[str]:
    """report.md's section: each benchmark's table, and the goal on the best MoE's paired difference to the base."""
    L = []
    for name, g in general.items():
        asked = name.startswith(PREFIX)  # questions about the RUN's own documents: a goal of their own, not this one
        L += ["", f"## Questions about the documents: {name[len(PREFIX):]}" if asked else f"## General ability: {name}",
              *(["", QUESTIONS_NOTE.get(name[len(PREFIX):], QUESTIONS_NOTE[""])] if asked else []), "",
              f"{g['tasks']:,} of the file's {g['tasks_in_file']:,} tasks (llama-perplexity's draw), the same for every"
              f" model, scored as llama-perplexity scores them; the difference to the base ({g['base']}) is paired over"
              " the tasks (95% interval of a paired bootstrap; McNemar's exact p on the tasks one model alone gets"
              " right).", "",
              "| model | accuracy | 95% interval | - base, points | paired 95% interval | only it / only the base right |"
              " McNemar p | seconds |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for label, m in g["models"].items():
            lo, hi = m["ci95"]
            p = g["paired"].get(label)
            cells = (f"{p['points']:+.2f} | {p['low']:+.2f} to {p['high']:+.2f} | {p['only_a']} / {p['only_b']} |"
                     f" {p['mcnemar_p']:.3f}") if p else "(the base) | | |"
            L.append(f"| {label} | {100 * m['accuracy']:.2f}% | {100 * lo:.1f}-{100 * hi:.1f}% | {cells} |"
                     f" {m['seconds']:,.0f} |")
        if moe in g["paired"] and not asked:
            p = g["paired"][moe]
            met = "yes" if p["points"] >= -points else "no"
            L += ["", f"Goal: the MoE ({moe}) at most {points:g} points below the base: {p['points']:+.2f}"
                      f" ({p['low']:+.2f} to {p['high']:+.2f}): {met}."]
        L += ["", f"![{name} accuracy by model](general_{name}.png)"]
    return L


def general_plot(general: dict, out: Path) -> list[Path]:
    """A PNG a benchmark: each model's paired difference to the base, with its interval."""
    from mfgguf.plots import pyplot, save_figure

    paths = []
    for name, g in general.items():
        plt = pyplot()
        labels = list(g["paired"])
        fig, ax = plt.subplots(figsize=(7.5, 0.5 * len(labels) + 1.6))
        pts = [g["paired"][k]["points"] for k in labels]
        err = [[p - g["paired"][k]["low"] for p, k in zip(pts, labels)],
               [g["paired"][k]["high"] - p for p, k in zip(pts, labels)]]
        ax.errorbar(pts, range(len(labels)), xerr=err, fmt="o", capsize=3)
        ax.axvline(0, color="gray", lw=0.8)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        base_acc = 100 * g["models"][g["base"]]["accuracy"]
        ax.set(xlabel=f"accuracy - the base's ({base_acc:.1f}%), points; 95% paired interval",
               title=f"{name}: {g['tasks']:,} tasks, the same for every model")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(save_figure(fig, out / f"general_{name}.png", plt))
    return paths


__all__ = ["EVAL_TASKS", "check_benchmarks", "general_markdown", "general_models", "general_plot", "layout",
           "score_general", "task_count", "with_questions"]
