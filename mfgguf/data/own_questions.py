"""`mfgguf import-questions`: a user's own questions (JSONL) in llama-perplexity's HellaSwag layout.

One question a line: `{"question": "...", "choices": ["...", "...", "...", "..."], "answer": 2}`: the question's
text, four endings (the layout's count), the index of the right one (0-3). Line breaks inside a text become spaces
(the layout is one line a text); blank lines are skipped. Anything else is refused with the file and line: one line
saying what is wrong there. Written into a RUN's questions/ folder, `eval` scores the set on every final model
beside the questions `mfgguf questions` made (question_sets.py); any file is scored for one model with
`mfgguf perplexity MODEL --hellaswag FILE`.

Example:
    >>> import_questions(Path("mine.jsonl"), Path("RUN/questions/mine.txt"))
    {'questions': 40, 'out': 'RUN/questions/mine.txt'}
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mfgguf.data.question_sets import ENDINGS, SETS, write_hellaswag
from mfgguf.errors import MfggufError

_BREAKS = re.compile(r"\s*[\r\n]+\s*")


def import_questions(jsonl: Path, out: Path, *, force: bool = False) -> dict:
    """Convert JSONL questions (one object a line: "question", "choices" (four texts), "answer" (the right one's
    index, 0-3)) into llama-perplexity's HellaSwag layout at OUT. OUT in a RUN's questions/ folder (RUN/questions/
    NAME.txt) makes `eval` score them on every final model, paired against the base; any OUT is scored for one model
    by `mfgguf perplexity MODEL --hellaswag OUT`. A bad line is refused with its file and line number."""
    jsonl, out = Path(jsonl), Path(out)
    if out.parent.name == "questions" and out.stem in SETS:
        raise MfggufError(f"{out} is the name of a set `mfgguf questions` writes; name your set otherwise")
    if out.exists() and not force:
        raise MfggufError(f"{out} exists; pass --force to replace it, or another OUT")
    tasks = read_questions(jsonl)
    write_hellaswag(out, tasks)
    return {"questions": len(tasks), "out": str(out)}


def read_questions(path: Path) -> list[dict]:
    """The questions of a JSONL file, each {question, choices, answer}; one line naming the file and line on bad
    input."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise MfggufError(f"cannot read {path}: {e.strerror}; pass a JSONL file of questions") from None
    tasks = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if line.strip():
            tasks.append(_question(line, f"{path}:{n}"))
    if not tasks:
        raise MfggufError(f"{path} holds no question; pass one JSON object a line with question, choices and answer")
    return tasks


def _question(line: bytes, where: str) -> dict:
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise MfggufError(f"{where} is not UTF-8 text") from None
    except ValueError:
        raise MfggufError(f"{where} is not valid JSON; each line must be one object with question, choices and"
                          " answer") from None
    if not isinstance(obj, dict):
        raise MfggufError(f"{where} is a JSON {type(obj).__name__}, not an object with question, choices and answer")
    missing = [k for k in ("question", "choices", "answer") if k not in obj]
    if missing:
        raise MfggufError(f"{where} has no {', '.join(missing)} (has: {', '.join(map(str, obj)) or 'nothing'})")
    question, choices, answer = obj["question"], obj["choices"], obj["answer"]
    if not isinstance(question, str) or not question.strip():
        raise MfggufError(f"{where}: question is not a non-empty text")
    if not isinstance(choices, list) or len(choices) != ENDINGS:
        got = f"{len(choices)} choices" if isinstance(choices, list) else f"a {type(choices).__name__}"
        raise MfggufError(f"{where}: choices is {got}; give a list of {ENDINGS} texts (the HellaSwag layout's count)")
    if not all(isinstance(c, str) and c.strip() for c in choices):
        raise MfggufError(f"{where}: every choice must be a non-empty text")
    choices = [_BREAKS.sub(" ", c).strip() for c in choices]
    if len(set(choices)) != len(choices):
        raise MfggufError(f"{where}: two choices are the same text; give {ENDINGS} different endings")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < ENDINGS:
        raise MfggufError(f"{where}: answer is {json.dumps(answer)}; give the right choice's index, 0 to"
                          f" {ENDINGS - 1}")
    return {"question": _BREAKS.sub(" ", question).strip(), "choices": choices, "answer": answer}


__all__ = ["import_questions", "read_questions"]
