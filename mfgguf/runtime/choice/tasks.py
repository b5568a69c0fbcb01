"""The three benchmark files llama.cpp's `llama-perplexity` reads, read the way it reads them, and which tasks it scores.

Each file becomes a list of `Task`s in file order; `selected` then picks the tasks llama-perplexity scores for a
task count, in its order (draw.py). The layouts:
  - HellaSwag (`--hellaswag`): six lines a task: the context (`activity_label: ctx`), the index of the right
    ending (0-3), the four endings. A candidate is `context + " " + ending`.
  - WinoGrande (`--winogrande`): CSV lines `index,sentence,option1,option2,answer`, the sentence with one `_`
    (quoted when it holds commas), answer 1 or 2. A candidate is the sentence with the option in place of the
    blank; only the words after the blank are scored (score.py). A header line is skipped. llama-perplexity never
    reads a file's last line (`-f` drops the file's final newline, and its CSV loop stops at a line that end of
    file cut), and neither does this reader: both score the same tasks.
  - multiple choice (`--multiple-choice`, the binary form the ARC, MMLU and TruthfulQA files for llama.cpp come in):
    uint32 task count, uint32 byte offset of each task, then each task: a string (uint32 length and bytes) for
    the question, then two answer sets (uint32 count, that many strings, as many int32 labels, 1 marking a right
    answer); the first set is scored, the second (several right answers) is read and not used, as there.
    A candidate is `question + " " + answer`. `write_multiple_choice` writes the layout.
Any file not in its layout stops with one line naming the file, the place and what was expected.

Example:
    >>> tasks = read_tasks("hellaswag", Path("hellaswag_val_full.txt"))
    >>> [t.index for t in selected("hellaswag", tasks, 3)]
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from mfgguf.errors import MfggufError
from mfgguf.runtime.choice.draw import float_draw_order, hellaswag_order

BENCHMARKS = ("hellaswag", "winogrande", "multiple-choice")
MAX_ANSWERS = 100  # llama-perplexity's own bound on a multiple-choice task's answers


@dataclass(frozen=True)
class Task:
    index: int  # the task's place in its file (0-based): what two models' results are paired by
    candidates: tuple[str, ...]  # each candidate's whole text, tokenized as one string (BOS added where the vocab adds it)
    right: tuple[int, ...]  # the candidates that are right
    bases: tuple[str, ...] = ()  # WinoGrande: each candidate's text up to and with its option (not scored)


def read_tasks(benchmark: str, path: Path) -> list[Task]:
    """Every task of the benchmark file at `path`, in file order; one line on any departure from the layout."""
    if benchmark not in BENCHMARKS:
        raise MfggufError(f"unknown benchmark {benchmark!r}; choose one of {', '.join(BENCHMARKS)}")
    path = Path(path)
    if not path.is_file():
        raise MfggufError(f"{benchmark} file not found: {path}; pass the file llama-perplexity --{benchmark} reads")
    data = path.read_bytes()
    if not data:
        raise MfggufError(f"{path} is empty; pass a {benchmark} file in llama-perplexity's layout")
    tasks = {"hellaswag": _hellaswag, "winogrande": _winogrande, "multiple-choice": _multiple_choice}[benchmark](path, data)
    if not tasks:
        raise MfggufError(f"{path} holds no {benchmark} task; pass a file in llama-perplexity's layout")
    return tasks


def selected(benchmark: str, tasks: list[Task], n: int | None) -> list[Task]:
    """The tasks llama-perplexity scores when asked for `n` of them (None: every task), in its order."""
    if n is not None and n < 1:
        raise MfggufError(f"--{benchmark}-tasks {n} scores nothing; pass 1 or more")
    if n is not None and n > len(tasks):
        raise MfggufError(f"--{benchmark}-tasks {n} is more than the file's {len(tasks)} tasks; pass"
                          f" {len(tasks)} or fewer")
    n = len(tasks) if n is None else n
    order = hellaswag_order(len(tasks), n) if benchmark == "hellaswag" else float_draw_order(len(tasks), n)
    return [tasks[i] for i in order]


def _lines(path: Path, data: bytes) -> list[str]:
    """The file's lines as llama-perplexity gets them: `-f` drops one final newline, then `getline` splits the rest
    (the last element is what follows the last newline: a line end of file cut, or nothing)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MfggufError(f"{path} is not UTF-8 text (byte {e.start}); pass a text file in llama-perplexity's"
                          " layout") from None
    return text.removesuffix("\n").split("\n")


def _hellaswag(path: Path, data: bytes) -> list[Task]:
    lines = _lines(path, data)
    if lines[-1] == "":  # getline reads a cut last line, but makes none of nothing after a final newline
        lines.pop()
    if len(lines) % 6:
        raise MfggufError(f"{path} has {len(lines)} lines, not a multiple of 6; a HellaSwag task is six lines"
                          " (context, the right ending's index 0-3, four endings)")
    tasks = []
    for i in range(0, len(lines), 6):
        gold = lines[i + 1].strip()
        if gold not in ("0", "1", "2", "3"):
            raise MfggufError(f"{path} line {i + 2}: {gold[:40]!r} is not the right ending's index 0-3; a HellaSwag"
                              " task is six lines (context, index, four endings)")
        context = lines[i]
        tasks.append(Task(i // 6, tuple(f"{context} {e}" for e in lines[i + 2: i + 6]), (int(gold),)))
    return tasks


def _winogrande(path: Path, data: bytes) -> list[Task]:
    lines = _lines(path, data)[:-1]  # its loop stops at the line end of file cut, without reading it
    tasks = []
    for n, line in enumerate(lines, 1):
        fields = _csv_fields(line)
        if fields is None or "_" not in fields[0] or fields[3].strip() not in ("1", "2"):
            if n == 1 and line.lower().startswith("index,"):
                continue  # a header
            raise MfggufError(f"{path} line {n} is not `index,sentence,option1,option2,answer` with one _ in the"
                              " sentence and answer 1 or 2; pass a WinoGrande file in llama-perplexity's layout")
        sentence, a, b, answer = fields
        first, second = sentence.split("_", 1)
        tasks.append(Task(len(tasks), (first + a + second, first + b + second), (int(answer.strip()) - 1,),
                          bases=(first + a, first + b)))
    return tasks


def _csv_fields(line: str) -> tuple[str, str, str, str] | None:
    """(sentence, option1, option2, answer) as llama-perplexity cuts them at the first four unquoted commas."""
    commas, quoted = [], False
    for i, c in enumerate(line):
        if c == '"':
            quoted = not quoted
        elif c == "," and not quoted:
            commas.append(i)
            if len(commas) == 4:
                break
    if len(commas) != 4:
        return None
    c0, c1, c2, c3 = commas
    sentence = line[c0 + 2: c1 - 1] if line[c0 + 1: c0 + 2] == '"' else line[c0 + 1: c1]
    return sentence, line[c1 + 1: c2], line[c2 + 1: c3], line[c3 + 1:]


def _multiple_choice(path: Path, data: bytes) -> list[Task]:
    def bad(what: str):
        return MfggufError(f"{path} is not a multiple-choice file in llama-perplexity's binary layout ({what});"
                           " pass the .bin its --multiple-choice reads")

    if len(data) < 4:
        raise bad("shorter than its task count")
    (n,) = struct.unpack_from("<I", data, 0)
    if n == 0 or 4 + 4 * n > len(data):
        raise bad(f"a task count of {n} and no room for its offsets")
    offsets = struct.unpack_from(f"<{n}I", data, 4)
    tasks = []
    for i, at in enumerate(offsets):
        try:
            question, at = _string(data, at)
            answers, labels, at = _answers(data, at)
            _answers(data, at)  # the second set: read, so a cut file is refused, and not scored
        except (struct.error, ValueError) as e:
            raise bad(f"task {i} at byte {offsets[i]}: {e}") from None
        if not question or not answers or not all(answers):
            raise bad(f"task {i} has an empty question or answer")
        right = tuple(j for j, v in enumerate(labels) if v == 1)
        tasks.append(Task(i, tuple(f"{question} {a}" for a in answers), right))
    return tasks


def _string(data: bytes, at: int) -> tuple[str, int]:
    (size,) = struct.unpack_from("<I", data, at)
    if at + 4 + size > len(data):
        raise ValueError(f"a string of {size} bytes runs past the end")
    return data[at + 4: at + 4 + size].decode("utf-8", "replace"), at + 4 + size


def _answers(data: bytes, at: int) -> tuple[list[str], list[int], int]:
    (n,) = struct.unpack_from("<I", data, at)
    if n > MAX_ANSWERS:
        raise ValueError(f"{n} answers, more than llama-perplexity's {MAX_ANSWERS}")
    at += 4
    answers = []
    for _ in range(n):
        a, at = _string(data, at)
        answers.append(a)
    labels = list(struct.unpack_from(f"<{n}i", data, at))
    return answers, labels, at + 4 * n


def write_multiple_choice(path: Path, tasks: list[tuple[str, list[str], int]]) -> None:
    """Write (question, answers, index of the right answer) tasks in the binary layout --multiple-choice reads."""
    from mfgguf.run.files import atomic_path

    def string(s: str) -> bytes:
        b = s.encode("utf-8")
        return struct.pack("<I", len(b)) + b

    bodies = []
    for question, answers, right in tasks:
        labels = [int(j == right) for j in range(len(answers))]
        body = string(question) + struct.pack("<I", len(answers)) + b"".join(map(string, answers))
        bodies.append(body + struct.pack(f"<{len(labels)}i", *labels) + struct.pack("<I", 0))
    at, offsets = 4 + 4 * len(tasks), []
    for b in bodies:
        offsets.append(at)
        at += len(b)
    with atomic_path(Path(path)) as tmp:
        tmp.write_bytes(struct.pack(f"<I{len(tasks)}I", len(tasks), *offsets) + b"".join(bodies))


__all__ = ["BENCHMARKS", "Task", "read_tasks", "selected", "write_multiple_choice"]
