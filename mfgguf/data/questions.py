"""Facts a document states in a form a question can be asked of: the raw material of closed-book questions.

A question asks what the training text itself answers, one construction per kind of text:
  - `man-name`: a manual page's NAME line, `ls - list directory contents`, asks for the summary of `ls`;
  - `man-option`: an option line and the first sentence of its description (`-a, --all` / `do not ignore...`),
    asked of the page the NAME line of the same document names;
  - `python-doc`: a Python function or method with a docstring asks for the docstring's first sentence, by the
    function's name and parameters (`Class.name` for a method).
Each `Fact` is a question's context, its true ending (one line) and its subject (the command or function: no
distractor is drawn from a fact of the same subject). Text of other kinds (prose, C headers) gives none: a question
made of it would not have one answer the text states. question_sets.py draws the distractors and writes the sets.

Example:
    >>> document_facts("NAME\\nls - list directory contents\\nSYNOPSIS\\n...")[0].ending
    'list directory contents'
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

KINDS = ("man-name", "man-option", "python-doc")
MIN_ENDING, MAX_ENDING = 12, 200  # characters of a true ending: shorter says too little, longer is not a summary
MAX_OPTIONS = 8  # option facts of one page at most (a page of hundreds of options would crowd out the others)
_END = re.compile(r"[\w)\]'\"`][.!?](?=\s|$)")  # where a sentence may end
_DANGLING = {"a", "an", "the", "for", "of", "to", "and", "or", "with", "in", "on", "by", "as", "from", "see", "is"}
MAX_SIGNATURE = 80  # characters of a function's shown parameters before they are cut with "..."


@dataclass(frozen=True)
class Fact:
    kind: str  # one of KINDS
    subject: str  # the command or function asked about
    context: str  # the question: what the endings continue
    ending: str  # the true ending, one line


def document_facts(text: str) -> list[Fact]:
    """Every fact of one document's text, in text order: its manual page's, or its Python functions'."""
    return _man_facts(text) if text.startswith("NAME\n") else _python_facts(text)


def normal(ending: str) -> str:
    """An ending as endings are compared for sameness: lower case, single spaces, no final full stop."""
    return " ".join(ending.lower().split()).rstrip(".")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _first_sentence(lines: list[str]) -> str | None:
    """The first sentence of a paragraph's lines (all of it where no sentence ends in it), or None where it is not
    a summary: too short or long, an example, a heading, a field list."""
    text = _one_line(" ".join(lines))
    text = next((text[: m.end()] for m in _END.finditer(text)  # after a word, not "." alone or "e.g."
                 if not re.search(r"(?:\be\.g|\bi\.e|\bcf|\bvs|\b[A-Za-z])\.$", text[: m.end()])), text)
    if not MIN_ENDING <= len(text) <= MAX_ENDING or not text[0].isalpha() or text.endswith(":"):
        return None
    if ">>>" in text or text.startswith((":", "@")) or "::" in text or " - " in text or "$ " in text:
        return None  # an example, a field list, a NAME line's dash, a shell prompt
    if re.search(r"\[[a-z]{2}\]", text):
        return None  # a roff character escape the page's source left unresolved
    words = text.rstrip(".!?").split()
    if len(words) < 3 or words[-1].lower() in _DANGLING:
        return None  # "Shortcut for": a description the page goes on with elsewhere
    return text


# ---- manual pages ---------------------------------------------------------------------------------------

_NAME_LINE = re.compile(r"^(\S.*?)\s+-{1,2}\s+(\S.*)$")
_SECTION = re.compile(r"^[A-Z][A-Z0-9 ,/()-]+$")  # a roff section heading: OPTIONS, SEE ALSO
_FLAG = re.compile(r"^\s*(-{1,2}[A-Za-z0-9?][\w.-]*(?:[= ]?[\[<]?[\w.|,=-]*[\]>]?)?"
                   r"(?:,\s*-{1,2}[A-Za-z0-9?][\w.-]*(?:[= ]?[\[<]?[\w.|,=-]*[\]>]?)?)*)\s*$")


def _man_facts(text: str) -> list[Fact]:
    """The NAME fact of a page (stripped by study.py's roff_to_text), and a few of its options'."""
    lines = text.split("\n")
    m = _NAME_LINE.match(lines[1].strip()) if len(lines) > 1 else None
    if not m:
        return []
    names, summary = _one_line(m.group(1)), _first_sentence([m.group(2)])
    if not summary or len(names) > 80:
        return []
    facts = [Fact("man-name", names, f"In the manual, the summary line of {names} is:", summary)]
    command = names.split(",")[0].strip()
    for flag, description in _options(lines[2:])[:MAX_OPTIONS]:
        facts.append(Fact("man-option", f"{command} {flag}",
                          f"In the manual of {command}, the option {flag} is described as:", description))
    return facts


def _options(lines: list[str]) -> list[tuple[str, str]]:
    """(flag line, its description's first sentence) for each option whose flags stand on a line of their own and
    whose description follows on the next lines; each flag line once."""
    out, seen = [], set()
    for i, line in enumerate(lines):
        m = _FLAG.match(line)
        if not m or len(line) > 60:
            continue
        para = []
        for nxt in lines[i + 1: i + 6]:
            if _FLAG.match(nxt) or _SECTION.match(nxt.strip()) or not nxt.strip() or re.fullmatch(r"\d+m", nxt):
                break
            para.append(nxt)
        flag = _one_line(m.group(1))
        sentence = _first_sentence(para) if para else None
        if sentence and flag not in seen:
            seen.add(flag)
            out.append((flag, sentence))
    return out


# ---- Python ---------------------------------------------------------------------------------------------

_DEF = re.compile(r'^([ \t]*)(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*\(((?:[^()]|\((?:[^()]|\([^()]*\))*\))*)\)'
                  r'[ \t]*(?:->[^\n]{0,200}?)?:[ \t]*\n(?:[ \t]*\n)*[ \t]+[rRuU]?("""|\'\'\')(.*?)\4', re.M | re.S)
_BLOCK = re.compile(r"^([ \t]*)(class|def|async[ \t]+def)[ \t]+(\w+)")


def _python_facts(text: str) -> list[Fact]:
    """A fact for each function or method whose docstring opens with a summary sentence (dunders left out)."""
    facts = []
    for m in _DEF.finditer(text):
        indent, name, params, doc = m.group(1), m.group(2), m.group(3), m.group(5)
        if name.startswith("__"):
            continue
        owner = _owner(text[: m.start()], len(indent.expandtabs()))
        shown = _parameters(params, method=bool(owner))
        summary = _first_sentence(_paragraph(doc))
        if shown is None or owner is None or summary is None:
            continue
        qual = f"{owner}.{name}" if owner else name
        facts.append(Fact("python-doc", qual, f"In the Python code, the docstring of {qual}({shown}) begins:",
                          summary))
    return facts


def _paragraph(doc: str) -> list[str]:
    """A docstring's first paragraph, as lines."""
    out = []
    for line in doc.strip().split("\n"):
        if not line.strip():
            break
        out.append(line)
    return out


def _parameters(params: str, method: bool) -> str | None:
    """The parameters' names as a call shows them (`a, *args, key, **kw`; a method's self or cls left out), or None
    where they do not parse as Python's."""
    try:
        body = ast.parse(f"def f({params}): pass").body
    except (SyntaxError, ValueError):
        return None
    if len(body) != 1:
        return None
    fn = body[0]
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    if method and names[:1] in (["self"], ["cls"]):
        names = names[1:]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        names.append("*")
    names += [x.arg for x in a.kwonlyargs] + (["**" + a.kwarg.arg] if a.kwarg else [])
    shown = ", ".join(names)
    return shown if len(shown) <= MAX_SIGNATURE else shown[: MAX_SIGNATURE].rsplit(",", 1)[0] + ", ..."


def _owner(before: str, indent: int) -> str | None:
    """"" for a function at the top of its module, its class's name for a method, None where it is neither (a nested
    function, or its enclosing block cut off by the document's start)."""
    if indent == 0:
        return ""
    for line in reversed(before.split("\n")):
        if not line.strip() or line.lstrip().startswith(("#", "@", ")")):
            continue
        depth = len(line.expandtabs()) - len(line.lstrip())
        if depth >= indent:
            continue
        m = _BLOCK.match(line)
        return m.group(3) if m and m.group(2) == "class" else None
    return None


__all__ = ["Fact", "KINDS", "document_facts", "normal"]
