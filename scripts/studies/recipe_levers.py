"""The expert recipe's levers at one data size and seed, chosen on validation, each with its training FLOPs.

Before a decision row (protocol_study.py at 1,048,576 tokens a domain) the recipe is chosen on validation at a
smaller size: expert width (192 units, 768, the base's whole FFN with the anchor empty, and all but one unit of it
with a one-unit anchor), FFN-only experts against experts with attention copies merged by sync rounds, and the experts' LR; the
router's top-1 against top-2 is measured within each. Each lever is a RUN of its own, OUT/<lever>, copied (hard
links) from a template of its width, OUT/template-w<W> (`import-base --expert-ff W`, then protocol_study's
`prepare study`: the same documents, splits and shards at every width, prepare's seed fixed). Its experts train
on c, cpp, man and python (English held out), then the MoE is assembled at top-1 and top-2 (ridge, f16) and
scored on validation by llama.cpp, as eval scores its MoEs; nothing reads test. One JSON line a lever in
OUT/levers.jsonl: validation perplexity of each MoE (the trained mix and the held-out domain), the experts' own
PyTorch validation losses, training FLOPs (mfgguf/flops.py, as eval counts them) and the walls. A lever in
levers.jsonl is not run again; a killed one resumes from its last finished step.

    python scripts/studies/recipe_levers.py --out levers --tokens 262144 --seed 1 --dry-run   # the plan and its cost
    python scripts/studies/recipe_levers.py --out levers --tokens 262144 --seed 1 --levers w192,w768,w1536
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

from protocol_study import (RATE, STUDY_DOMAINS, copy_template, estimate, mfgguf, note_machine,  # noqa: E402
                            plan_config, read_json, shard_ids)

# name: (expert width, train-expert --shared, sync rounds, expert LR); 1536 = SmolLM2's whole FFN, the anchor empty
# (BTX's experts); 1535 keeps one unit of it as the anchor
LEVERS = {"w192": (192, "attn", 4, 1e-3), "w768": (768, "attn", 4, 1e-3), "w1536": (1536, "attn", 4, 1e-3),
          "w1535": (1535, "attn", 4, 1e-3),
          "w768-ffn": (768, "none", 1, 1e-3), "w768-lr2e-3": (768, "attn", 4, 2e-3), "w192-ffn": (192, "none", 1, 1e-3)}
DOMAINS, HELD_OUT = ["c", "cpp", "man", "python"], "english"
MOE_MEASURE_S = 400.0  # one f16 MoE on validation at --max-tokens 16384 on 2 cores, assembly included


def template(a, width: int, log: Path) -> Path:
    """OUT/template-w<W>: the base imported at this width, the study corpus prepared as protocol_study prepares it."""
    t = a.out / f"template-w{width}"
    if not (t / "modules" / "trunk.json").is_file():
        mfgguf("import-base", a.base, "--out", t, "--expert-ff", width, "--force", log=log, dry=a.dry_run)
    if not (t / "run.json").is_file():
        mfgguf("prepare", "study", "--out", t, "--experts", len(STUDY_DOMAINS), "--partition", "label",
               "--max-chars-per-domain", a.max_chars_per_domain, "--test-frac", 0.02, "--valid-frac", 0.05,
               "--seed", 0, "--no-progress", log=log, dry=a.dry_run)
    return t


def train(a, run: Path, lever: tuple, ids: list[int], log: Path) -> None:
    """Every expert, round by round, each round's sync after it: each step only where its output is missing."""
    width, shared, rounds, lr = lever
    for k in range(1, rounds + 1):
        for i in ids:
            meta = read_json(run / "modules" / f"expert_{i:03d}.json")
            if meta is None or int(meta.get("round", 1)) < k:
                mfgguf("train-expert", run, "--expert", i, "--tokens", a.tokens, "--eval-tokens", 4096, "--lr", lr,
                       "--shared", shared, "--shared-lr-scale", 0.3, "--rounds", rounds, "--seed", a.seed,
                       "--no-progress", log=log, dry=a.dry_run)
        trunk = read_json(run / "modules" / "trunk.json") or {}
        if shared != "none" and int(trunk.get("syncs") or 0) < k:
            mfgguf("sync", run, "--experts", ",".join(map(str, ids)), "--no-progress", log=log, dry=a.dry_run)


def score(a, run: Path, ids: list[int]) -> dict:
    """{"top1", "top2"}: each MoE's validation figures, by llama.cpp (eval's measuring process)."""
    from mfgguf.converters.assemble import assemble
    from mfgguf.eval.measure import measure
    from mfgguf.run import RunDir

    rd, out = RunDir(run), {}
    for k in (1, 2):
        kept = run / "levers" / f"top{k}.validation.json"
        if not kept.is_file():
            path = run / "levers" / f"moe-top{k}-f16.gguf"
            path.parent.mkdir(parents=True, exist_ok=True)
            assemble(run, path, quant="f16", top_k=k, router="ridge", force=True, progress=False, experts=ids)
            m = measure(path, rd, [*DOMAINS, HELD_OUT], max_tokens=a.max_tokens, ctx=None, decode_tokens=0,
                        split="validation")
            kept.write_text(json.dumps(m))
            path.unlink()
        m = json.loads(kept.read_text())
        from mfgguf.eval.measure import mixed

        out[f"top{k}"] = {"ppl_trained": mixed({d: m["domains"][d] for d in DOMAINS})["ppl"],
                          "ppl_held_out": m["domains"][HELD_OUT]["ppl"],
                          "domains": {d: v["ppl"] for d, v in m["domains"].items()}}
    return out


def row(a, name: str, lever: tuple, run: Path, ids: list[int], wall_s: float) -> dict:
    from mfgguf.eval.baselines.imported import expert_walls
    from mfgguf.eval.training_flops import flops_section
    from mfgguf.run import RunDir, read_module

    rd = RunDir(run)
    metas = {0: read_module(rd, 0), **{i: read_module(rd, i) for i in ids}}
    walls, syncs = expert_walls(rd, {i: metas[i] for i in ids})
    return {"lever": name, "expert_ff": lever[0], "shared": lever[1], "rounds": lever[2], "lr": lever[3],
            "tokens_per_domain": a.tokens, "seed": a.seed, "validation": score(a, run, ids),
            "expert_validation_nats": {d: metas[i].validation_loss.get(d) for d, i in zip(DOMAINS, ids)},
            "flops": flops_section(metas, [])["total"], "train_wall_s": sum(walls.values()) + syncs,
            "critical_path_s": max(walls.values()) + syncs, "wall_s": round(wall_s, 1),
            "machines": read_json(run / "machines.json") or []}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("levers"))
    ap.add_argument("--base", default="smollm2")
    ap.add_argument("--tokens", type=int, default=262144, help="training tokens a trained domain")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--levers", default=",".join(LEVERS), help=f"of {', '.join(LEVERS)}")
    ap.add_argument("--max-tokens", type=int, default=16384, help="validation tokens scored a domain")
    ap.add_argument("--max-chars-per-domain", type=int, default=4_500_000, help="prepare's cap (the protocol's)")
    ap.add_argument("--prune", action="store_true", help="delete a finished lever's RUN (its line is kept)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and each lever's cost; run nothing")
    a = ap.parse_args(argv)
    a.out = a.out.resolve()
    names = [n.strip() for n in a.levers.split(",") if n.strip()]
    if bad := [n for n in names if n not in LEVERS]:
        sys.exit(f"recipe_levers: unknown lever {bad[0]!r}; choose among {', '.join(LEVERS)}")
    if not a.dry_run:
        a.out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(x) for x in (a.out / "levers.jsonl").read_text().splitlines() if x.strip()] \
        if (a.out / "levers.jsonl").is_file() else []
    done = {(r["lever"], r["tokens_per_domain"], r["seed"]) for r in rows}
    log, total = a.out / "levers.log", 0.0
    for name in names:
        lever = LEVERS[name]
        run = a.out / f"{name}-t{a.tokens}-s{a.seed}"
        if (name, a.tokens, a.seed) in done:
            print(f"# {run.name}: done (in levers.jsonl)")
            continue
        t = template(a, lever[0], log)
        ids = list(shard_ids(t, DOMAINS).values())
        if a.dry_run:
            cfg, why = plan_config(argparse.Namespace(base=a.base, expert_ff=lever[0]), t)
            if cfg is None:
                print(f"# {run.name}: cost unknown ({why})")
            else:
                e = estimate(cfg, a.tokens, len(ids), lever[2], lever[1], [], 0)
                s = e["seconds"] + 2 * MOE_MEASURE_S * a.max_tokens / 16384
                total += s
                print(f"# {run.name}: {e['moe_flops']:.3e} training FLOPs ({e['expert_flops_per_token'] / 1e6:.1f} MFLOP a"
                      f" token), about {s / 3600:.1f} h at {RATE:.1e} FLOP/s with its two validation scores")
            train(a, run, lever, ids, log)
            continue
        t0 = time.perf_counter()
        copy_template(t, run)
        note_machine(run)
        train(a, run, lever, ids, log)
        r = row(a, name, lever, run, ids, time.perf_counter() - t0)
        with open(a.out / "levers.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps({k: r[k] for k in ("lever", "flops", "train_wall_s")}
                         | {m: round(v["ppl_trained"], 4) for m, v in r["validation"].items()}), flush=True)
        if a.prune:
            shutil.rmtree(run)
    if a.dry_run:
        print(f"# about {total / 3600:.1f} h in all" if total else "# total cost unknown")


if __name__ == "__main__":
    main()
