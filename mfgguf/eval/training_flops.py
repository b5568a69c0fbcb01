"""What a modular run spent in training FLOPs, and so what budget each baseline is given.

Per-step counting lives below, in mfgguf/flops.py (training imports it); this file adds up a whole
RUN's modules -- every expert job, the critical path when each expert has its own machine -- and
writes report.json's `flops` section, formulas included, so a reader can redo every budget.

Example:
    >>> fl = run_flops({0: trunk_meta, 1: expert_meta})
    >>> tokens_for_flops(fl["total"], dense_cfg, tokens_per_step=batch * ctx)
"""

from __future__ import annotations

from mfgguf.flops import module_flops, trunk_step_flops
from mfgguf.run import ModuleMeta

FORMULAS = {
    "convention": "matmul FLOPs only (2 per multiply-add); no norms/softmax/loss/optimizer; no recompute;"
                  " causal attention: a query sees (T+1)/2 keys on average over a window of T",
    "trunk_or_dense_step": "per token: 6*W_all + 12*L*H*hd*(T+1)/2, W_all = L*(C*(H+2*KV)*hd + H*hd*C + 3*C*ff_anchor)"
                           " + C*V (output head; the embedding lookup is not a matmul)",
    "expert_step": "per token: forward 2*(W_all + L*3*C*ff_expert) + 4*L*H*hd*(T+1)/2;"
                   " backward 4*|W| for trained matmuls (expert FFNs, shared copies), 2*|W| for frozen matmuls"
                   " whose input depends on a trained tensor, 8*H*hd*(T+1)/2 per layer whose attention input does"
                   " (shared none: all layers above 0, the head, and layer 0's expert down-projection input)",
    "module_flops": "tokens_seen * per-token step FLOPs of that module (a wsd trunk's cooldown after its branch"
                    " point included: cooldown_flops in its row) + restat_tokens * its forward FLOPs a token (the"
                    " final sync's statistics and scoring passes on the merged trunk)",
    "flop_matched": "dense tokens = (trunk FLOPs + sum of every expert job's FLOPs) / dense per-token FLOPs,"
                    " rounded to whole optimizer steps",
    "continued_from_base": "an imported base trained further (mfgguf train-base): full = trunk_or_dense_step of the"
                           " base; lora = the frozen base's forward + activation gradients (none into layer 0's"
                           " attention) + each adapted linear's 2r(d_in + d_out) forward and 4r d_out + 2r d_in"
                           " backward (+ 2r d_in where its input is live), torch's own count exactly; the base's"
                           " pretraining counts for nobody",
    "wallclock_matched": "dense tokens = (trunk FLOPs + R * FLOPs of one round of the longest expert job) / dense"
                         " per-token FLOPs, rounded to whole steps: the critical path when every expert has its"
                         " own machine (R rounds, from a `rounds` key in the metadata, else 1)",
}


def rounds_of(metas: dict[int, ModuleMeta]) -> int:
    """Training rounds R: the largest `rounds` (or `round`) of any module's record, else 1."""
    return max([1] + [n for m in metas.values() for n in (m.rounds, m.round)])


def run_flops(metas: dict[int, ModuleMeta], *, causal: bool = True) -> dict:
    """Training FLOPs of a modular run: per module, total, and the critical path.

    metas: {0: the trunk's record, i: expert i's}, tokens_seen counting all of a module's training.
    total = trunk + every expert job. critical_path = trunk + R x the longest expert's per-round
    job (its FLOPs / R): the wall clock when every expert has its own machine and rounds run back
    to back.
    """
    per = {i: module_flops(m, causal=causal) for i, m in metas.items()}
    R = rounds_of(metas)
    longest_round = max((v for i, v in per.items() if i > 0), default=0.0) / R  # one round of the longest job
    return {"modules": per, "trunk": per.get(0, 0.0), "experts": sum(v for i, v in per.items() if i > 0),
            "total": sum(per.values()), "critical_path": per.get(0, 0.0) + R * longest_round, "rounds": R}


def tokens_for_flops(flops: float, cfg, tokens_per_step: int, *, causal: bool = True) -> int:
    """Training tokens (whole optimizer steps, nearest, at least one) for a dense model to spend `flops`."""
    per_tok = trunk_step_flops(cfg, causal=causal).total
    steps = max(1, round(flops / (per_tok * tokens_per_step)))
    return steps * tokens_per_step


def flops_section(metas: dict[int, ModuleMeta], trained: list = ()) -> dict:
    """report.json's `flops`: the formulas, every module's training FLOPs and tokens, and a row per model: the
    trunk alone, the MoE, then each trained baseline (`trained`: eval/baselines/baseline.py's records, which
    write their own rows)."""
    fl = run_flops(metas)
    modules = {("trunk" if i == 0 else f"expert {i}"): {"tokens": m.tokens_seen, "flops": fl["modules"][i],
                                                      "flops_per_token": fl["modules"][i] / max(1, m.tokens_seen),
                                                      "shared_tensors": len(m.shared_tensors)}
               for i, m in metas.items()}
    if metas[0].cooldown_tokens:  # a wsd trunk's cooldown after its branch point: counted like any step
        t = modules["trunk"]
        t["cooldown_tokens"] = metas[0].cooldown_tokens
        t["cooldown_flops"] = t["cooldown_tokens"] * t["flops_per_token"]
    models = {"trunk alone": {"tokens": metas[0].tokens_seen, "flops": fl["trunk"]},
              "moe (trunk + every expert)": {"tokens": sum(m.tokens_seen for m in metas.values()), "flops": fl["total"],
                                             "critical_path_flops": fl["critical_path"]},
              **{t.label: t.flops for t in trained}}
    return {"formulas": FORMULAS, "modules": modules, "models": models, "rounds": fl["rounds"],
            "total": fl["total"], "critical_path": fl["critical_path"]}


__all__ = ["FORMULAS", "rounds_of", "run_flops", "tokens_for_flops", "flops_section"]
