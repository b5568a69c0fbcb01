"""The knowledge study: does training on your documents make the model know them, and which method teaches a small
model most while forgetting least? Closed-book questions about the training documents (`mfgguf questions`,
docs/evaluation.md "Closed-book questions about the training text") on SmolLM2, two domains that give questions.

Layout: --out FILE is the study's JSON lines (one a finished run); its runs live in --work (default: FILE without its
suffix), and --summarise writes FILE's .md and .png beside it.
  0. WORK/template, once: `import-base`, `prepare study` (label partition, every study domain, a small cap so the
     trained domains' shards are a few tens of thousands of tokens; prepare's seed fixed) and `questions`; every
     run is a hard-linked copy of it (stages replace files, never write into them). The base is assembled (f16)
     and scored once on the validation questions (RUN/questions/train-valid.txt): WORK/base/.
  1. Phase 1, the epochs: WORK/p1-e<E> for E in --epochs, the experts of --domains each `train-expert --tokens
     E x its shard's tokens` at the first seed, `sync`, `assemble` (ridge, top-1, f16), then `perplexity --hellaswag
     train-valid.txt`, paired against the base. Validation perplexity is each expert's own record (its domain's
     validation split). The choice rule (choose_epochs): the highest validation-question accuracy, ties to fewer
     epochs; where the largest of --epochs is the choice and above the one before it (still climbing), --extend
     (16) runs too and joins the choice. Epochs count windows of the shard: exact once the trainer's sampler walks
     every window once an epoch (until then it draws windows at random, and E epochs are E shards' tokens).
  2. Phase 2, the methods at the chosen epochs: WORK/p2-e<E>-s<S> for S in --seeds; the first seed's starts as a
     hard-linked copy of phase 1's run at E (the same experts, trained at that seed), later seeds train theirs. Then
     `mfgguf eval --seed S`: continued pretraining, one LoRA and a LoRA per domain at the experts' training FLOPs
     (eval's imported-base baselines), every model scored on the questions about the training documents
     (train-test.txt) and about the test documents (test.txt), test perplexity, and HellaSwag with --hellaswag.
A run already in FILE is not run again and each stage is skipped where its output exists. Every line records the
CPUs that worked on its run (model name and class: AVX2-only, AVX-512 BF16, AMX). Before anything runs, each run is
priced on this CPU (train_s: the training FLOPs at this class's measured rate; scoring: llama.cpp's per model) and a
plan with a run longer than --sitting-hours is refused in one line; within the hours, the runs go in order and the
script stops before a run that would not end inside them (run it again to go on).

    python scripts/studies/knowledge_study.py --out knowledge-study.jsonl --dry-run   # the plan and its cost
    python scripts/studies/knowledge_study.py --out knowledge-study.jsonl             # as many runs as fit
    python scripts/studies/knowledge_study.py --out knowledge-study.jsonl --summarise
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import protocol_study as ps  # noqa: E402  (its verb runner, template copy, CPU record and eval figures)

STUDY_DOMAINS = ps.STUDY_DOMAINS
QUESTION_DOMAINS = ("man", "python")  # the study domains `mfgguf questions` asks about (data/questions.py)
BASELINES = "flop,lora,lora-domain"
SETS = ("questions-train-test", "questions-test", "hellaswag")  # eval's benchmark names, what phase 2 scores
NAMES = {"moe": "MoE top-1 (ridge)", "flop": "continued pretraining, FLOP-matched",
         "lora": "one LoRA r16, FLOP-matched",
         "lora-domain": "a LoRA per domain", "base": "the base"}
CHARS_PER_TOKEN = 3.3  # SmolLM2's tokenizer on the study corpus's man and python text (a capped prepare here)
# questions a set, by tokens, where the template is not made yet: a training-half set about 0.42 a thousand
# training tokens of the two domains, the test set about 1.4 a thousand of their test tokens (prepare + questions
# at a 400,000-character cap: 70 and 50)
Q_PER_KTOKEN, QTEST_PER_KTOKEN = 0.42, 1.4


@dataclass(frozen=True)
class Speed:
    """What a class of CPU does, on 2 cores: the expert step's FLOP/s at SmolLM2's shape (the baselines' steps
    priced the same), seconds a HellaSwag task of an f16 SmolLM2 (llama-perplexity; a question task is about half:
    a shorter context and endings), llama.cpp's tokens/s scoring perplexity, and seconds to assemble and load one
    model."""
    flops: float
    hellaswag_s: float
    score_tokens_s: float
    model_s: float


# AVX2-only EPYC: the expert step at 103-105 tokens/s in fp32 (docs/benchmarks.md), a HellaSwag task about 3x the
# AVX-512 one, assembling about 2 min; AVX-512 BF16 EPYC: the protocol study's rate and task; AMX: no expert step
# measured at this shape, priced as AVX-512 BF16 (the demo ran as fast on both)
SPEEDS = {"AVX2-only": Speed(7.3e10, 0.6, 270.0, 120.0), "AVX-512 BF16": Speed(3.5e11, 0.2, 800.0, 40.0),
          "AMX": Speed(3.5e11, 0.2, 800.0, 40.0)}
PROCESS_S, SYNC_S, LAST_SYNC_S, TEMPLATE_S = 13.0, 16.0, 120.0, 90.0
ROUTED_FACTOR = ps.ROUTED_FACTOR  # the per-domain LoRAs scored through their adapters: this many models' time


def cpu_class(c: dict) -> str:
    """AMX, AVX-512 BF16 or AVX2-only: which of SPEEDS prices a run on the CPU `c` (mfgguf.machine.cpu())."""
    flags = set(c.get("flags", ()))
    return "AMX" if "amx_tile" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else "AVX2-only"


def read_json(path: Path) -> dict | None:
    """A RUN's record (or a report), read under the current names where an earlier mfgguf wrote it (run/legacy.py)."""
    from mfgguf.run.legacy import OLD_RUN_KEYS, renamed

    return renamed(json.loads(path.read_text()), OLD_RUN_KEYS if path.name == "run.json" else None) \
        if path.is_file() else None


def load_rows(path: Path) -> list[dict]:
    """The study's lines, the last one of each run."""
    rows = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.strip():
            r = json.loads(line)
            rows[r["run"]] = r
    return list(rows.values())


def recipe(a) -> dict:
    """What every line of one study shares: a study resumed with another would mix two."""
    return {"base": a.base, "domains": a.domains, "max_chars_per_domain": a.max_chars_per_domain,
            "test_frac": a.test_frac, "valid_frac": a.valid_frac, "expert_ff": a.expert_ff, "lr": a.lr,
            "shared": a.shared, "shared_lr_scale": a.shared_lr_scale, "rounds": a.rounds, "baselines": a.baselines,
            "full_lrs": a.full_lrs, "lora_lrs": a.lora_lrs, "max_tokens": a.max_tokens}


def same_recipe(row: dict) -> dict:
    """A line's recipe under the current option names (lines written before --test-frac had its name)."""
    from mfgguf.run.legacy import OLD_RUN_KEYS, renamed

    return renamed(row.get("recipe") or {}, OLD_RUN_KEYS)


# ---- the choice rule ---------------------------------------------------------------------------------------


def choose_epochs(rows: list[dict], epochs: list[int], extend: int | None) -> tuple[int | None, bool]:
    """(the epochs phase 2 trains at, whether --extend must run first) from phase 1's lines: the highest
    validation-question accuracy, ties to fewer epochs; None while a run of `epochs` is missing. The extension is
    due where the largest of `epochs` is the choice and strictly above the next smaller (still climbing) and it
    has not run; once run, it joins the choice."""
    acc = {r["epochs"]: r["valid_questions"]["accuracy"] for r in rows if r.get("phase") == 1}
    if any(e not in acc for e in epochs):
        return None, False
    best, top = pick_epochs({e: acc[e] for e in epochs}), max(epochs)
    below = [e for e in epochs if e < top]
    climbing = best == top and bool(below) and acc[top] > acc[max(below)]
    if extend and climbing and extend not in acc:
        return None, True
    return pick_epochs({e: acc[e] for e in [*epochs, *([extend] if extend in acc else [])]}), False


def pick_epochs(acc: dict[int, float]) -> int:
    """The epochs of the highest accuracy, the fewest among equals (max keeps the first it meets)."""
    return max(sorted(acc), key=lambda e: acc[e])


# ---- the cost of a run -------------------------------------------------------------------------------------


def expert_flops_per_token(a, template: Path) -> float:
    """An expert step's FLOPs a token (mfgguf/flops.py): the template's trunk once imported, else the base's shape."""
    from mfgguf.config import shared_tensor_names
    from mfgguf.flops import expert_step_flops

    cfg, _ = ps.plan_config(a, template)
    if cfg is None:  # SmolLM2's shape, so a plan is priced where the base cannot be read
        from mfgguf.base.importer import trunk_config
        from mfgguf.base.source import BaseShape

        cfg = trunk_config(BaseShape(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ff=1536, vocab_size=49152,
                                     rope_theta=1e5, norm_eps=1e-5, ctx_len=8192, tied=True), expert_ff=a.expert_ff)
    return expert_step_flops(cfg, shared_tensor_names(cfg, a.shared)).total


def sizes(a, template: Path) -> dict:
    """{"shard", "test", "valid": {domain: tokens}, "questions": {set: count}, "measured": bool}: the template's,
    else estimated from the character cap."""
    info = read_json(template / "run.json")
    if info is not None:
        own = {next(iter(s["domains"])): int(s["tokens"]) for s in info["shards"] if len(s["domains"]) == 1}
        shard = {d: own[d] for d in a.domains}
        test = {d: int(v["tokens"]) for d, v in info["test"].items()}
        valid = {d: int(v["tokens"]) for d, v in (info.get("valid") or {}).items()}
    else:
        c = a.max_chars_per_domain / CHARS_PER_TOKEN
        shard = {d: int(c * (1 - a.test_frac) * (1 - a.valid_frac)) for d in a.domains}
        test = {d: int(c * a.test_frac) for d in STUDY_DOMAINS}
        valid = {d: int(c * (1 - a.test_frac) * a.valid_frac) for d in STUDY_DOMAINS}
    summ = read_json(template / "questions" / "summary.json")
    if summ is not None:
        questions = {s: sum(sum(k.values()) for k in v.values()) for s, v in summ["sets"].items()}
    else:
        asked = [d for d in a.domains if d in QUESTION_DOMAINS]
        questions = {"train-valid": int(Q_PER_KTOKEN * sum(shard[d] for d in asked) / 1000),
                     "train-test": int(Q_PER_KTOKEN * sum(shard[d] for d in asked) / 1000),
                     "test": int(QTEST_PER_KTOKEN * sum(test[d] for d in asked) / 1000)}
    return {"shard": shard, "test": test, "valid": valid, "questions": questions, "measured": info is not None}


def training_s(a, sp: Speed, per_token: float, shard: dict, epochs: int) -> tuple[float, float]:
    """(the MoE's training FLOPs, its seconds: every expert in turn, its processes and syncs)."""
    flops = sum(epochs * shard[d] for d in a.domains) * per_token
    syncs = (a.rounds - 1) * SYNC_S + LAST_SYNC_S if a.shared != "none" else 0.0
    return flops, flops / sp.flops + len(a.domains) * a.rounds * PROCESS_S + syncs


def phase1_cost(a, sp: Speed, per_token: float, sz: dict, epochs: int, first: bool) -> float:
    """A phase-1 run: its experts, assembling the MoE, the validation questions; the first also makes the template
    and scores the base."""
    _, train = training_s(a, sp, per_token, sz["shard"], epochs)
    score = sp.model_s + sz["questions"]["train-valid"] * sp.hellaswag_s / 2
    return train + score + (TEMPLATE_S + score if first else 0.0)


def phase2_cost(a, sp: Speed, per_token: float, sz: dict, epochs: int, train_moe: bool) -> float:
    """A phase-2 run: the MoE's experts (a later seed's), eval's baselines at the MoE's FLOPs (each LR of their
    grids), and every model scored: test and validation perplexity, both question sets, HellaSwag."""
    from mfgguf.eval.baselines.imported import GRID

    flops, train = training_s(a, sp, per_token, sz["shard"], epochs)
    base = a.baselines.split(",")
    grid = {"full": len(a.full_lrs.split(",")) if a.full_lrs else len(GRID["full"]),
            "lora": len(a.lora_lrs.split(",")) if a.lora_lrs else len(GRID["lora"])}
    runs = grid["full"] * ("flop" in base) + grid["lora"] * bool({"lora", "lora-domain"} & set(base))
    procs = runs + len(a.domains) * ("lora-domain" in base)
    baselines = (runs + ("lora-domain" in base)) * flops / sp.flops + procs * PROCESS_S
    models = 2 + ("flop" in base) + ("lora" in base) + ROUTED_FACTOR * ("lora-domain" in base)  # + base + MoE
    tokens = sum(min(a.max_tokens, t) for t in sz["test"].values())
    tasks = (sz["questions"]["train-test"] + sz["questions"]["test"]) / 2 + (a.hellaswag_tasks if a.hellaswag else 0)
    valid = sum(min(a.max_tokens, t) for t in sz["valid"].values()) / sp.score_tokens_s  # the MoE's router choice
    score = models * (sp.model_s + tokens / sp.score_tokens_s + tasks * sp.hellaswag_s) + valid
    return (train if train_moe else 0.0) + baselines + score


# ---- the plan -------------------------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    phase: int
    epochs: int
    seed: int
    seconds: float
    note: str = ""
    provisional: bool = False  # phase 2 priced before phase 1 has chosen its epochs: not refused yet


def plan(a, rows: list[dict], template: Path, sp: Speed) -> tuple[list[Run], list[str]]:
    """The runs not yet in the study's lines, in order, each priced; and notes (a conditional run, phase 2 priced
    before phase 1 has chosen)."""
    per_token, sz = expert_flops_per_token(a, template), sizes(a, template)
    done, notes, runs = {r["run"] for r in rows}, [], []
    first = not (a.work / "base" / "valid-questions.json").is_file()
    for e in a.epochs:
        if f"p1-e{e}" not in done:
            runs.append(Run(f"p1-e{e}", 1, e, a.seeds[0], phase1_cost(a, sp, per_token, sz, e, first)))
            first = False
    chosen, extend = choose_epochs(rows, a.epochs, a.extend)
    if extend:
        runs.append(Run(f"p1-e{a.extend}", 1, a.extend, a.seeds[0], phase1_cost(a, sp, per_token, sz, a.extend, False),
                        f"{max(a.epochs)} epochs still climbing"))
    elif chosen is None and a.extend:
        notes.append(f"p1-e{a.extend} runs only if {max(a.epochs)} epochs is still climbing: about"
                     f" {phase1_cost(a, sp, per_token, sz, a.extend, False) / 3600:.2f} h, and phase 2 at"
                     f" {a.extend} epochs about {phase2_cost(a, sp, per_token, sz, a.extend, True) / 3600:.2f} h"
                     " a seed")
    e2 = chosen if chosen is not None else max(a.epochs)
    if chosen is None:
        notes.append(f"phase 2 priced at {e2} epochs, the most phase 1 can choose without the extension; refused"
                     " only once phase 1 has chosen")
    for s in a.seeds:
        if not any(r.get("phase") == 2 and r["seed"] == s for r in rows):
            reuse = s == a.seeds[0]
            runs.append(Run(f"p2-e{e2}-s{s}", 2, e2, s, phase2_cost(a, sp, per_token, sz, e2, not reuse),
                            "experts of p1-e%d, eval only" % e2 if reuse else "", provisional=chosen is None))
    return runs, notes


def print_plan(a, runs: list[Run], notes: list[str], sp_name: str, template: Path) -> None:
    from mfgguf.machine import cpu

    c, sz = cpu(), sizes(a, template)
    per_token = expert_flops_per_token(a, template)
    print(f"# CPU: {c['model']} ({sp_name}, {c['cores']} cores); {SPEEDS[sp_name].flops:.2e} training FLOP/s,"
          f" {per_token / 1e6:.1f} MFLOP an expert token")
    print(f"# shards ({'measured' if sz['measured'] else 'estimated from the cap'}): "
          + ", ".join(f"{d} {t:,} tokens" for d, t in sz["shard"].items())
          + "; questions: " + ", ".join(f"{k} {v}" for k, v in sz["questions"].items()))
    for r in runs:
        tok = sum(r.epochs * t for t in sz["shard"].values())
        print(f"# {r.name}: phase {r.phase}, {r.epochs} epoch{'s' * (r.epochs > 1)} ({tok:,} expert tokens),"
              f" seed {r.seed}: about"
              f" {r.seconds / 3600:.2f} h" + (f" ({r.note})" if r.note else "")
              + (" OVER THE LIMIT here: refused if phase 1 chooses these epochs"
                 if r.provisional and r.seconds > a.sitting_hours * 3600 else ""))
    for n in notes:
        print(f"# note: {n}")
    print(f"# about {sum(r.seconds for r in runs) / 3600:.2f} h in all; limit {a.sitting_hours:g} h a run")


def check_fits(a, runs: list[Run]) -> None:
    """One line and stop where a run of the plan would not end within --sitting-hours on this CPU."""
    over = [r for r in runs if r.seconds > a.sitting_hours * 3600 and not r.provisional]
    if over:
        r = over[0]
        sys.exit(f"knowledge_study: {r.name} would take about {r.seconds / 3600:.2f} h on this CPU, more than"
                 f" --sitting-hours {a.sitting_hours:g}; lower --max-chars-per-domain or --epochs")


# ---- the runs -------------------------------------------------------------------------------------------------


def make_template(a, template: Path, dry: bool = False) -> None:
    """WORK/template: the base imported, the study corpus prepared into it and its questions, once."""
    log = a.work / "study.log"
    if not (template / "modules" / "trunk.json").is_file():
        ps.mfgguf("import-base", a.base, "--out", template, "--expert-ff", a.expert_ff, "--force", log=log, dry=dry)
    if not (template / "run.json").is_file():
        ps.mfgguf("prepare", "study", "--out", template, "--experts", len(STUDY_DOMAINS), "--partition", "label",
                  "--max-chars-per-domain", a.max_chars_per_domain, "--test-frac", a.test_frac,
                  "--valid-frac", a.valid_frac, "--seed", 0, "--no-progress", log=log, dry=dry)
    if not (template / "questions" / "summary.json").is_file():
        ps.mfgguf("questions", template, "--per-domain", a.per_domain, "--no-progress", log=log, dry=dry)


def question_tasks(template: Path, name: str) -> int | str:
    """The tasks of a question set (its .jsonl's lines); a placeholder before the template is made."""
    f = template / "questions" / f"{name}.jsonl"
    return sum(1 for line in f.read_text().splitlines() if line.strip()) if f.is_file() else f"<{name} tasks>"


def epoch_tokens(run: Path, epochs: int, shard: int) -> int:
    """`--tokens` for `epochs` passes over a shard: rounded up to whole steps, since a run trains tokens // (batch x
    ctx) steps and a shard's size rounded down would leave the last windows of its last pass untrained."""
    from mfgguf.options import TrainOptions
    from mfgguf.train.experts.config import expert_config

    trunk = read_json(run / "modules" / "trunk.json")
    if trunk is None:  # a dry run before the template exists
        return epochs * shard
    ec = expert_config(trunk, TrainOptions())
    step = ec.tc.batch_size * ec.cfg.ctx_len
    return -(-epochs * shard // step) * step


def train_experts(a, run: Path, ids: dict[str, int], shard: dict[str, int], epochs: int, seed: int, dry: bool) -> None:
    """Each domain's expert for `epochs` x its shard's tokens, round by round, a sync after each where shared."""
    log = a.work / "study.log"
    for k in range(1, a.rounds + 1):
        for d, i in ids.items():
            meta = read_json(run / "modules" / f"expert_{i:03d}.json")
            if meta is None or int(meta.get("round", 1)) < k:
                ps.mfgguf("train-expert", run, "--expert", i, "--tokens", epoch_tokens(run, epochs, shard[d]), "--lr", a.lr,
                          "--shared", a.shared, "--shared-lr-scale", a.shared_lr_scale, "--rounds", a.rounds,
                          "--seed", seed, "--no-progress", log=log, dry=dry)
        trunk = read_json(run / "modules" / "trunk.json") or {}
        if a.shared != "none" and int(trunk.get("syncs") or 0) < k:
            ps.mfgguf("sync", run, "--experts", ",".join(map(str, ids.values())), "--no-progress", log=log, dry=dry)


def score_valid_questions(a, run: Path, model: Path, out: Path, paired_with: Path | None, dry: bool,
                          assemble: tuple = ()) -> None:
    """Assemble `model` (f16) where missing, then score it on the validation questions into `out`."""
    log, tv = a.work / "study.log", a.work / "template" / "questions" / "train-valid.txt"
    if out.is_file():
        return
    if not model.is_file():
        ps.mfgguf("assemble", run, "--out", model, "--quant", "f16", *assemble, "--force", "--quiet", log=log, dry=dry)
    pair = ("--paired-with", paired_with) if paired_with else ()
    ps.mfgguf("perplexity", model, "--hellaswag", tv, "--hellaswag-tasks", question_tasks(a.work / "template",
              "train-valid"), "--out", out, "--force", *pair, log=log, dry=dry)


def do_run(a, r, rows: list[dict], dry: bool) -> dict | None:
    """One run's stages (each only where its output is missing), then its line (None with `dry`)."""
    template, run = a.work / "template", a.work / r.name
    ids, shard = ps.shard_ids(template, a.domains), sizes(a, template)["shard"]
    src = a.work / f"p1-e{r.epochs}" if r.phase == 2 and r.seed == a.seeds[0] else template
    if dry and not run.is_dir():
        print(f"# {r.name}: hard-linked copy of {src.name}")
    elif not dry:
        ps.copy_template(src, run)
        ps.note_machine(run)
    if r.phase == 1 or r.seed != a.seeds[0]:
        train_experts(a, run, ids, shard, r.epochs, r.seed, dry)
    if r.phase == 1:
        base = a.work / "base"
        if not dry:
            base.mkdir(exist_ok=True)
        if not (dry and getattr(a, "base_planned", False)):  # a dry run prints the base's scoring once
            score_valid_questions(a, template, base / "base.gguf", base / "valid-questions.json", None, dry,
                                  ("--experts", "none"))
            a.base_planned = True
        score_valid_questions(a, run, run / "moe.gguf", run / "valid-questions.json", base / "valid-questions.json",
                              dry, ("--top-k", 1, "--router", "ridge", "--experts", ",".join(map(str, ids.values()))))
    else:
        rep = read_json(run / "eval" / "report.json")
        if rep is None or a.hellaswag and "hellaswag" not in (rep.get("general") or {}):
            lrs = [x for opt, v in (("--full-lrs", a.full_lrs), ("--lora-lrs", a.lora_lrs)) if v for x in (opt, v)]
            bench = ("--hellaswag", a.hellaswag, "--hellaswag-tasks", a.hellaswag_tasks) if a.hellaswag else ()
            ps.mfgguf("eval", run, "--routers", "ridge", "--top-k", "1", "--quants", "", "--max-tokens", a.max_tokens,
                      "--baselines", a.baselines, "--seed", r.seed, *lrs, *bench, log=a.work / "study.log", dry=dry)
    if dry:
        return None
    row = phase1_row(a, r, run, ids, shard) if r.phase == 1 else phase2_row(a, r, run, ids)
    if a.prune:
        for f in [*run.glob("*.gguf"), *(run / "eval").rglob("*.gguf"), *(run / "eval").rglob("*.safetensors")]:
            f.unlink()
    return row


def machines(run: Path) -> list[dict]:
    """The CPUs that worked on a run, each with its class."""
    return [{**m, "class": cpu_class(m)} for m in read_json(run / "machines.json") or []]


def by_domain(result: dict, template: Path, name: str) -> dict:
    """{domain: accuracy} of a question result ({"task_ids", "right"}), by its set's .jsonl."""
    doms = [json.loads(x)["domain"] for x in (template / "questions" / f"{name}.jsonl").read_text().splitlines() if x]
    per: dict[str, list[int]] = {}
    for i, ok in zip(result["task_ids"], result["right"]):
        per.setdefault(doms[int(i)], []).append(int(ok))
    return {d: sum(v) / len(v) for d, v in sorted(per.items())}


def phase1_row(a, r, run: Path, ids: dict[str, int], shard: dict[str, int]) -> dict:
    """A phase-1 line: the MoE's validation-question accuracy paired against the base, each expert's validation
    perplexity on its own domain (its record) and the base's there."""
    import math

    template = a.work / "template"
    mine = read_json(run / "valid-questions.json")["benchmarks"]["hellaswag"]
    base = read_json(a.work / "base" / "valid-questions.json")["benchmarks"]["hellaswag"]
    p = mine["paired_with"]
    metas = {d: read_json(run / "modules" / f"expert_{i:03d}.json") for d, i in ids.items()}
    return {"phase": 1, "run": r.name, "epochs": r.epochs, "seed": r.seed,
            "tokens": {d: int(metas[d]["tokens_seen"]) for d in ids}, "shard_tokens": shard,
            "trained_epochs": {d: metas[d].get("epochs") for d in ids},
            "train_flops": sum(int(metas[d]["tokens_seen"]) for d in ids) * expert_flops_per_token(a, template),
            "valid_questions": {"accuracy": mine["accuracy"], "correct": mine["correct"], "tasks": mine["tasks"],
                                "base_accuracy": base["accuracy"],
                                "by_domain": by_domain(mine, template, "train-valid"),
                                **{k: p[k] for k in ("points", "low", "high", "mcnemar_p")}},
            "valid_ppl": {d: math.exp(m["validation_loss"][d]) for d, m in metas.items()},
            "valid_ppl_base": {d: math.exp(m["trunk_validation_loss"][d]) for d, m in metas.items()},
            "wall_s": sum(float(m.get("wall_s") or 0.0) for m in metas.values()),
            "machines": machines(run), "recipe": recipe(a),
            "headline": {"valid_questions": round(mine["accuracy"], 4), "points": round(p["points"], 2)}}


def phase2_row(a, r, run: Path, ids: dict[str, int]) -> dict:
    """A phase-2 line from eval's report: per method (the MoE, each baseline, the base) its training FLOPs, test
    perplexity (trained domains, the others), and each benchmark's accuracy, paired against the base and the MoE."""
    from mfgguf.eval.general import BASE_MODELS
    from mfgguf.eval.measure import mixed
    from mfgguf.runtime.choice.paired import paired

    rep = read_json(run / "eval" / "report.json")
    res, flops, trained = rep["results"], rep["flops"]["models"], list(ids)
    labels = {"moe": next(n for n, m in rep["models"].items() if m["kind"] == "moe" and n in res and m["top_k"] == 1)}
    labels |= {m["baseline"]: n for n, m in rep["models"].items() if m["kind"] == "dense" and n in res}
    labels["base"] = next(n for n in BASE_MODELS if n in res)
    plans = {p["key"]: p for p in (rep.get("base_baselines") or {}).get("plans") or []}
    methods = {}
    for m, label in labels.items():
        doms = res[label]["domains"]
        rest = {d: v for d, v in doms.items() if d not in trained}
        methods[m] = {"label": label, "flops": 0.0 if m == "base" else
                      flops["moe (trunk + every expert)" if m == "moe" else label]["flops"],
                      "ppl_test_trained": mixed({d: doms[d] for d in trained})["ppl"],
                      "ppl_test_untrained": mixed(rest)["ppl"] if rest else None,
                      "ppl_test": {d: v["ppl"] for d, v in doms.items()}, **ps.general_figures(rep, label),
                      **({"lr": plans[m]["lr"]} if m in plans else {})}
        for name, g in (rep.get("general") or {}).items():  # the MoE against this method, paired over the tasks
            v = g.get("verdicts") or {}
            if m != "moe" and label in v and labels["moe"] in v:
                methods[m][name]["moe_minus"] = {k: x for k, x in paired(v[labels["moe"]], v[label]).items()
                                                 if k in ("points", "low", "high", "mcnemar_p")}
    return {"phase": 2, "run": r.name, "epochs": r.epochs, "seed": r.seed, "trained_domains": trained,
            "methods": methods, "eval_wall_s": rep.get("wall_s"), "machines": machines(run), "recipe": recipe(a),
            "questions": read_json(a.work / "template" / "questions" / "summary.json")["sets"],
            "headline": {m: round(v.get("questions-train-test", {}).get("accuracy", float("nan")), 4)
                         for m, v in methods.items()}}


# ---- the summary ----------------------------------------------------------------------------------------------


def spread(vals: list[float]) -> dict:
    return {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def verdict(points: list[float], intervals: list[list[float]], up: str = "gain", down: str = "loss") -> str:
    """A paired difference over seeds: `up` / `down` only where its mean exceeds the seeds' spread (max - min) and
    every seed's paired 95% interval is on that side of zero; "one seed" with fewer than two."""
    if len(points) < 2:
        return "one seed"
    s = spread(points)
    width = s["max"] - s["min"]
    if s["mean"] > width and all(lo > 0 for lo, _ in intervals):
        return up
    if -s["mean"] > width and all(hi < 0 for _, hi in intervals):
        return down
    return "within the noise"


def summarize(rows: list[dict]) -> dict:
    """{"phase1": {epochs: figures}, "chosen", "phase2": {"epochs", "seeds", "methods": {m: {benchmark: {"accuracy",
    "points", "intervals", "verdict", "vs_moe"?}, "ppl_test_trained", "ppl_test_untrained"}}}}."""
    p1 = sorted((r for r in rows if r.get("phase") == 1), key=lambda r: r["epochs"])
    phase1 = {r["epochs"]: {**r["valid_questions"], "valid_ppl": r["valid_ppl"], "valid_ppl_base": r["valid_ppl_base"]}
              for r in p1}
    # the rule over every phase-1 run, the extension included
    chosen = pick_epochs({e: f["accuracy"] for e, f in phase1.items()}) if phase1 else None
    p2 = [r for r in rows if r.get("phase") == 2]
    out = {"phase1": phase1, "chosen": chosen}
    if not p2:
        return out
    e2 = max({r["epochs"] for r in p2}, key=lambda e: sum(r["epochs"] == e for r in p2))  # the epochs most seeds ran
    p2 = sorted((r for r in p2 if r["epochs"] == e2), key=lambda r: r["seed"])
    methods = {}
    for m in [m for m in NAMES if all(m in r["methods"] for r in p2)]:
        vs = [r["methods"][m] for r in p2]
        f = {"ppl_test_trained": spread([v["ppl_test_trained"] for v in vs])}
        if all(v.get("ppl_test_untrained") is not None for v in vs):
            f["ppl_test_untrained"] = spread([v["ppl_test_untrained"] for v in vs])
        for b in SETS:
            if not all(b in v for v in vs):
                continue
            g = [v[b] for v in vs]
            pts, iv = [x["points"] for x in g], [[x["low"], x["high"]] for x in g]
            f[b] = {"accuracy": spread([x["accuracy"] for x in g]), "tasks": g[0]["tasks"], "points": spread(pts),
                    "intervals": iv, "verdict": verdict(pts, iv) if m != "base" else ""}
            if all("moe_minus" in x for x in g):
                mp = [x["moe_minus"]["points"] for x in g]
                mi = [[x["moe_minus"]["low"], x["moe_minus"]["high"]] for x in g]
                f[b]["vs_moe"] = {"points": spread(mp), "intervals": mi, "verdict": verdict(mp, mi, "MoE ahead",
                                                                                             "MoE behind")}
        methods[m] = f
    out["phase2"] = {"epochs": e2, "seeds": [r["seed"] for r in p2], "methods": methods}
    return out


def _pm(s: dict, fmt: str = "{:+.1f}") -> str:
    return f"{fmt.format(s['mean'])} ({fmt.format(s['min'])} to {fmt.format(s['max'])})" if s["n"] > 1 \
        else fmt.format(s["mean"])


def markdown(rows: list[dict], summ: dict) -> str:
    cpus = sorted({f"{m['model']} ({m['class']}, {m['cores']} cores)" for r in rows for m in r.get("machines", [])})
    r0 = rows[0]
    L = ["# Knowledge study: closed-book questions about the training documents", "",
         f"Base {r0['recipe']['base']}; trained domains {', '.join(r0['recipe']['domains'])}; recipe "
         + ", ".join(f"{k} {v}" for k, v in r0["recipe"].items() if k not in ("base", "domains")) + ".",
         f"CPU: {'; '.join(cpus) or 'not recorded'}.", "", "## Phase 1: epochs (validation questions, one seed)", "",
         "| epochs | questions right | accuracy | - base, points | paired 95% interval | validation ppl (each"
         " expert, its domain) |", "|---:|---:|---:|---:|---:|---|"]
    for e, f in summ["phase1"].items():
        ppl = ", ".join(f"{d} {v:.3f} (base {f['valid_ppl_base'][d]:.3f})" for d, v in f["valid_ppl"].items())
        L.append(f"| {e}{' (chosen)' if e == summ['chosen'] else ''} | {f['correct']}/{f['tasks']} |"
                 f" {100 * f['accuracy']:.1f}% | {f['points']:+.1f} | {f['low']:+.1f} to {f['high']:+.1f} | {ppl} |")
    L += ["", "Choice: the highest validation-question accuracy, ties to fewer epochs."]
    p2 = summ.get("phase2")
    if p2:
        L += ["", f"## Phase 2: methods at {p2['epochs']} epochs (seeds {', '.join(map(str, p2['seeds']))})", "",
              "Accuracy: mean over seeds (min to max). The difference to the base is paired over the questions, each"
              " seed's 95% interval listed; \"gain\" / \"loss\" only where the mean exceeds the seeds' spread and"
              " every seed's interval excludes zero. The MoE's difference to each method is judged the same way."]
        for b in SETS:
            ms = {m: f[b] for m, f in p2["methods"].items() if b in f}
            if not ms:
                continue
            L += ["", f"### {b} ({next(iter(ms.values()))['tasks']} tasks)", "",
                  "| method | accuracy, % | - base, points | each seed's interval | verdict | MoE - method, points |"
                  " MoE verdict |", "|---|---:|---:|---|---|---:|---|"]
            for m, f in ms.items():
                acc = {k: 100 * v for k, v in f["accuracy"].items() if k != "n"} | {"n": f["accuracy"]["n"]}
                iv = "; ".join(f"{lo:+.1f} to {hi:+.1f}" for lo, hi in f["intervals"]) if m != "base" else ""
                vm = f.get("vs_moe")
                L.append(f"| {NAMES[m]} | {_pm(acc, '{:.1f}')} | {_pm(f['points']) if m != 'base' else ''} | {iv} |"
                         f" {f['verdict']} | {_pm(vm['points']) if vm else ''} | {vm['verdict'] if vm else ''} |")
        L += ["", "### Test perplexity", "", "| method | trained domains | untrained domains |", "|---|---:|---:|"]
        for m, f in p2["methods"].items():
            u = f.get("ppl_test_untrained")
            L.append(f"| {NAMES[m]} | {_pm(f['ppl_test_trained'], '{:.3f}')} | {_pm(u, '{:.3f}') if u else ''} |")
    L += ["", "![question accuracy against epochs and by method](knowledge-study.png)"]
    return "\n".join(L) + "\n"


def plot(summ: dict, path: Path) -> None:
    """Left: validation-question accuracy against epochs (the base dotted). Right: each method's accuracy on the
    questions about the training documents and about the test documents, mean over seeds, bars min to max."""
    from mfgguf.plots import pyplot, save_figure

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    p1 = summ["phase1"]
    if p1:
        es = sorted(p1)
        left.plot(es, [100 * p1[e]["accuracy"] for e in es], marker="o", label="MoE, validation questions")
        left.axhline(100 * p1[es[0]]["base_accuracy"], color="gray", lw=0.8, linestyle=":", label="the base")
        if summ["chosen"] is not None:
            left.axvline(summ["chosen"], color="green", lw=0.8, linestyle="--", label="chosen")
        left.set_xscale("log", base=2)
        left.set_xticks(es, [str(e) for e in es])
        left.minorticks_off()
    left.set(xlabel="epochs of each shard", ylabel="question accuracy, %", title="phase 1: epochs")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    p2 = summ.get("phase2")
    if p2:
        ms = list(p2["methods"])
        for j, b in enumerate(("questions-train-test", "questions-test")):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(ms))]
            vals = [p2["methods"][m].get(b, {}).get("accuracy") for m in ms]
            ys = [100 * v["mean"] if v else 0.0 for v in vals]
            err = [[100 * (v["mean"] - v["min"]) if v else 0 for v in vals],
                   [100 * (v["max"] - v["mean"]) if v else 0 for v in vals]]
            right.bar(xs, ys, width=0.38, yerr=err, capsize=3,
                      label="about training documents" if j == 0 else "about test documents")
        right.set_xticks(range(len(ms)), [NAMES[m] for m in ms], rotation=20, ha="right", fontsize=8)
        right.set(ylabel="question accuracy, %", title=f"phase 2: methods at {p2['epochs']} epochs")
        right.legend(fontsize=8)
        right.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_figure(fig, path, plt)


def write_summary(out: Path) -> dict:
    rows = load_rows(out)
    if not rows:
        sys.exit(f"knowledge_study: {out} holds no finished run yet")
    summ = summarize(rows)
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    md.write_text(markdown(rows, summ).replace("(knowledge-study.png)", f"({png.name})"))
    plot(summ, png)
    return {"rows": len(rows), "chosen": summ["chosen"], "table": str(md), "plot": str(png)}



def parse(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    names = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("knowledge-study.jsonl"), help="the study's JSON lines")
    ap.add_argument("--work", type=Path, default=None, help="the runs' folder (default: --out without its suffix)")
    ap.add_argument("--base", default="smollm2", help="any `import-base` source")
    ap.add_argument("--domains", type=names, default=list(QUESTION_DOMAINS), help="the trained domains")
    ap.add_argument("--epochs", type=ints, default=[1, 2, 4, 8], help="phase 1's epochs of each shard")
    ap.add_argument("--extend", type=int, default=16, help="the epochs phase 1 adds where its largest is still"
                    " climbing (0: none)")
    ap.add_argument("--seeds", type=ints, default=[1, 2], help="phase 2's seeds; phase 1 trains at the first")
    ap.add_argument("--max-chars-per-domain", type=int, default=120000, help="prepare's cap: the shards' size (the"
                    " smallest that gives each question set questions of both domains)")
    ap.add_argument("--test-frac", type=float, default=0.2, help="prepare's test share (the test questions'"
                    " documents)")
    ap.add_argument("--valid-frac", type=float, default=0.25, help="prepare's validation share (0.1 left the untrained English domain under one perplexity window at the default cap)")
    ap.add_argument("--per-domain", type=int, default=250, help="questions --per-domain")
    ap.add_argument("--expert-ff", type=int, default=768)
    ap.add_argument("--lr", type=float, default=1e-3, help="the experts' peak LR")
    ap.add_argument("--shared", default="attn", help="train-expert --shared")
    ap.add_argument("--shared-lr-scale", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=1, help="sync rounds (one epoch of a small shard is a few steps)")
    ap.add_argument("--baselines", default=BASELINES, help="eval --baselines")
    ap.add_argument("--full-lrs", default="3e-4", help="eval --full-lrs (empty: eval's grid of three; the default is"
                    " the LR the protocol study's validation chose on SmolLM2)")
    ap.add_argument("--lora-lrs", default="3e-3", help="eval --lora-lrs (empty: eval's grid of three)")
    ap.add_argument("--max-tokens", type=int, default=8192, help="eval --max-tokens")
    ap.add_argument("--hellaswag", type=Path, default=None, help="eval --hellaswag: a HellaSwag file in"
                    " llama-perplexity's layout (not in the repository)")
    ap.add_argument("--hellaswag-tasks", type=int, default=400)
    ap.add_argument("--sitting-hours", type=float, default=3.0, help="the longest a run may take on this CPU; runs"
                    " go in order while they fit in this many hours")
    ap.add_argument("--prune", action="store_true", help="delete a finished run's GGUFs and baseline weights")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, its commands and each run's cost")
    ap.add_argument("--summarise", action="store_true", help="write the summary (.md, .png) from --out alone")
    a = ap.parse_args(argv)
    a.work = (a.work or a.out.with_suffix("")).resolve()
    a.extend = a.extend or None
    bad = [d for d in a.domains if d not in STUDY_DOMAINS]
    if bad or not a.domains or not a.epochs or not a.seeds:
        sys.exit(f"knowledge_study: --domains of {', '.join(STUDY_DOMAINS)}, and at least one epoch and seed")
    return a


def main(argv=None) -> None:
    a = parse(argv)
    if a.summarise:
        print(json.dumps(write_summary(a.out)))
        return
    from mfgguf.machine import cpu

    rows, template = load_rows(a.out), a.work / "template"
    other = next((r for r in rows if same_recipe(r) != recipe(a)), None)
    if other is not None:
        sys.exit(f"knowledge_study: {a.out} holds a run of another recipe ({other['run']}); use another --out")
    sp_name = cpu_class(cpu())
    runs, notes = plan(a, rows, template, SPEEDS[sp_name])
    if a.dry_run:
        print_plan(a, runs, notes, sp_name, template)
        check_fits(a, runs)
        make_template(a, template, dry=True)
        for r in runs:
            do_run(a, r, rows, dry=True)
        return
    check_fits(a, runs)
    a.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    while runs:
        r = runs[0]
        left = a.sitting_hours * 3600 - (time.perf_counter() - t0)
        if r.seconds > left:
            print(f"# stopping before {r.name} (about {r.seconds / 3600:.2f} h, {left / 3600:.2f} h left); run again"
                  " to go on", flush=True)
            return
        make_template(a, template)
        ps.check_splits(template, a.max_tokens)  # eval's own refusal of a split shorter than a window, before training
        row = do_run(a, r, rows, dry=False)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
        print(json.dumps({"run": row["run"], **row.get("headline", {})}), flush=True)
        runs, _ = plan(a, rows, template, SPEEDS[sp_name])  # phase 1's choice may change what comes next
    if rows:
        print(json.dumps(write_summary(a.out)))


if __name__ == "__main__":
    main()
