"""A lever of the expert recipe, judged on validation against a protocol-study run of the same size and seed.

The protocol study (scripts/studies/protocol_study.py) scores a recipe on test once; a change to the recipe is chosen
before that, on validation. This script trains the study's experts again from the study's template with extra
`train-expert` options (the lever), syncs them as the study does, assembles the MoEs eval would build and measures
each on the validation split by llama.cpp, exactly as eval measured the reference run's (same tokens, same
windows): one JSON line per MoE with the lever's perplexities, the reference's and their ratio, then a summary
line with the experts' own PyTorch validation losses beside the reference's. Nothing reads test.

    python scripts/studies/lever_study.py --study protocol-study --tokens 65536 --seed 1 --name attn05 --opts="--shared-lr-scale 0.5"
    python scripts/studies/lever_study.py --study protocol-study --tokens 262144 --seed 1 --name lr2e-3 --lr 2e-3

Each step is skipped where its output exists, so a killed run resumes.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protocol_study import (STUDY_DOMAINS, copy_template, mfgguf, read_json, shard_ids)  # noqa: E402

MOES = ("top1", "top2", "seed0.4-top1", "seed0.4-top2", "seed0.6-top1", "seed0.6-top2", "seed0.8-top1", "seed0.8-top2")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", type=Path, required=True, help="a protocol study's --out (its template and runs)")
    ap.add_argument("--tokens", type=int, default=65536, help="training tokens a domain: the reference run's")
    ap.add_argument("--seed", type=int, default=1, help="the reference run's seed")
    ap.add_argument("--name", required=True, help="the lever's name: its RUN is STUDY/levers/<name>-t<T>-s<S>")
    ap.add_argument("--lr", type=float, default=None, help="the experts' peak LR (default: the reference run's)")
    ap.add_argument("--opts", default="", help="extra train-expert options, e.g. '--shared-lr-scale 0.5'")
    ap.add_argument("--moes", default="top1,top2,seed0.4-top2,seed0.6-top1",
                    help=f"the MoEs to measure, of {','.join(MOES)}")
    a = ap.parse_args(argv)
    a.moes = [m.strip() for m in a.moes.split(",") if m.strip()]
    bad = [m for m in a.moes if m not in MOES]
    if bad:
        sys.exit(f"lever_study: unknown MoE {bad[0]!r}; choose among {', '.join(MOES)}")
    return a


def main(argv=None) -> None:
    a = parse(argv)
    study = a.study.resolve()
    ref = study / f"t{a.tokens}-s{a.seed}"
    rows = [json.loads(x) for x in (study / "study.jsonl").read_text().splitlines() if x.strip()] \
        if (study / "study.jsonl").is_file() else []
    recipe = next((r["recipe"] for r in rows if r.get("run") == ref.name), None)
    if recipe is None or not (ref / "eval" / "measured").is_dir():
        sys.exit(f"lever_study: {ref} is not a finished run of {study / 'study.jsonl'}; run the protocol study first")
    ids = shard_ids(study / "template", recipe["domains"])
    run = study / "levers" / f"{a.name}-t{a.tokens}-s{a.seed}"
    run.parent.mkdir(parents=True, exist_ok=True)
    log = run.parent / f"{run.name}.log"
    copy_template(study / "template", run)
    t0 = time.perf_counter()
    extra = shlex.split(a.opts)
    R, lr = int(recipe["rounds"]), a.lr or recipe["lr"]
    for k in range(1, R + 1):
        for i in ids.values():
            meta = read_json(run / "modules" / f"expert_{i:03d}.json")
            if meta is None or int(meta.get("round", 1)) < k:
                mfgguf("train-expert", run, "--expert", i, "--tokens", a.tokens, "--eval-tokens", recipe["eval_tokens"],
                       "--lr", lr, "--shared", recipe["shared"], "--shared-lr-scale", recipe["shared_lr_scale"],
                       "--rounds", R, "--seed", a.seed, *extra, "--no-progress", log=log, dry=False)
        trunk = read_json(run / "modules" / "trunk.json") or {}
        if recipe["shared"] != "none" and int(trunk.get("syncs") or 0) < k:
            mfgguf("sync", run, "--experts", ",".join(map(str, ids.values())), "--no-progress", log=log, dry=False)
    train_s = time.perf_counter() - t0
    from mfgguf.converters.assemble import assemble
    from mfgguf.eval.measure import measure
    from mfgguf.run import RunDir

    rd, domains = RunDir(run), [d for d in STUDY_DOMAINS if d in recipe["domains"] or d == recipe["held_out"]]
    cap = int(recipe["eval_max_tokens"])
    out = []
    for name in a.moes:
        gate, _, k = name.rpartition("-top") if "seed" in name else ("", "", name[3:])
        full = f"moe-ridge{'-' + gate if gate else ''}-top{k}-f16"
        measured = run / "eval" / "measured" / f"{full}.validation.json"
        if not measured.is_file():
            path = run / "eval" / "models" / f"{full}.gguf"
            path.parent.mkdir(parents=True, exist_ok=True)
            assemble(run, path, quant="f16", top_k=int(k), router="ridge", force=True, progress=False,
                     experts=list(ids.values()), seed_gate=float(gate[4:]) if gate else None)
            m = measure(path, rd, domains, max_tokens=cap, ctx=None, decode_tokens=0, split="validation")
            measured.parent.mkdir(parents=True, exist_ok=True)
            measured.write_text(json.dumps({"result": m}, indent=1))
            path.unlink()
        mine = json.loads(measured.read_text())["result"]
        theirs = (read_json(ref / "eval" / "measured" / f"{full}.validation.json") or {}).get("result")
        row = {"moe": name, "lever": a.name, "lr": lr, "opts": a.opts, "tokens": a.tokens, "seed": a.seed,
               "ppl": {d: round(v["ppl"], 4) for d, v in mine["domains"].items()},
               "mixed": round(mine["overall"]["ppl"], 4)}
        if theirs:
            row["reference_ppl"] = {d: round(v["ppl"], 4) for d, v in theirs["domains"].items()}
            row["reference_mixed"] = round(theirs["overall"]["ppl"], 4)
            row["lever_over_reference"] = round(mine["overall"]["ppl"] / theirs["overall"]["ppl"], 4)
        out.append(row)
        print(json.dumps(row), flush=True)
    own = {d: read_json(run / "modules" / f"expert_{i:03d}.json")["validation_loss"].get(d) for d, i in ids.items()}
    refd = {d: read_json(ref / "modules" / f"expert_{i:03d}.json")["validation_loss"].get(d) for d, i in ids.items()}
    on = {read_json(run / "modules" / f"expert_{i:03d}.json").get("validation_on") for i in ids.values()}
    print(json.dumps({"summary": a.name, "train_s": round(train_s, 1), "expert_validation_nats": own,
                      "expert_validation_on": sorted(x or "merged trunk" for x in on),
                      "reference_expert_validation_nats": refd,
                      "best": min(out, key=lambda r: r["mixed"])["moe"] if out else None}), flush=True)


if __name__ == "__main__":
    main()
