"""The three benchmark files read as llama-perplexity reads them, and bad input refused in one line.

Golden bytes for the binary multiple-choice layout; the text layouts' quirks that decide which tasks are scored
(HellaSwag's final newline, WinoGrande's unread last line and quoted sentences); and through the CLI, a file not
in its layout, an empty file and more tasks than a file holds: one line on stderr, exit 1, nothing written.
"""

from __future__ import annotations

import struct

import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.errors import MfggufError
from mfgguf.runtime.choice.tasks import read_tasks, selected, write_multiple_choice
from tests.runtime.choice.files import NAMES, WRITERS


def test_multiple_choice_golden_bytes(tmp_path):
    write_multiple_choice(tmp_path / "mc.bin", [("Q", ["a", "bc"], 1)])
    body = (struct.pack("<I", 1) + b"Q" + struct.pack("<I", 2) + struct.pack("<I", 1) + b"a" + struct.pack("<I", 2)
            + b"bc" + struct.pack("<2i", 0, 1) + struct.pack("<I", 0))
    assert (tmp_path / "mc.bin").read_bytes() == struct.pack("<II", 1, 8) + body
    (t,) = read_tasks("multiple-choice", tmp_path / "mc.bin")
    assert t.candidates == ("Q a", "Q bc") and t.right == (1,)


def test_hellaswag_candidates_are_the_context_and_each_ending(tmp_path):
    p = tmp_path / "hs.txt"
    p.write_text("Ctx: a man\n2\nruns.\nsits.\nsings.\nwalks.\n")
    (t,) = read_tasks("hellaswag", p)
    assert t.candidates == ("Ctx: a man runs.", "Ctx: a man sits.", "Ctx: a man sings.", "Ctx: a man walks.")
    assert t.right == (2,)
    p.write_text("Ctx: a man\n2\nruns.\nsits.\nsings.\nwalks.")  # no final newline: the same task
    assert read_tasks("hellaswag", p) == [t]


def test_winogrande_reads_quoted_sentences_skips_a_header_and_never_the_last_line(tmp_path):
    p = tmp_path / "w.csv"
    p.write_text('index,sentence,option1,option2,answer\n0,"If _ wins, it sings.",Ann,Bob,2\n1,The _ sat.,cat,dog,1\n'
                 "2,A _ ran.,fox,hen,1\n")
    a, b = read_tasks("winogrande", p)  # llama-perplexity stops before the last line (tasks.py)
    assert a.candidates == ("If Ann wins, it sings.", "If Bob wins, it sings.") and a.right == (1,)
    assert a.bases == ("If Ann", "If Bob") and b.right == (0,)


def test_task_counts_select_llama_perplexitys_tasks(tmp_path):
    p = WRITERS["hellaswag"](tmp_path / NAMES["hellaswag"])
    tasks = read_tasks("hellaswag", p)
    assert [t.index for t in selected("hellaswag", tasks, 3)] == [5, 11, 8]  # draw.py's order for 12 tasks
    assert sorted(t.index for t in selected("hellaswag", tasks, None)) == list(range(12))
    with pytest.raises(MfggufError, match="more than the file's 12 tasks"):
        selected("hellaswag", tasks, 13)


@pytest.mark.parametrize("name,content,message", [
    ("hellaswag", "context\n1\na\nb\nc\n", "not a multiple of 6"),
    ("hellaswag", "context\nfour\na\nb\nc\nd\n", "not the right ending's index"),
    ("hellaswag", "", "is empty"),
    ("winogrande", "0,no blank here,a,b,1\n1,x,y,z,1\n", "line 1 is not"),
    ("multiple-choice", "\x05\x00\x00\x00", "not a multiple-choice file"),
])
def test_bad_files_stop_in_one_line(tiny_gguf, tmp_path, name, content, message):
    data = tmp_path / "bad"
    data.write_text(content)
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["perplexity", str(tiny_gguf), f"--{name}", str(data), "--out", str(out)])
    assert r.exit_code == 1, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert not out.exists()


def test_more_tasks_than_the_file_holds_and_an_existing_out_stop_in_one_line(tiny_gguf, tmp_path):
    data = WRITERS["hellaswag"](tmp_path / "hs.txt")
    r = CliRunner().invoke(app, ["perplexity", str(tiny_gguf), "--hellaswag", str(data), "--hellaswag-tasks", "20"])
    assert r.exit_code == 1 and "more than the file's 12 tasks; pass 12 or fewer" in r.output
    out = tmp_path / "r.json"
    out.write_text("a user's file")
    r = CliRunner().invoke(app, ["perplexity", str(tiny_gguf), "--hellaswag", str(data), "--out", str(out)])
    assert r.exit_code == 1 and "exists; pass --force" in r.output and out.read_text() == "a user's file"


def test_paired_with_compares_two_results_task_by_task_and_refuses_other_data(tiny_gguf, tmp_path):
    data, other = WRITERS["hellaswag"](tmp_path / "hs.txt"), tmp_path / "other.txt"
    other.write_text(data.read_text().replace("Reading:", "Text:"))
    args = ["perplexity", str(tiny_gguf), "--hellaswag", str(data), "--engine", "llama-cpp-python"]
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a.json")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, [*args, "--paired-with", str(tmp_path / "a.json"), "--json"])
    assert r.exit_code == 0, r.output
    p = __import__("json").loads(r.output)["benchmarks"]["hellaswag"]["paired_with"]
    assert (p["points"], p["tasks"], p["only_a"], p["only_b"]) == (0.0, 12, 0, 0)  # the same model: no difference
    r = CliRunner().invoke(app, ["perplexity", str(tiny_gguf), "--hellaswag", str(other), "--paired-with",
                                 str(tmp_path / "a.json")])
    assert r.exit_code == 1 and "on another file than" in r.output
