"""Small benchmark files in llama-perplexity's three layouts, written from real English (pydoc's topics)."""

from __future__ import annotations

import random
import re
from pathlib import Path

from mfgguf.runtime.choice.tasks import write_multiple_choice


def sentences(n: int) -> list[str]:
    """`n` sentences of real prose, 8 to 24 words each, none holding a double quote (the CSV's quote)."""
    import pydoc_data.topics

    text = " ".join(" ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)).split())
    out = [s for s in re.split(r"(?<=[.!?])\s+", text) if 8 <= len(s.split()) <= 24 and '"' not in s]
    assert len(out) >= n, len(out)
    return out[:n]


def halves(s: str) -> tuple[str, str]:
    w = s.split()
    return " ".join(w[: len(w) // 2]), " ".join(w[len(w) // 2:])


def write_hellaswag(path: Path, n: int = 12) -> Path:
    """Six lines a task: a sentence's first half, the index of its true second half among four halves."""
    rng, sents, lines = random.Random(0), sentences(4 * n), []
    for i in range(n):
        ctx, true = halves(sents[i])
        wrong = [halves(s)[1] for s in rng.sample(sents[n:], 3)]
        gold = rng.randrange(4)
        endings = wrong[:gold] + [true] + wrong[gold:]
        lines += [f"Reading: {ctx}", str(gold), *endings]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_winogrande(path: Path, n: int = 10) -> Path:
    """A header, then `index,sentence,option1,option2,answer`: a sentence's word blanked, it and another offered;
    sentences holding commas are quoted, as in llama.cpp's file."""
    rng, rows = random.Random(1), ["index,sentence,option1,option2,answer"]
    for i, s in enumerate(sentences(n + 10)[10:]):
        w = s.split()
        k = rng.choice([j for j in range(1, len(w) - 4) if w[j].isalpha()] or [1])  # words follow the blank
        other = rng.choice([x for x in w if x != w[k] and x.isalpha()] or ["thing"])
        sentence = " ".join(w[:k] + ["_"] + w[k + 1:])
        answer = rng.choice((1, 2))
        a, b = (w[k], other) if answer == 1 else (other, w[k])
        sentence = f'"{sentence}"' if "," in sentence else sentence
        rows.append(f"{i},{sentence},{a},{b},{answer}")
    path.write_text("\n".join(rows) + "\n")
    return path


def write_multiple_choice_file(path: Path, n: int = 8) -> Path:
    """Questions of three to five answers (one task of five: llama-perplexity needs -np 5 for it)."""
    rng, sents, tasks = random.Random(2), sentences(5 * n + 20)[20:], []
    for i in range(n):
        q, true = halves(sents[i])
        k = 5 if i == 3 else 3 + i % 2
        answers = [halves(s)[1] for s in rng.sample(sents[n:], k - 1)]
        right = rng.randrange(k)
        answers.insert(right, true)
        tasks.append((f"Question: {q}", answers, right))
    write_multiple_choice(path, tasks)
    return path


WRITERS = {"hellaswag": write_hellaswag, "winogrande": write_winogrande, "multiple-choice": write_multiple_choice_file}
NAMES = {"hellaswag": "hellaswag.txt", "winogrande": "winogrande.csv", "multiple-choice": "mc.bin"}
