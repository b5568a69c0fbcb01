"""Closed-book questions from real text: manual pages and the standard library's docstrings, their sets, the
HellaSwag layout they are written in, and a user's own questions from JSONL."""

from __future__ import annotations

import gzip
import json
import random
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.data.question_sets import PER_DOCUMENT, build_set, write_hellaswag
from mfgguf.data.questions import MAX_OPTIONS, document_facts, normal
from mfgguf.data.study import roff_to_text
from mfgguf.runtime.choice.tasks import read_tasks

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _page(name: str) -> str:
    path = Path("/usr/share/man/man1") / f"{name}.1.gz"
    if not path.is_file():
        pytest.skip(f"no manual page {name}(1) on this machine")
    return roff_to_text(gzip.decompress(path.read_bytes()).decode("utf-8"))


def _stdlib_facts(*modules: str) -> dict[str, list]:
    """{module: its facts} of standard-library modules' whole source."""
    return {m: document_facts((STDLIB / f"{m}.py").read_text(encoding="utf-8")) for m in modules}


def test_a_manual_page_gives_its_name_line_and_its_options():
    facts = document_facts(_page("ls"))
    name = facts[0]
    assert (name.kind, name.subject, name.ending) == ("man-name", "ls", "list directory contents")
    assert name.context == "In the manual, the summary line of ls is:"
    options = {f.subject: f.ending for f in facts if f.kind == "man-option"}
    assert options["ls --author"] == "with -l, print the author of each file"
    assert all(s.startswith("ls -") for s in options) and 1 <= len(options) <= MAX_OPTIONS


def test_python_functions_and_methods_give_their_docstrings_first_sentence():
    facts = _stdlib_facts("glob", "ftplib")
    by = {f.subject: f for fs in facts.values() for f in fs}
    iglob = by["iglob"]
    assert iglob.ending == "Return an iterator which yields the paths matching a pathname pattern."
    assert iglob.context.startswith("In the Python code, the docstring of iglob(pathname, *, root_dir,")
    assert by["FTP.set_debuglevel"].context == "In the Python code, the docstring of FTP.set_debuglevel(level) begins:"
    assert not [s for s in by if s.split(".")[-1].startswith("__")]  # dunders give none
    assert all("\n" not in f.ending and "\n" not in f.context for f in by.values())


def test_a_function_without_a_docstring_does_not_take_the_next_ones():
    text = ("def plain(x):\n    return x\n\n\ndef documented(a, b=(1, 2)):\n"
            '    """Add the two numbers given here."""\n    return a + b\n\n\n'
            "class Box:\n    def put(self, item):\n        '''Put an item into the box.'''\n\n"
            "    def _inner(self):\n        def nested():\n            '''A nested helper is not asked.'''\n")
    facts = document_facts(text)
    assert [(f.subject, f.ending) for f in facts] == [("documented", "Add the two numbers given here."),
                                                      ("Box.put", "Put an item into the box.")]
    assert facts[0].context == "In the Python code, the docstring of documented(a, b) begins:"


def _pool():
    """Facts of real standard-library modules, each module one document, in two domains (every other one)."""
    names = ["glob", "ftplib", "shutil", "tempfile", "textwrap", "fnmatch", "gzip", "zipfile", "tarfile", "csv"]
    facts = {i: fs for i, fs in enumerate(_stdlib_facts(*names).values())}
    return facts, ["files", "formats"] * (len(facts) // 2)


def test_a_set_draws_four_distinct_endings_of_its_domain_and_kind_with_the_right_one_anywhere():
    facts, domains = _pool()
    tasks = build_set(list(facts)[:6], list(facts), facts, domains, 30, random.Random("t"))
    per_document, per_domain = Counter(t["document"] for t in tasks), Counter(t["domain"] for t in tasks)
    assert len(tasks) >= 10 and max(per_document.values()) <= PER_DOCUMENT and max(per_domain.values()) <= 30
    truths = {(i, f.ending) for i, fs in facts.items() for f in fs}
    every = {f.ending: (f, domains[i]) for i, fs in facts.items() for f in fs}
    for t in tasks:
        choices, right = t["choices"], t["choices"][t["answer"]]
        assert len(choices) == 4 and len({normal(c) for c in choices}) == 4
        assert (t["document"], right) in truths and t["document"] < 6 and t["domain"] == domains[t["document"]]
        subject = next(f.subject for f in facts[t["document"]] if f.context == t["question"])
        for c in choices:
            f, domain = every[c]
            assert domain == t["domain"] and f.kind == t["kind"] == "python-doc"
            assert c == right or f.subject != subject
    assert len({t["answer"] for t in tasks}) >= 3  # the right ending's place is drawn
    again = build_set(list(facts)[:6], list(facts), facts, domains, 30, random.Random("t"))
    assert again == tasks  # the same seed, the same set
    assert len(build_set(list(facts)[:6], list(facts), facts, domains, 3, random.Random("t"))) == 6  # 3 a domain


def test_the_layout_reads_back_as_the_tasks_written(tmp_path):
    facts, domains = _pool()
    tasks = build_set(list(facts), list(facts), facts, domains, 4, random.Random(0))
    write_hellaswag(tmp_path / "q.txt", tasks)
    read = read_tasks("hellaswag", tmp_path / "q.txt")
    assert len(read) == len(tasks) == 8
    for t, r in zip(tasks, read):
        assert r.candidates == tuple(f"{t['question']} {c}" for c in t["choices"]) and r.right == (t["answer"],)


# ---- a user's own questions -------------------------------------------------------------------------------

def _jsonl(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = json.dumps({"question": "The capital of France is", "choices": ["Paris", "Rome", "Madrid", "Berlin"],
                   "answer": 0})


def test_own_questions_are_converted_and_read_back(tmp_path):
    src = _jsonl(tmp_path / "mine.jsonl", GOOD, "",
                 json.dumps({"question": "Two\nlines", "choices": ["a b", "c\nd", "e", "f"], "answer": 3}))
    out = tmp_path / "run" / "questions" / "mine.txt"
    r = CliRunner().invoke(app, ["import-questions", str(src), str(out)])
    assert r.exit_code == 0, r.output
    assert "2 questions written" in r.output
    tasks = read_tasks("hellaswag", out)
    assert tasks[0].candidates[0] == "The capital of France is Paris" and tasks[0].right == (0,)
    assert tasks[1].candidates[1] == "Two lines c d" and tasks[1].right == (3,)
    again = CliRunner().invoke(app, ["import-questions", str(src), str(out)])
    assert again.exit_code == 1 and "exists; pass --force" in again.output


@pytest.mark.parametrize("line, says", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "is a JSON list, not an object"),
    ('{"question": "q", "choices": ["a", "b", "c", "d"]}', "has no answer"),
    ('{"question": "q", "choices": ["a", "b", "c"], "answer": 0}', "choices is 3 choices; give a list of 4"),
    ('{"question": "q", "choices": ["a", "b", "a", "d"], "answer": 0}', "two choices are the same text"),
    ('{"question": "q", "choices": ["a", "b", "c", ""], "answer": 0}', "every choice must be a non-empty text"),
    ('{"question": "q", "choices": ["a", "b", "c", "d"], "answer": 4}', "answer is 4; give the right choice's index"),
    ('{"question": "q", "choices": ["a", "b", "c", "d"], "answer": true}', "answer is true"),
    ('{"question": "", "choices": ["a", "b", "c", "d"], "answer": 1}', "question is not a non-empty text"),
])
def test_bad_own_questions_are_refused_with_file_and_line(tmp_path, line, says):
    src = _jsonl(tmp_path / "bad.jsonl", GOOD, line)
    r = CliRunner().invoke(app, ["import-questions", str(src), str(tmp_path / "out.txt")])
    assert r.exit_code == 1
    assert r.output.startswith(f"error: {src}:2")
    assert says in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "out.txt").exists()


def test_an_empty_file_and_a_set_name_of_the_run_are_refused(tmp_path):
    empty = _jsonl(tmp_path / "empty.jsonl", "")
    r = CliRunner().invoke(app, ["import-questions", str(empty), str(tmp_path / "out.txt")])
    assert r.exit_code == 1 and "holds no question" in r.output
    r = CliRunner().invoke(app, ["import-questions", str(_jsonl(tmp_path / "g.jsonl", GOOD)),
                                 str(tmp_path / "questions" / "test.txt")])
    assert r.exit_code == 1 and "the name of a set `mfgguf questions` writes" in r.output
