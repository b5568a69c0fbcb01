"""`mfgguf sync RUN`: merge the experts' shared-parameter copies into the next trunk, between rounds.

With `train-expert --shared CHOICE --rounds R` every expert's schedule is cut into R equal parts
(rounds). After each round, every expert has written a module file holding its FFNs and its
trained copies of the shared trunk tensors; `sync` merges the copies (merge.py: token-weighted
mean, one row chunk of one tensor at a time) into a new version of the trunk. Each expert
then continues its next round from that trunk, with its own FFNs and AdamW state (kept in its
checkpoint). Only the shared tensors travel; experts still run in any order, anywhere.

After the last round, `sync` finalises: it merges once more, and because the merged trunk
changes every FFN's input, each expert's router statistics (and held-out losses) are recomputed
on the model that will actually be written (restat.py: merged trunk + that expert, forward only),
and then the router's pooled second moment over every expert's shard (pooled.py).
`sync` runs that pass for every expert in turn; with 100 experts on 100 machines, `sync
--no-restat` and then `mfgguf restat RUN --expert I` per machine. `sync` after R = 1 (no rounds)
is this finalisation alone.

Crash safety: the new trunk is first written under RUN/rounds/sync_<k>/ (`before/` hard links of
the inputs, `after/` the new trunk, `sync.json` the plan); then published with a rename, its JSON
and the manifest. Every publishing step is idempotent, and each expert's statistics pass replaces
its module atomically, so a sync killed at any point finishes when run again, with the same bytes.

Example:
    >>> sync(Path("RUN"))  # after every expert has trained round k of R
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from mfgguf.gguf.fileio import pwrite_all
from mfgguf.modules.merge import merge_plan, merged_chunks
from mfgguf.errors import MfggufError, retired
from mfgguf.machine import startup_s
from mfgguf.run import (RunDir, RunInfo, SyncPlan, atomic_path, current_trunk, link_or_copy, module_meta_for, module_name,
                        read_manifest, read_module, recorded_experts, router_stats_current, sync_plan, update_manifest,
                        write_json)
from mfgguf.run.records import ModuleMeta

SYNC_FORMAT = "mfgguf-sync"
OUTER_FILE = "outer.safetensors"  # the momentum of a sync with --outer-momentum, which mfgguf removed


def sync(run: Path, *, merge: str = "mean", restat: bool = True,
         device: str = "cpu", progress: bool = True, experts: list[int] | None = None, stats_from: str = "train") -> dict:
    """Merge the experts' shared-tensor copies into the next trunk version (between sync rounds).

    Run it after every expert has trained its current round (`train-expert --shared ... --rounds R`).
    Between rounds the merged trunk is what every expert continues from. After the last round (and
    for R = 1) it finalises: the merged trunk is final and each expert's router statistics are
    taken from the last round's training steps (--stats-from train, the default, with R >= 2: no pass;
    held-out losses stay those of the expert's own trunk copy) or recomputed on merged trunk + that expert
    (--stats-from pass: forward only, and the held-out losses too), and so are the router's pooled
    statistics (`mfgguf router-stats`); --no-restat leaves both to `mfgguf restat RUN --expert I`,
    one process per expert on any machine, then `mfgguf router-stats RUN`. --merge mean
    (token-weighted).
    --experts I,J: only those experts take part (a domain held out of training, or trained later); later syncs
    keep the set the first one recorded. A killed sync finishes when re-run.

    Example:
        >>> sync(Path("RUN"), merge="mean")["round"]
        1
    """
    from mfgguf.train.rounds.restat import needs_restat

    if stats_from not in ("train", "pass"):
        raise MfggufError(f"unknown --stats-from {stats_from!r}; choose train (the last round's steps) or pass")
    rd = RunDir(run)
    info = rd.run_info()
    check_no_outer(rd)
    t0 = time.perf_counter()
    plan_file = rd.pending_sync()
    if plan_file is None:
        trunk = read_module(rd, 0) if rd.module_meta(0).is_file() else ModuleMeta()
        ids = synced_experts(rd, trunk, experts)
        if trunk.final:  # the last merge is published: only statistics passes can be left
            restats = restat and [i for i in ids if needs_restat(rd, trunk, i)]
            if not restats and (not restat or router_stats_current(rd, ids)):
                raise MfggufError(f"{rd.root} is already synced after its last round; assemble it with"
                                  f" `mfgguf assemble {rd.root}`")
            plan_file = sorted(rd.rounds.glob("sync_*/sync.json"))[-1]
        else:
            plan_file = _stage(rd, info, ids, merge, device, progress)
    plan = sync_plan(plan_file)
    _publish(rd, plan_file.parent, plan)
    write_json(plan_file, {**plan.to_json(), "state": "published"})
    restated, adopted = [], []
    if plan.final and restat:
        restated, adopted = _final_statistics(rd, plan.ids, stats_from, device, progress, t0)
    trunk = read_module(rd, 0)
    write_json(plan_file, {**plan.to_json(), "state": "published",  # the wall-clock-matched baseline counts every sync
                           "wall_s": round(plan.wall_s + time.perf_counter() - t0, 2),  # a re-run adds its own
                           "startup_s": round(plan.startup_s + startup_s(t0), 2)})  # and its process's start
    return {"round": plan.round, "rounds": plan.rounds, "final": plan.final, "merge": plan.merge,
            "merged_tensors": plan.merged_tensors, "trunk_sha256": trunk.sha256,
            "validation_loss": trunk.validation_loss, "before_validation_loss": plan.before_validation_loss,
            "experts": plan.experts, "restated": restated, "adopted": adopted, "wall_s": time.perf_counter() - t0,
            "dir": str(plan_file.parent)}


def _final_statistics(rd: RunDir, ids: list[int], stats_from: str, device: str, progress: bool,
                      t0: float) -> tuple[list[int], list[int]]:
    """Every expert's router statistics on the final trunk and the pooled G: (experts given them, those of them
    adopted from their last round's steps, adopt.py); the rest by a pass of merged trunk + that expert."""
    from mfgguf.train.experts.pooled import pool_router_stats, write_pooled
    from mfgguf.train.experts.stats import RouterStats
    from mfgguf.train.experts.tailstats import moments_path, read_moments
    from mfgguf.train.rounds.adopt import adopt
    from mfgguf.train.rounds.restat import needs_restat, restat as restat_one

    restated, adopted = [], []
    final = read_module(rd, 0)
    cfg = final.config
    acc = RouterStats(cfg["n_layers"], cfg["dim"], second_moment=True)  # the router's G, from the same passes
    for i in ids:
        moments = (stats_from == "train" and needs_restat(rd, final, i)
                   and read_moments(rd, i, read_module(rd, i).sha256, cfg["n_layers"], cfg["dim"]))
        if moments:
            _say(progress, f"router statistics of {module_name(i)}: its last round's training steps")
            adopt(rd, i, moments, acc)
            restated.append(i)
            adopted.append(i)
            continue
        _say(progress, f"router statistics of {module_name(i)} on the merged trunk")
        if restat_one(rd.root, i, device=device, pooled=acc)["restated"]:
            restated.append(i)
    if len(restated) == len(ids):
        write_pooled(rd, acc, t0=t0, experts=ids)
    elif not router_stats_current(rd, ids):  # some were restated by an earlier, killed sync: one more pass
        _say(progress, "pooled router statistics of the merged model")
        pool_router_stats(rd.root, device=device, progress=False, experts=ids)
    for i in ids:  # pooled now, either way; they named modules that are gone
        moments_path(rd, i).unlink(missing_ok=True)
    return restated, adopted


def synced_experts(rd: RunDir, trunk: dict, experts: list[int] | None) -> list[int]:
    """The experts that take part in the sync rounds: `experts` where given, else the set the trunk's last sync
    recorded (a held-out expert sits out every round), else every expert of the partition."""
    n = rd.run_info().n_experts
    recorded = recorded_experts(trunk)
    if experts is None:
        return list(recorded or range(1, n + 1))
    ids = sorted({rd.check_expert_index(int(i)) for i in experts})
    if not ids:
        raise MfggufError("--experts selects no expert; name the experts whose shared copies to merge, e.g. 1-4")
    if recorded and ids != list(recorded):
        raise MfggufError(f"the earlier syncs of {rd.root} merged experts {','.join(map(str, recorded))}; every round"
                          f" must merge the same experts: pass --experts {','.join(map(str, recorded))} (or leave it out)")
    return ids


# ---- staging: compute every new module under rounds/sync_<k>/after ------------------------------


def _stage(rd: RunDir, info: RunInfo, ids: list[int], merge: str, device: str, progress: bool) -> Path:
    from mfgguf.modules.module import load_module, model_config, trunk_shapes
    n = len(ids)
    trunk = current_trunk(rd)
    k = trunk.syncs
    metas = {}
    missing = [i for i in ids if not rd.module_meta(i).is_file()]
    if missing:
        raise MfggufError(f"expert {missing[0]} has not trained round {k + 1} ({len(missing)} of {n} missing);"
                          f" run `mfgguf train-expert {rd.root} --expert {missing[0]}` first, or leave it out of"
                          f" every sync with --experts")
    for i in ids:
        m = read_module(rd, i)
        if m.trunk_sha256 != trunk.sha256 or m.round != k + 1:
            raise MfggufError(f"{module_name(i)} has not trained round {k + 1} against the current trunk;"
                              f" run `mfgguf train-expert {rd.root} --expert {i}` first")
        metas[i] = m
    rounds = {m.rounds for m in metas.values()}
    if len(rounds) > 1:
        raise MfggufError(f"the experts were trained with different --rounds ({sorted(rounds)}); retrain them with one value")
    R = rounds.pop()
    if not any(m.shared_tensors for m in metas.values()):
        raise MfggufError("the experts share no trunk tensors, so there is nothing to sync; assemble the run directly,"
                          " or train the experts with --shared norms|attn|all")
    final = k + 1 == R

    manifest = read_manifest(rd)
    tmod = load_module(rd, 0, manifest)
    cfg = model_config(tmod, info.vocab_size or trunk.config["vocab_size"])
    mods = [load_module(rd, i, manifest) for i in ids]
    shapes = trunk_shapes(cfg)
    what = merge_plan(mods, shapes, merge)

    d = rd.sync_dir(k + 1)
    if d.exists():  # a sync that died before its plan was written: start it over
        shutil.rmtree(d)
    before, after = d / "before", d / "after"
    before.mkdir(parents=True)
    after.mkdir()
    for i in [0, *ids]:  # the inputs, kept (hard links cost nothing; the next round replaces the files)
        for src in (rd.module_file(i), rd.module_meta(i)):
            link_or_copy(src, before / src.name)

    _say(progress, f"sync round {k + 1}/{R}: merging {len(what)} trunk tensors ({merge}) from {n} experts"
         + ("" if what else " (an FFN-only round: the trunk stays as it is)"))
    new_trunk = after / rd.module_file(0).name
    _merged_trunk(tmod, mods, what, new_trunk, merge)
    from mfgguf.train.engine.loop import mean

    held, before_held = _scores(rd, trunk, list(metas.values()), new_trunk, scored=k + 2 >= R, device=device)
    was = trunk.to_json()  # the merged trunk's record is this one's, keys this mfgguf does not know included
    tmeta = {**{k2: v for k2, v in was.items() if k2 not in ("file", "sha256", "bytes", "tensors")},
             "syncs": k + 1, "rounds": R, "final": final, "synced_from": trunk.sha256,
             "trained_validation_loss": was.get("trained_validation_loss", was.get("validation_loss")),
             "validation_loss": held, "validation_loss_mean": mean(held) if held else None,
             "sync": {"merge": merge, "merged_tensors": list(what), "experts": n,
                      "expert_ids": ids}}
    tfull = module_meta_for(new_trunk, 0, tmeta, {name: list(s) for name, s in shapes.items()})
    metas_after = {"trunk": tfull}
    plan = {"format": SYNC_FORMAT, "state": "staged", "round": k + 1, "rounds": R, "final": final, "merge": merge,
            "merged_tensors": len(what), "experts": n, "expert_ids": ids,
            "before_validation_loss": before_held, "modules": metas_after}
    write_json(d / "sync.json", plan)
    return d / "sync.json"


def _scores(rd: RunDir, trunk: ModuleMeta, metas: list[ModuleMeta], new_trunk: Path, *, scored: bool, device: str) -> tuple[dict, dict]:
    """(held-out loss of the merged trunk, of the trunk it was merged from), each {} where nobody reads it.

    The last round's experts compare with the trunk they start from, and the final trunk is reported; a
    middle round's trunk decides nothing, and neither does the trunk before it, which only the summary line
    would print beside the merged one (docs/benchmarks.md, the recipe's wall)."""
    from mfgguf.train.experts.base_score import reference_validation_loss
    from mfgguf.train.engine.loop import resolve_device
    from mfgguf.train.rounds.restat import trunk_validation_loss, trunk_scoring

    tokens, precision = trunk_scoring(trunk, metas)
    held = trunk_validation_loss(rd, new_trunk, trunk, device, (tokens, precision)) if scored else {}
    # an imported base has no held-out loss of its own: the before is its score, cached by its first expert
    before = (reference_validation_loss(rd, trunk, tokens, resolve_device(device), precision)
              if scored and (trunk.validation_loss or not trunk.syncs) else {})
    return held, before


def _merged_trunk(tmod, mods: list, what: dict[str, list[int]], out: Path, merge: str) -> None:
    """The trunk file with every tensor in `what` replaced by its merge, written atomically at `out`.

    Same safetensors header and tensor offsets as the trunk (all f32, same shapes), so the copy is
    patched in place one merged row chunk at a time: memory is one chunk, whatever N is.
    """
    with atomic_path(out) as tmp:
        shutil.copyfile(tmod.path, tmp)
        fd = os.open(tmp, os.O_WRONLY)
        try:
            for name, positions in what.items():
                e = tmod.entries[name]
                cols = e.shape[-1] if e.shape else 1
                for r0, rows in merged_chunks(name, tmod, [mods[p] for p in positions], method=merge):
                    pwrite_all(fd, rows.astype(np.float32, copy=False), e.begin + r0 * cols * 4)
        finally:
            os.close(fd)


# ---- publishing: idempotent steps, so a killed sync completes when re-run ------------------------


def _publish(rd: RunDir, d: Path, plan: SyncPlan) -> None:
    for m in plan.modules.values():
        staged = d / "after" / m.file
        if staged.is_file():
            os.replace(staged, rd.module_file(m.index))
        write_json(rd.module_meta(m.index), m.to_json())
        update_manifest(rd, m.index, m)


def check_no_outer(rd: RunDir) -> None:
    """Refuse a RUN whose syncs took DiLoCo's outer step: a plain merge now would change its recipe halfway."""
    synced = [(read_module(rd, 0).sync or {}) if rd.module_meta(0).is_file() else {}]
    if (staged := rd.pending_sync()) is not None:  # a sync the old version staged and did not publish
        synced.append(sync_plan(staged).to_json())
    if (rd.rounds / OUTER_FILE).is_file() or any(s.get("outer_lr", 1.0) != 1.0 or s.get("outer_momentum", 0.0)
                                                 for s in synced):
        raise retired(f"{rd.root} was synced", "--outer-lr / --outer-momentum",
                      "train its experts again with plain syncs (a new RUN)")


def _say(progress: bool, msg: str) -> None:
    if progress:
        import sys

        print(msg, file=sys.stderr, flush=True)
