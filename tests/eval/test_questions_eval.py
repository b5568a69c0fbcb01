"""eval's question sets: found in RUN/questions/, scored for every model like a benchmark (the same tasks, paired
against the base), and reported in their own section."""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from mfgguf.data.question_sets import build_set, write_hellaswag
from mfgguf.data.questions import document_facts
from mfgguf.eval.evaluate import EvalConfig
from mfgguf.eval.general import general_markdown, score_general, with_questions
from tests.runtime.conftest import write_gguf


def _questions(path: Path, n: int = 6) -> Path:
    """`n` questions about real standard-library docstrings, each module one document."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ["glob", "ftplib", "shutil", "textwrap", "fnmatch", "gzip"]
    facts = {i: document_facts((stdlib / f"{m}.py").read_text(encoding="utf-8")) for i, m in enumerate(names)}
    write_hellaswag(path, build_set(list(facts), list(facts), facts, ["python"] * len(facts), n, random.Random(1)))
    return path


def test_eval_takes_the_runs_question_sets_but_the_validation_half(tmp_path):
    run = tmp_path / "run"
    for s in ("train-valid", "train-test", "test", "mine"):
        _questions(run / "questions" / f"{s}.txt", 4)
    cfg = with_questions(EvalConfig(benchmarks={"hellaswag": "hs.txt"}), run)
    assert cfg.benchmarks == {"hellaswag": "hs.txt", "questions-train-test": str(run / "questions" / "train-test.txt"),
                              "questions-test": str(run / "questions" / "test.txt"),
                              "questions-mine": str(run / "questions" / "mine.txt")}
    assert with_questions(EvalConfig(questions=False), run).benchmarks is None
    assert with_questions(EvalConfig(), tmp_path / "elsewhere").benchmarks is None


@dataclass
class _Eval:  # what score_general reads of an Evaluation
    cfg: EvalConfig
    out: Path
    force: bool = False


def test_every_model_is_scored_on_the_questions_paired_against_the_base(tmp_path):
    model = write_gguf(tmp_path / "talker.gguf")
    other = write_gguf(tmp_path / "other.gguf", dim=32)
    cfg = with_questions(EvalConfig(), tmp_path)  # no questions here: none
    assert cfg.benchmarks is None
    cfg = EvalConfig(benchmarks={"questions-test": str(_questions(tmp_path / "test.txt"))})
    models = {"trunk alone": {"path": model, "kind": "trunk"}, "dense flop": {"path": other, "kind": "dense"},
              "moe ridge top-1": {"path": other, "kind": "moe"}}
    general = score_general(_Eval(cfg, tmp_path / "eval"), models, {"moe ridge top-1"}, say=lambda _: None)
    g = general["questions-test"]
    assert g["tasks"] == g["tasks_in_file"] == 6 and g["base"] == "trunk alone"
    assert set(g["models"]) == {"trunk alone", "dense flop", "moe ridge top-1"}
    p = g["paired"]["dense flop"]
    assert p["tasks"] == 6 and p["low"] <= p["points"] <= p["high"] and 0 <= p["mcnemar_p"] <= 1
    md = "\n".join(general_markdown(general, "moe ridge top-1", 0.5))
    assert "## Questions about the documents: test" in md and "which no model trained on" in md
    assert "| dense flop |" in md and "| moe ridge top-1 |" in md
    assert "Goal:" not in md  # the general-ability goal is not the questions' goal
    assert list((tmp_path / "eval" / "measured").glob("*.questions-test.json"))  # kept like every measurement
