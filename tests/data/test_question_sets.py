"""`mfgguf questions RUN` on a RUN prepared from the built-in corpus: the splits are the RUN's, every question's
document is on its set's side, and the same RUN gives the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.data.partition import split_three
from mfgguf.data.question_sets import make_questions, question_sets
from mfgguf.data.sources import load_corpus
from mfgguf.runtime.choice.tasks import read_tasks
from tests.conftest import copy_run


@pytest.fixture(scope="module")
def asked(prepared_run, tmp_path_factory) -> Path:
    """A copy of the session's prepared RUN, its questions made by the CLI."""
    run = copy_run(prepared_run, tmp_path_factory.mktemp("questions") / "run")
    r = CliRunner().invoke(app, ["questions", str(run), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "train-test" in r.output and "python-doc" in r.output
    return run


def _sets(run: Path) -> dict[str, list[dict]]:
    return {s: [json.loads(line) for line in (run / "questions" / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train-valid", "train-test", "test")}


def test_every_question_is_about_a_document_of_its_side_of_the_split(asked):
    info = json.loads((asked / "run.json").read_text())
    docs, _ = load_corpus(info["sources"], max_chars_per_domain=info["max_chars_per_domain"], progress=False)
    train, valid, test = split_three([d.domain for d in docs], info["test_frac"], info["valid_frac"], info["seed"])
    sets = _sets(asked)
    assert all(sets.values()), {k: len(v) for k, v in sets.items()}
    on = {s: {t["document"] for t in tasks} for s, tasks in sets.items()}
    assert on["train-valid"] <= set(train.tolist()) and on["train-test"] <= set(train.tolist())
    assert not on["train-valid"] & on["train-test"]  # split by document
    assert on["test"] <= set(test.tolist())
    held = {d: (asked / "data" / "test" / f"{d}.txt").read_text() for d in info["domains"]}
    for t in sets["test"]:  # the test split's text, as the RUN holds it, states the answer
        assert t["choices"][t["answer"]].split(".")[0][:40] in " ".join(held[t["domain"]].split())


def test_the_files_read_back_and_eval_scores_all_but_the_validation_half(asked):
    for s, tasks in _sets(asked).items():
        read = read_tasks("hellaswag", asked / "questions" / f"{s}.txt")
        assert [r.right[0] for r in read] == [t["answer"] for t in tasks]
    assert list(question_sets(asked)) == ["questions-train-test", "questions-test"]
    summary = json.loads((asked / "questions" / "summary.json").read_text())
    assert sum(summary["sets"]["train-test"]["python"].values()) == len(_sets(asked)["train-test"])


def test_the_same_run_and_seed_give_the_same_files_and_a_changed_source_is_refused(asked, tmp_path):
    before = {p.name: p.read_bytes() for p in (asked / "questions").iterdir()}
    r = CliRunner().invoke(app, ["questions", str(asked), "--no-progress"])
    assert r.exit_code == 1 and "already holds questions; pass --force" in r.output
    make_questions(asked, force=True, progress=False)
    assert {p.name: p.read_bytes() for p in (asked / "questions").iterdir()} == before
    other = tmp_path / "notes.txt"
    other.write_text("Some notes that are not what this RUN was prepared from.\n" * 50)
    r = CliRunner().invoke(app, ["questions", str(asked), str(other), "--force", "--no-progress"])
    assert r.exit_code == 1 and "no longer gives the documents" in r.output and "Traceback" not in r.output
    assert {p.name: p.read_bytes() for p in (asked / "questions").iterdir()} == before
