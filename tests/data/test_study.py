"""The `study` corpus: real text from what installs here, in at least four domains, and man pages
turned from roff into text."""

from __future__ import annotations

import pytest

from mfgguf.data.sources import load_documents
from mfgguf.data.study import STUDY_DOMAINS, roff_to_text


def test_roff_to_text_golden():
    src = "\n".join([
        '.\\" a comment line',
        ".TH LS 1",
        ".SH NAME",
        "ls \\- list directory contents",
        ".SH DESCRIPTION",
        "List information about the \\fIFILE\\fPs (the current directory by default).",
        ".TP",
        ".B \\-a, \\-\\-all",
        "do not ignore entries starting with \\(aq.\\(aq",
        ".PP",
        "",
    ])
    assert roff_to_text(src) == ("NAME\nls - list directory contents\nDESCRIPTION\n"
                                 "List information about the FILEs (the current directory by default).\n"
                                 "-a, --all\ndo not ignore entries starting with '.'\n")
    assert roff_to_text(".so man1/other.1\n") == ""


def test_study_corpus_has_four_real_domains():
    docs = load_documents(["study"], max_chars_per_domain=30_000, progress=False)
    chars = {}
    for d in docs:
        chars[d.domain] = chars.get(d.domain, 0) + len(d.text)
    # man pages may be missing on a stripped-down image; the other four ship with the set-up
    assert {"python", "english", "c", "cpp"} <= set(chars) <= set(STUDY_DOMAINS), chars
    assert all(v >= 20_000 for v in chars.values()), chars
    by = {dom: " ".join(d.text for d in docs if d.domain == dom) for dom in chars}
    assert "def " in by["python"] and "#include" in by["c"] and "#include" in by["cpp"]
    assert "template" in by["cpp"] or "namespace" in by["cpp"]
    assert "def " not in by["english"][:5000] or by["english"].count(" the ") > 50  # prose, not code


@pytest.mark.parametrize("label", ["corpus"])
def test_study_label_renames_every_domain(label):
    docs = load_documents([f"{label}=study"], max_chars_per_domain=5_000, progress=False)
    assert {d.domain for d in docs} == {label}
