"""What a run of the knowledge study (scripts/studies/knowledge_study.py) costs on a class of CPU: the speeds
measured, the sizes of its shards and question sets, and each phase's run priced (phase 2's by knowledge_phase2.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import knowledge_phase2 as kp
import protocol_study as ps

STUDY_DOMAINS = ps.STUDY_DOMAINS
QUESTION_DOMAINS = ("man", "python")  # the study domains `mfgguf questions` asks about (data/questions.py)
CHARS_PER_TOKEN = 3.3  # SmolLM2's tokenizer on the study corpus's man and python text (a capped prepare here)
# questions a set, by tokens, where the template is not made yet: a training-half set about 0.65 a thousand
# training tokens of the two domains, the test set about 1.3 a thousand of their test tokens (prepare + questions
# at a 200,000-character cap, six facts a document: 58 and 33 of 69,491 training tokens, 33 of 25,723 test tokens)
Q_PER_KTOKEN, QTEST_PER_KTOKEN = 0.65, 1.3


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


def phase2_cost(a, sp: Speed, per_token: float, sz: dict, epochs: int, method: str, train_moe: bool = True) -> float:
    """A phase-2 run of `method` (knowledge_phase2.py): the template again, its training (the MoE's experts unless
    reused; a baseline at their FLOPs) and its models scored."""
    flops, train = training_s(a, sp, per_token, sz["shard"], epochs)
    consts = {"TEMPLATE_S": TEMPLATE_S, "PROCESS_S": PROCESS_S, "ROUTED_FACTOR": ROUTED_FACTOR}
    return kp.phase2_cost(a, sp, sz, flops, train if train_moe else 0.0, method, consts)


def methods(a) -> list[str]:
    """Phase 2's methods: the MoE (and the base), then each baseline asked."""
    return ["moe", *[m for m in a.baselines.split(",") if m in kp.METHODS]]
