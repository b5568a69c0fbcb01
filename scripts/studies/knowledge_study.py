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
  2. Phase 2, the methods at the chosen epochs, one run a method and seed so that each fits a sitting:
     WORK/p2-e<E>-s<S>-<method> for S in --seeds and method in moe, then each of --baselines (continued
     pretraining, one LoRA, a LoRA per domain), each from nothing but the template: the moe run trains the experts
     (the first seed's reuse phase 1's run at E where it is still on disk) and scores the MoE and the base; a
     baseline's run trains that baseline alone at the FLOPs the MoE's experts spend (`mfgguf eval --budget-flops`)
     and scores it. Every model on the questions about the training documents (train-test.txt) and about the test
     documents (test.txt), test perplexity, and HellaSwag with --hellaswag; each line keeps its models' per-task
     verdicts and the summary pairs them across runs (scripts/studies/knowledge_phase2.py).
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

import knowledge_phase2 as kp  # noqa: E402  (phase 2: its runs' cost, commands, lines and summary)
import protocol_study as ps  # noqa: E402  (its verb runner, template copy, CPU record and eval figures)
from knowledge_cost import (QUESTION_DOMAINS, SPEEDS, STUDY_DOMAINS, Speed, cpu_class,  # noqa: E402,F401
                            expert_flops_per_token, methods, phase1_cost, phase2_cost, read_json, sizes,
                            training_s)
from knowledge_summary import (NAMES, SETS, load_rows, pick_epochs, spread, summarize,  # noqa: E402,F401
                               verdict, write_summary)

BASELINES = "flop,lora,lora-domain"


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
    method: str = ""  # phase 2's: moe, flop, lora, lora-domain


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
                     f" {a.extend} epochs its longest run about"
                     f" {max(phase2_cost(a, sp, per_token, sz, a.extend, m) for m in methods(a)) / 3600:.2f} h")
    e2 = chosen if chosen is not None else max(a.epochs)
    if chosen is None:
        notes.append(f"phase 2 priced at {e2} epochs, the most phase 1 can choose without the extension; refused"
                     " only once phase 1 has chosen")
    for s in a.seeds:
        for m in methods(a):
            if f"p2-e{e2}-s{s}-{m}" not in done:
                note = f"priced training; reuses p1-e{e2}'s experts where still on disk" if m == "moe" and \
                    s == a.seeds[0] else "the MoE and the base" if m == "moe" else "at the MoE's training FLOPs"
                runs.append(Run(f"p2-e{e2}-s{s}-{m}", 2, e2, s, phase2_cost(a, sp, per_token, sz, e2, m), note,
                                provisional=chosen is None, method=m))
    notes += cuts(a, sp, per_token, sz, [r for r in runs if r.phase == 2])
    return runs, notes


def cuts(a, sp: Speed, per_token: float, sz: dict, runs: list[Run]) -> list[str]:
    """A note for each phase-2 run over --sitting-hours: by how much, and the HellaSwag tasks that would fit it."""
    from argparse import Namespace

    out, limit = [], a.sitting_hours * 3600
    for r in (r for r in runs if r.seconds > limit):
        bare = phase2_cost(Namespace(**{**vars(a), "hellaswag": None}), sp, per_token, sz, r.epochs, r.method)
        per_task = (r.seconds - bare) / a.hellaswag_tasks if a.hellaswag and a.hellaswag_tasks else 0.0
        fit = int((limit - bare) / per_task) if per_task and bare < limit else 0
        out.append(f"{r.name} is {(r.seconds - limit) / 3600:.2f} h over the limit; "
                   + (f"--hellaswag-tasks {fit} would fit it" if fit else "fewer HellaSwag tasks cannot fit it:"
                      " lower --max-chars-per-domain or --epochs"))
    return out


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
        print(f"# {r.name}: phase {r.phase}{', ' + r.method if r.method else ''}, {r.epochs}"
              f" epoch{'s' * (r.epochs > 1)} ({tok:,} expert tokens), seed {r.seed}: about"
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
    from mfgguf.run import ModuleMeta
    from mfgguf.train.experts.config import expert_config

    trunk = read_json(run / "modules" / "trunk.json")
    if trunk is None:  # a dry run before the template exists
        return epochs * shard
    ec = expert_config(ModuleMeta.from_json(trunk), TrainOptions())
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
    p1 = a.work / f"p1-e{r.epochs}"  # the first seed's MoE reuses phase 1's experts where still on disk
    src = p1 if r.method == "moe" and r.seed == a.seeds[0] and (p1 / "modules").is_dir() else template
    if dry and not run.is_dir():
        print(f"# {r.name}: hard-linked copy of {src.name}")
    elif not dry:
        ps.copy_template(src, run)
        ps.note_machine(run)
    if r.phase == 1 or r.method == "moe":
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
        tokens = {d: epoch_tokens(template, r.epochs, shard[d]) for d in ids}
        kp.eval_command(a, r, run, ids, tokens, expert_flops_per_token(a, template), ps.mfgguf, dry)
    if dry:
        return None
    row = phase1_row(a, r, run, ids, shard) if r.phase == 1 else \
        kp.phase2_row(a, r, run, ids, {"machines": machines(run), "recipe": recipe(a)})
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
    ap.add_argument("--max-chars-per-domain", type=int, default=200000, help="prepare's cap: the shards' size (at"
                    " 120,000 the sets held 15-17 questions; at 200,000 they hold 33-58 and 8 epochs fit a sitting)")
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
        print(json.dumps(write_summary(a.out, a.epochs)))
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
        print(json.dumps(write_summary(a.out, a.epochs)))


if __name__ == "__main__":
    main()
