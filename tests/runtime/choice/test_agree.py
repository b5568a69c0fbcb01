"""llama.cpp's own llama-perplexity and mfgguf's llama-cpp-python path give the same verdict on every task.

Small files the tests write in each of the three layouts (real English), on the session's really trained tiny MoE
and on a tiny base with a LoRA adapter trained on one shard: every task count asked, the same tasks in the same
order, the same verdicts; WinoGrande's printed scores the same to their six decimals. The programs come from
`make llama-tools`; without them these tests skip saying so. And the adapter routing: each task's verdict through
the candidate its context chose is that candidate's alone, and the context's loss is llama.cpp's document NLL.
"""

from __future__ import annotations

import numpy as np
import pytest

from mfgguf.runtime.choice.benchmark import benchmark
from mfgguf.runtime.choice.tasks import read_tasks
from tests.runtime.choice.files import NAMES, WRITERS
from tests.runtime.llama_tools import tool
from tests.train.whole.test_lora_adapter import adapted, base_run  # noqa: F401  (fixtures)

CTX = 128  # each sequence's room: the tiny preset was trained on less, which scores alike in both engines


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    return {b: w(d / NAMES[b]) for b, w in WRITERS.items()}


def _both(model, name, data, tasks=None, **kw):
    tool("llama-perplexity")  # a skip naming `make llama-tools` where it is not built
    a = benchmark(model, name, data, tasks=tasks, ctx=CTX, threads=2, engine="llama-perplexity", **kw)
    b = benchmark(model, name, data, tasks=tasks, ctx=CTX, threads=2, engine="llama-cpp-python", **kw)
    return a, b


@pytest.mark.parametrize("name,tasks", [("hellaswag", None), ("hellaswag", 5), ("winogrande", None),
                                        ("winogrande", 6), ("multiple-choice", None), ("multiple-choice", 5)])
def test_both_engines_score_the_same_tasks_to_the_same_verdicts(tiny_gguf, files, name, tasks):
    a, b = _both(tiny_gguf, name, files[name], tasks)
    assert a["engine"] == "llama-perplexity" and b["engine"] == "llama-cpp-python"
    assert a["task_ids"] == b["task_ids"] and len(a["task_ids"]) == (tasks or len(read_tasks(name, files[name])))
    assert a["right"] == b["right"], (a["right"], b["right"])
    assert a["accuracy"] == b["accuracy"] and a["ci95"] == b["ci95"]
    if name == "multiple-choice":
        assert a["n_parallel"] == 5 or tasks  # the five-answer task: -np 5 in both
    scores = np.array(b["scores"], dtype=object)
    assert all(len(s) == len(t.candidates) for s, t in zip(scores, read_tasks(name, files[name])) if tasks is None) or tasks
    assert len({round(max(s) - min(s), 6) for s in b["scores"]}) > 1  # the model tells candidates apart


def test_winogrande_scores_are_llama_perplexitys_to_the_printed_digits(tiny_gguf, files):
    import subprocess

    from mfgguf.runtime.choice.tool import Verdicts, command

    tool("llama-perplexity")
    cmd = command(tiny_gguf, "winogrande", files["winogrande"], None, ctx=CTX, batch=2048, threads=2, n_parallel=4)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    printed = Verdicts("winogrande")
    for line in out.splitlines():
        printed.read(line)
    ours = benchmark(tiny_gguf, "winogrande", files["winogrande"], ctx=CTX, threads=2, engine="llama-cpp-python")
    n = len(printed.scores)  # its last line may be lost at exit (tool.py)
    assert n >= 7 and len(ours["scores"]) == 9  # the file's ten rows less the last, which it never reads
    assert np.abs(np.array(printed.scores) - np.array(ours["scores"][:n])).max() < 2e-6


def test_tasks_whose_lines_llama_perplexity_lost_at_exit_are_scored_through_llama_cpp_python(tiny_gguf, files,
                                                                                               tmp_path, monkeypatch):
    """llama.cpp's logger can lose a run's last lines at exit: a llama-perplexity that loses its last two task lines
    (the real program, its output cut) still gives every task's verdict, the tail's through llama-cpp-python."""
    real = tool("llama-perplexity")
    cut = tmp_path / "llama-perplexity"
    cut.write_text(f"#!/bin/sh\n'{real}' \"$@\" | awk '/^[0-9]+\\t/ {{ n++ }} n <= 10'\n")
    cut.chmod(0o755)
    monkeypatch.setenv("MFGGUF_LLAMA_TOOLS", str(tmp_path))
    r = benchmark(tiny_gguf, "hellaswag", files["hellaswag"], ctx=CTX, threads=2, engine="llama-perplexity")
    assert r["tail_by_llama_cpp_python"] == 2 and len(r["right"]) == 12
    ours = benchmark(tiny_gguf, "hellaswag", files["hellaswag"], ctx=CTX, threads=2, engine="llama-cpp-python")
    assert r["right"] == ours["right"]


def test_an_adapter_scores_alike_in_both_engines_and_changes_the_scores(adapted, files):  # noqa: F811
    d, out = adapted
    a, b = _both(d / "base.gguf", "hellaswag", files["hellaswag"], lora=out / "lora.gguf")
    assert a["right"] == b["right"] and a["lora"] == "lora.gguf"
    plain = benchmark(d / "base.gguf", "hellaswag", files["hellaswag"], ctx=CTX, threads=2, engine="llama-cpp-python")
    assert np.abs(np.array(plain["scores"]) - np.array(b["scores"])).max() > 1e-3


def test_routed_tasks_take_the_verdict_of_the_candidate_their_context_chose(adapted, files):  # noqa: F811
    from mfgguf.runtime.choice import score as own
    from mfgguf.runtime.perplexity import document_nll

    d, out = adapted
    base, lora = d / "base.gguf", out / "lora.gguf"
    routed = benchmark(base, "hellaswag", files["hellaswag"], ctx=CTX, threads=2, adapters={"lora-1": lora})
    assert routed["engine"] == "llama-cpp-python" and sum(routed["choice"].values()) == 12
    alone = {"base": benchmark(base, "hellaswag", files["hellaswag"], ctx=CTX, threads=2, engine="llama-cpp-python"),
             "lora-1": benchmark(base, "hellaswag", files["hellaswag"], ctx=CTX, threads=2, lora=lora,
                                 engine="llama-cpp-python")}
    for i, c in enumerate(routed["chosen"]):
        assert routed["right"][i] == alone[c]["right"][i]
        assert routed["scores"][i] == pytest.approx(alone[c]["scores"][i], abs=1e-9)
    # the context's loss, as llama.cpp's document scorer computes it for the same tokens
    tasks = [t for t in read_tasks("hellaswag", files["hellaswag"])]
    order = {t.index: t for t in tasks}
    with own.engine(base, ctx=CTX, batch=2048, threads=2) as e:
        toks = own.tokenize(e, [order[i] for i in routed["task_ids"]])
    docs = [np.array(t.seqs[0][: t.prefix]) for t in toks]
    for j, lo in enumerate((None, lora)):
        nll, _ = document_nll(base, docs, ctx=CTX, lora=lo)
        assert np.array([x.sum() for x in nll]) == pytest.approx(np.array(routed["context_nll"])[:, j], rel=1e-3)
