"""Corpus sources: every source kind read from real files, labels, splitting, skipping, the built-in corpus."""

from __future__ import annotations

import json
import sysconfig
from collections import Counter
from pathlib import Path

import pytest

from mfgguf.data.builtin import _stdlib_py_files
from mfgguf.data.sources import MAX_DOC_CHARS, load_corpus, load_documents, split_text
from mfgguf.errors import MfggufError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _real_text(name: str) -> str:
    return (STDLIB / name).read_text(encoding="utf-8")


def test_text_file_is_split_at_lines_and_labelled_by_stem(tmp_path):
    text = _real_text("argparse.py")  # ~100k chars of real code
    f = tmp_path / "argparse_copy.py"
    f.write_text(text, encoding="utf-8")
    docs = load_documents([str(f)], progress=False)
    assert len(docs) > len(text) // MAX_DOC_CHARS
    assert all(len(d.text) <= MAX_DOC_CHARS for d in docs)
    assert {d.domain for d in docs} == {"argparse_copy"}
    assert "".join(d.text for d in docs) == text  # cut at line boundaries, nothing lost
    assert all(d.text.endswith("\n") for d in docs)


def test_split_text_cuts_a_giant_line_hard():
    text = "a" * 20000 + "\nshort\n"
    pieces = split_text(text, max_chars=8192)
    assert [len(p) for p in pieces] == [8192, 8192, 20000 - 2 * 8192 + 1 + 6]
    assert "".join(pieces) == text


def _make_tree(root: Path) -> None:
    (root / "a" / "deep").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "a" / "one.md").write_text(_real_text("json/__init__.py")[:3000])
    (root / "a" / "deep" / "two.md").write_text(_real_text("textwrap.py")[:5000])
    (root / "b" / "three.txt").write_text("Ünïcödé text, still UTF-8 — fine.\n" * 10)
    (root / "blob.bin").write_bytes(bytes(range(256)) * 8)  # NUL bytes: binary
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))  # not UTF-8
    (root / ".hidden.md").write_text("should be ignored\n")


def test_directory_is_recursive_and_skips_binary(tmp_path):
    root = tmp_path / "mycorpus"
    _make_tree(root)
    docs, stats = load_corpus([str(root)], progress=False)
    assert {d.domain for d in docs} == {"mycorpus"}
    texts = "".join(d.text for d in docs)
    assert "Ünïcödé" in texts and "class TextWrapper" in texts and "JSON (JavaScript" in texts
    assert "should be ignored" not in texts
    assert stats[0]["files"] == 5 and stats[0]["skipped"] == 2


def test_glob_selects_only_matching_files(tmp_path):
    root = tmp_path / "globbed"
    _make_tree(root)
    docs, stats = load_corpus([f"{root}/**/*.md"], progress=False)
    assert {d.domain for d in docs} == {"globbed"}
    assert stats[0]["files"] == 2 and stats[0]["skipped"] == 0
    assert "Ünïcödé" not in "".join(d.text for d in docs)


def test_jsonl_with_and_without_domain_field(tmp_path):
    f = tmp_path / "mixed.jsonl"
    rows = [{"text": _real_text("json/__init__.py")[:2000], "domain": "code"},
            {"text": "A plain English sentence about the weather.\n"},
            {"body": "other field", "text": "third", "domain": "notes"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    docs = load_documents([str(f)], progress=False)
    assert [d.domain for d in docs] == ["code", "mixed", "notes"]
    assert docs[1].text.startswith("A plain English")
    # explicit LABEL= wins over the domain field
    assert {d.domain for d in load_documents([f"all={f}"], progress=False)} == {"all"}


def test_jsonl_errors_name_the_line_and_field(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{not json}\n')
    with pytest.raises(MfggufError, match=r"bad.jsonl:2 is not valid JSON"):
        load_documents([str(f)], progress=False)
    g = tmp_path / "nofield.jsonl"
    g.write_text('{"content": "x"}\n')
    with pytest.raises(MfggufError, match=r"no field 'text' \(has: content\); pass --text-field"):
        load_documents([str(g)], progress=False)
    assert load_documents([str(g)], text_field="content", progress=False)[0].text == "x"
    h = tmp_path / "latin.jsonl"
    h.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(MfggufError, match=r"latin.jsonl:2 is not UTF-8"):
        load_documents([str(h)], progress=False)


def test_hf_json_local_files_through_datasets(tmp_path):
    d = tmp_path / "hfdata"
    d.mkdir()
    for i in range(2):
        (d / f"part{i}.jsonl").write_text("\n".join(
            json.dumps({"text": f"document {i}.{j}: " + _real_text("this.py")[:300], **({"domain": "tagged"} if j == 0 else {})})
            for j in range(3)) + "\n")
    docs = load_documents([f"hf:json:{d}/*.jsonl"], progress=False)
    assert len(docs) == 6
    assert Counter(x.domain for x in docs) == {"tagged": 2, "hfdata": 4}
    assert docs[1].text.startswith("document 0.1: ")
    labelled = load_documents([f"web=hf:json:{d}/part1.jsonl"], progress=False)
    assert len(labelled) == 3 and {x.domain for x in labelled} == {"web"}
    with pytest.raises(MfggufError, match="no files match"):
        load_documents([f"hf:json:{d}/nothing*.jsonl"], progress=False)


def test_explicit_label_and_sanitised_names(tmp_path):
    f = tmp_path / "weird name!.txt"
    f.write_text("some text\n")
    assert load_documents([str(f)], progress=False)[0].domain == "weird_name"
    assert load_documents([f"my.label={f}"], progress=False)[0].domain == "my.label"


def test_bad_sources_raise_one_line_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    binary = tmp_path / "binonly"
    binary.mkdir()
    (binary / "x.bin").write_bytes(b"\0\1\2" * 100)
    cases = {
        str(tmp_path / "missing.txt"): "does not exist",
        str(empty): "contains no text",
        str(binary): r"no readable text \(1 binary or non-UTF-8 files skipped\)",
        f"{tmp_path}/*.nothing": "matches no files",
    }
    for src, msg in cases.items():
        with pytest.raises(MfggufError, match=msg) as e:
            load_documents([src], progress=False)
        assert "\n" not in str(e.value)
        assert src in str(e.value)
    with pytest.raises(MfggufError, match="no sources"):
        load_documents([], progress=False)


def test_cap_applies_per_domain_across_sources(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text(_real_text("argparse.py"))
    docs = load_documents([f"x={a}", f"x={a}", f"y={a}"], max_chars_per_domain=30_000, progress=False)
    chars = Counter()
    for d in docs:
        chars[d.domain] += len(d.text)
    assert 29_000 < chars["x"] <= 30_000 and 29_000 < chars["y"] <= 30_000


def test_builtin_corpus_domains_capped_and_deterministic():
    cap = 400_000
    docs, stats = load_corpus(["builtin"], max_chars_per_domain=cap, progress=False)
    chars, count = Counter(), Counter()
    for d in docs:
        chars[d.domain] += len(d.text)
        count[d.domain] += 1
    expected = {"python", "english"} | ({"c"} if Path(sysconfig.get_paths()["include"], "Python.h").is_file() else set())
    assert set(chars) == expected
    for dom in expected:
        assert cap * 0.95 < chars[dom] <= cap, dom
        assert count[dom] >= 30, dom  # enough units for held-out and partitions
    assert all(len(d.text) <= MAX_DOC_CHARS for d in docs)
    by = {dom: "".join(d.text for d in docs if d.domain == dom) for dom in expected}
    assert by["python"].count("\ndef ") > 100 and "import " in by["python"]
    files = _stdlib_py_files(STDLIB)
    assert len(files) > 300
    assert not any({"site-packages", "test", "tests"} & set(f.relative_to(STDLIB).parts) for f in files)
    assert by["english"].count(" the ") > 1000  # prose
    if "c" in by:
        assert "#define" in by["c"] and "PyObject" in by["c"]
    again = load_documents(["builtin"], max_chars_per_domain=cap, progress=False)
    assert again == docs
    assert stats[0]["docs"] == len(docs)
