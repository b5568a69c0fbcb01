"""Every figure listed in docs/results/figures.jsonl is on its page and comes from its results file.

One JSON object a line: `page` (README.md or a page under docs/), `figure` (the text as the page prints it; line
breaks and repeated spaces on the page do not matter), `cpu` (the machine it was measured on) and `source` (a file
under docs/results/). The figure's number is its first number (`N min N s` counts as seconds), or `number` when
given (a string as printed). The source holds it in one of three ways:
  `value_key`: a dotted key of a JSON object, or of the first JSONL line whose keys match `where`; a list of two
               keys is their ratio. The value, times `scale` when given, rounds to the number as it is printed.
  `ratio`:     two literals of the source's text whose quotient rounds to the number as printed.
  `match`:     a literal of the source's text (whitespace-normalised) holding a number that rounds to it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIST = ROOT / "docs" / "results" / "figures.jsonl"
NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?")
MIN_S = re.compile(r"(\d+) min (\d+) s")


def _entries() -> list[dict]:
    return [json.loads(line) for line in LIST.read_text(encoding="utf-8").splitlines() if line.strip()]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _printed(entry: dict) -> tuple[float, float, str]:
    """The number the page prints: its value, half its last digit (the rounding it allows) and its text."""
    if "number" in entry:
        text = entry["number"]
    elif m := MIN_S.search(entry["figure"]):
        return int(m.group(1)) * 60 + int(m.group(2)), 0.5, m.group(0)
    else:
        text = NUMBER.search(entry["figure"]).group()
    digits = text.split(".")[1] if "." in text else ""
    return float(text.replace(",", "")), 0.5 * 10 ** -len(digits) + 1e-9, text


def _records(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]  # a run's stray log line is not a record
    return [json.loads(path.read_text(encoding="utf-8"))]


def _lookup(record: dict, key: str):
    value = record
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def _source_value(entry: dict, path: Path) -> float:
    where = entry.get("where", {})
    matching = [r for r in _records(path) if all(r.get(k) == v for k, v in where.items())]
    assert matching, f"no record of {entry['source']} matches {where}"
    keys = entry["value_key"]
    if isinstance(keys, list):
        value = _lookup(matching[0], keys[0]) / _lookup(matching[0], keys[1])
    else:
        value = _lookup(matching[0], keys)
    return float(value) * entry.get("scale", 1)


def _name(entry: dict) -> str:
    return f"{entry['page']}: {entry['figure'][:60]}"


ENTRIES = _entries()


def test_the_list_is_well_formed():
    for entry in ENTRIES:
        assert {"page", "figure", "cpu", "source"} <= set(entry), entry
        assert sum(k in entry for k in ("value_key", "ratio", "match")) == 1, entry
        assert entry["source"].startswith("docs/results/"), entry
    keys = [(e["page"], e["figure"], e.get("number")) for e in ENTRIES]
    assert len(set(keys)) == len(keys), "an entry is listed twice"


@pytest.mark.parametrize("entry", ENTRIES, ids=_name)
def test_the_figure_is_on_its_page_and_in_its_source(entry):
    page, source = ROOT / entry["page"], ROOT / entry["source"]
    assert entry["figure"] in _flat(page.read_text(encoding="utf-8")), f"{entry['page']} no longer prints it"
    assert source.is_file(), entry["source"]
    value, tolerance, text = _printed(entry)
    if "match" in entry:
        found = _flat(source.read_text(encoding="utf-8"))
        assert entry["match"] in found, f"{entry['source']} does not hold {entry['match']!r}"
        held = [float(n.replace(",", "")) for n in NUMBER.findall(entry["match"])]
        assert any(abs(n - value) <= tolerance for n in held), f"{entry['match']!r} holds no {text}"
        return
    if "ratio" in entry:
        found = _flat(source.read_text(encoding="utf-8"))
        a, b = entry["ratio"]
        assert a in found and b in found, f"{entry['source']} does not hold {a} and {b}"
        got = float(a.replace(",", "")) / float(b.replace(",", ""))
    else:
        got = _source_value(entry, source)
    assert abs(got - value) <= tolerance, f"{entry['source']} gives {got}, the page prints {text}"


# a measured figure of the README: a ratio, a share, a time, a size (a number and its unit, outside code blocks)
README_FIGURE = re.compile(r"(?<![\w.])[-+~]?\d[\d,]*(?:\.\d+)?(?:x\b|%| min \d+ s\b| s\b| MB\b| GB\b| GiB\b| tokens/s\b|B\b)")
DESIGN = {"8 GB"}  # the laptop the tool is for: a target, not a measurement


def test_every_figure_the_readme_prints_is_listed():
    text = _flat(re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S))
    listed = [e["figure"] for e in ENTRIES if e["page"] == "README.md"]
    for m in README_FIGURE.finditer(text):
        if m.group() in DESIGN:
            continue
        assert any(m.start() >= i and m.end() <= i + len(f) for f in listed
                   for i in (k.start() for k in re.finditer(re.escape(f), text))), (
            f"README.md prints {m.group()!r} ({text[max(0, m.start() - 40): m.end() + 20]!r}) with no entry in"
            " docs/results/figures.jsonl: add one naming its results file")
