"""`mfgguf questions RUN`: closed-book questions about a RUN's own documents, in llama-perplexity's HellaSwag layout.

Perplexity on held-out text moves with style as much as with knowledge; a question the training text answers asks
whether the model learnt what the documents say. This reads the RUN's sources again, as `prepare` read them (the
sources, character cap, seed and split fractions run.json records), and checks that the validation and test splits
it draws are the RUN's own, text for text, so every question's document is in the split the RUN has it in. Each
document gives its facts (questions.py: a manual page's NAME line and options, a Python function's docstring); a
question is a fact's context, its true ending and three distractors: true endings of other facts of the same kind
and domain, none of the same subject, no two alike, drawn from the same side of the split (a training question's
distractors are training text too, so no ending is right for being familiar). The right ending's place is drawn.
Three sets, in RUN/questions/:
  - train-valid.txt: about half of the training documents (by document): read by choices, never by a final score;
  - train-test.txt: the other half: what the model learnt, scored once a final model by `eval`;
  - test.txt: the test split's documents, which no model trained on: what generalises.
Each set also as .jsonl (question, choices, answer, domain, kind, document: the import format plus where it comes
from) and summary.json counts them. Every draw follows the seed, so the same RUN and seed give the same files.

Example:
    >>> make_questions(Path("RUN"))            # RUN/questions/{train-valid,train-test,test}.txt
    >>> question_sets(Path("RUN"))             # {"questions-train-test": ..., "questions-test": ...}
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from pathlib import Path

from mfgguf.data.partition import split_three
from mfgguf.data.questions import document_facts, normal
from mfgguf.data.sources import load_corpus
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, RunInfo, atomic_path, write_json

SETS = ("train-valid", "train-test", "test")
SCORED = ("train-test", "test")  # what eval scores of them; train-valid is for choices
PREFIX = "questions-"  # a question set's benchmark name in eval: questions-<file stem>
PER_DOMAIN = 250  # questions a set holds of one domain at most (eval scores each on every final model)
PER_DOCUMENT = 6  # facts one document gives a set at most, so no few long documents make a set
GENERIC = 3  # an ending that many facts of a pool share is generic ("display help and exit"): not asked
ENDINGS = 4  # the layout's


def make_questions(run: Path, sources: list[str] | None = None, *, text_field: str = "text",
                   per_domain: int = PER_DOMAIN, seed: int | None = None, force: bool = False,
                   progress: bool = True) -> dict:
    """Write closed-book questions about RUN's documents: RUN/questions/train-valid.txt and train-test.txt (the
    training documents, split by document into halves: validation for choices, test scored once by `eval`) and
    test.txt (the test split's documents, which no model trained on), in llama-perplexity's HellaSwag layout, each
    also as .jsonl, and summary.json. SOURCES default to the ones run.json records (pass them where their paths
    moved); the splits drawn from them must be the RUN's own, text for text, or nothing is written. A question is a
    manual page's NAME summary or option, or a Python function's docstring summary, with three distractors of the
    same domain and kind; text of other kinds gives none. PER_DOMAIN caps each set's questions of a domain; SEED
    (default: the RUN's) draws them. Returns summary.json."""
    rd = RunDir(run)
    info = rd.run_info()
    if per_domain < 1:
        raise MfggufError(f"--per-domain {per_domain} asks nothing; pass 1 or more")
    out = rd.root / "questions"
    if not force and any((out / f"{s}.txt").exists() for s in SETS):
        raise MfggufError(f"{out} already holds questions; pass --force to make them again")
    sources = list(sources or info.sources)
    docs, _ = load_corpus(sources, text_field=text_field, max_chars_per_domain=info.max_chars_per_domain,
                          progress=progress)
    domains = [d.domain for d in docs]
    train, valid, test = split_three(domains, info.test_frac, info.valid_frac, info.seed)
    _check_splits(rd, info, docs, train, valid, test, sources)
    seed = info.seed if seed is None else seed
    train, test = [int(i) for i in train], [int(i) for i in test]
    facts = {i: document_facts(docs[i].text) for i in [*train, *test]}
    halves = _halves(train, domains, facts, random.Random(f"halves {seed}"))
    asked = {"train-valid": (halves[0], train), "train-test": (halves[1], train), "test": (test, test)}
    sets = {name: build_set(about, pool, facts, domains, per_domain, random.Random(f"{name} {seed}"))
            for name, (about, pool) in asked.items()}
    for name, tasks in sets.items():
        write_hellaswag(out / f"{name}.txt", tasks)
        _write_utf8(out / f"{name}.jsonl", "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tasks))
    summary = {"seed": seed, "per_domain": per_domain, "sources": sources,
               "sets": {name: _counts(tasks) for name, tasks in sets.items()},
               "documents": {name: len({t["document"] for t in tasks}) for name, tasks in sets.items()}}
    write_json(out / "summary.json", summary)
    return summary


def build_set(asked: list[int], pool: list[int], facts: dict[int, list], domains: list[str], per_domain: int,
              rng: random.Random) -> list[dict]:
    """Questions about the documents `asked`, their distractors from the true endings of the documents `pool` (the
    same side of the split): at most PER_DOCUMENT a document, `per_domain` a domain; each a dict of the import
    format (question, choices, answer) with its domain, kind and document."""
    endings: dict[tuple, dict[str, tuple[str, set]]] = defaultdict(dict)  # (domain, kind) -> normal -> (text, subjects)
    shared: Counter = Counter()  # (domain, kind, normal ending): how many facts end so
    contexts: dict[str, set[str]] = defaultdict(set)  # a context -> the normal endings it has in the pool
    for i in pool:
        for f in facts[i]:
            key, n = (domains[i], f.kind), normal(f.ending)
            endings[key].setdefault(n, (f.ending, set()))[1].add(f.subject)
            shared[(*key, n)] += 1
            contexts[f.context].add(n)
    by_domain: dict[str, list[tuple[int, object]]] = defaultdict(list)
    for i in asked:
        fit = [f for f in facts[i] if shared[(domains[i], f.kind, normal(f.ending))] < GENERIC
               and len(contexts[f.context]) == 1]  # one answer to the question, and not a generic one
        by_domain[domains[i]] += [(i, f) for f in rng.sample(fit, min(PER_DOCUMENT, len(fit)))]
    tasks = []
    for domain in sorted(by_domain):
        candidates, asked_contexts, kept = by_domain[domain], set(), []
        rng.shuffle(candidates)
        for i, f in candidates:
            if len(kept) == per_domain:
                break
            wrong = _distractors(f, endings[(domain, f.kind)], rng)
            if wrong is None or f.context in asked_contexts:
                continue
            asked_contexts.add(f.context)
            gold = rng.randrange(ENDINGS)
            kept.append({"question": f.context, "choices": wrong[:gold] + [f.ending] + wrong[gold:], "answer": gold,
                         "domain": domain, "kind": f.kind, "document": i})
        tasks += kept
    return tasks


def _distractors(fact, pool: dict[str, tuple[str, set]], rng: random.Random) -> list[str] | None:
    """Three true endings of other facts of the pool: none the fact's own or of its subject, no two alike."""
    own = normal(fact.ending)
    others = [n for n, (_, subjects) in pool.items() if n != own and fact.subject not in subjects]
    if len(others) < ENDINGS - 1:
        return None
    return [pool[n][0] for n in rng.sample(others, ENDINGS - 1)]


def _halves(train: list[int], domains: list[str], facts: dict, rng: random.Random) -> tuple[list[int], list[int]]:
    """The training documents that give a fact, each domain's split in two by a draw: (validation half, test half)."""
    first, second = [], []
    for d in sorted({domains[i] for i in train}):
        mine = sorted(i for i in train if domains[i] == d and facts[i])
        rng.shuffle(mine)
        first += sorted(mine[: len(mine) // 2])
        second += sorted(mine[len(mine) // 2:])
    return first, second


def _check_splits(rd: RunDir, info: RunInfo, docs, train, valid, test, sources: list[str]) -> None:
    """The splits drawn again are the RUN's: as many training documents, each split's text per domain the same."""
    def differs(what: str) -> MfggufError:
        return MfggufError(f"{', '.join(sources)} no longer give{'s' if len(sources) == 1 else ''} the documents"
                           f" {rd.root} was prepared from ({what}); pass the sources `prepare` read (and its"
                           " --text-field), or prepare the RUN again")

    if info.train_docs is not None and len(train) != int(info.train_docs):
        raise differs(f"{len(train)} training documents, run.json has {info.train_docs}")
    for idx, folder, split in ((test, rd.test_dir, "test"), (valid, rd.valid_dir, "validation")):
        if split == "validation" and not folder.is_dir():
            continue
        by_domain: dict[str, list[str]] = defaultdict(list)
        for i in idx:
            by_domain[docs[i].domain].append(docs[i].text)
        on_disk = {p.stem for p in folder.glob("*.txt")}
        if set(by_domain) != on_disk:
            raise differs(f"the {split} split's domains are {', '.join(sorted(by_domain))}, the RUN's"
                          f" {', '.join(sorted(on_disk))}")
        for d, texts in by_domain.items():
            if (folder / f"{d}.txt").read_bytes() != "\n\n".join(texts).encode("utf-8"):
                raise differs(f"domain {d}'s {split} text differs")


def write_hellaswag(path: Path, tasks: list[dict]) -> None:
    """Tasks ({question, choices: four, answer}) in the layout llama-perplexity --hellaswag reads: six lines a
    task, the context, the right ending's index, the four endings (runtime/choice/tasks.py reads it back)."""
    lines = []
    for t in tasks:
        if len(t["choices"]) != ENDINGS or any("\n" in s for s in (t["question"], *t["choices"])):
            raise MfggufError(f"a question of {path.name} is not one line with four one-line endings")
        lines += [t["question"], str(t["answer"]), *t["choices"]]
    _write_utf8(Path(path), "".join(line + "\n" for line in lines))


def _write_utf8(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(text.encode("utf-8"))


def question_sets(run: Path) -> dict[str, Path]:
    """{benchmark name: file} of the question sets in RUN/questions/ that `eval` scores: train-test, test, then
    every other .txt there (questions brought with `import-questions`); train-valid is for choices only."""
    folder = Path(run) / "questions"
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    order = {s: k for k, s in enumerate(SCORED)}
    files = sorted((p for p in files if p.stem != "train-valid" and p.stat().st_size),
                   key=lambda p: (order.get(p.stem, len(order)), p.stem))
    return {PREFIX + p.stem: p for p in files}


def _counts(tasks: list[dict]) -> dict:
    """{domain: {kind: questions}} of a set."""
    out: dict[str, dict[str, int]] = {}
    for t in tasks:
        k = out.setdefault(t["domain"], {})
        k[t["kind"]] = k.get(t["kind"], 0) + 1
    return out


__all__ = ["PER_DOMAIN", "PREFIX", "SCORED", "SETS", "build_set", "make_questions", "question_sets",
           "write_hellaswag"]
