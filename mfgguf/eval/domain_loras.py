"""The practitioner's modular alternative on an imported base: one LoRA per domain, served by llama.cpp.

llama-server loads one base and several LoRA adapters and applies the one a request names; the client
picks its domain's adapter, since it knows what it sends. That is routing by an oracle, and the
modular thing a user would build instead of experts. Each trained shard gets a LoRA of its own
(`train-base --mode lora --shards i`) for the FLOPs its expert spent (a LoRA step costs less, so it
sees more tokens), at the peak LR the LoRA grid chose on validation (eval/base_baselines.py). Its
adapter (OUT/lora.gguf) is applied by llama.cpp to the base's own dense GGUF (the trunk alone) and
scored on its domain's text; a domain no shard was trained on gets the base alone (no adapter is
for it).

Example:
    >>> adapters = train_domain_loras(rd, metas, out, lr=3e-3)
    >>> r = measure_domain_loras(Path("trunk-f16.gguf"), adapters, rd, ["python", "english"], max_tokens=32768)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mfgguf.config import ModelConfig
from mfgguf.converters.lora_adapter import ADAPTER_FILE
from mfgguf.flops import continued_step_flops, module_flops
from mfgguf.run import RunDir, read_module_meta
from mfgguf.stages import run_stage

LABEL = "base + a LoRA r16 per domain (llama.cpp adapters, client picks), FLOP-matched"


@dataclass(frozen=True)
class DomainAdapter:
    shard: int  # the expert's shard the adapter trained on
    domains: tuple[str, ...]  # the domains that shard holds
    tokens: int
    lr: float
    run: Path  # the RUN train-base wrote; its lora.gguf is the adapter

    @property
    def adapter(self) -> Path:
        return self.run / ADAPTER_FILE


def train_domain_loras(rd: RunDir, metas: dict, out: Path, lr: float, force: bool = False) -> list[DomainAdapter]:
    """Train (or reuse) one LoRA per trained expert's shard, each for that expert's FLOPs; metas: {0: trunk, i: expert}."""
    cfg = ModelConfig.from_dict(metas[0]["config"])
    per_step = continued_step_flops(cfg, "lora").total
    adapters = []
    for i, m in sorted((i, m) for i, m in metas.items() if i > 0):
        step = int(m["train"]["batch_size"]) * cfg.ctx_len
        tokens = max(step, round(module_flops(m) / per_step / step) * step)
        shard = int(m["shard"])
        run = out / f"lora-shard{shard}"
        want = {"mode": "lora", "lr": lr, "shards": [shard], "from_trunk_sha256": metas[0]["sha256"]}
        view = RunDir(run)
        done = view.module_meta(0).is_file() and (run / ADAPTER_FILE).is_file()
        if force or not done or not _same(read_module_meta(view, 0), tokens, want):
            run_stage(f"train-base lora-shard{shard}", ["train-base", rd.root, "-o", run, "--mode", "lora", "--tokens",
                                                        tokens, "--lr", lr, "--shards", str(shard), "--no-progress",
                                                        "--force"])
        adapters.append(DomainAdapter(shard, tuple(m.get("shard_domains") or ()), tokens, lr, run))
    return adapters


def _same(meta: dict, tokens: int, want: dict) -> bool:
    return meta.get("tokens_seen") == tokens and all(meta["continued"].get(k) == v for k, v in want.items())


def measure_domain_loras(base_gguf: Path, adapters: list[DomainAdapter], rd: RunDir, domains: list[str], *,
                         max_tokens: int, ctx: int | None = None, split: str = "test") -> dict:
    """Each domain's perplexity with its shard's adapter on the base (the base alone where none trained on it),
    and the token-weighted mix: {"domains": {d: {ppl, nll, n_tokens, adapter}}, "overall": {...}}."""
    from mfgguf.eval.measure import mixed
    from mfgguf.runtime.perplexity import perplexity

    held = rd.heldout_tokens(max_tokens) if split == "test" else rd.validation_tokens(max_tokens)
    by_domain = {d: a for a in adapters for d in a.domains}
    per = {}
    for d in domains:
        a = by_domain.get(d)
        r = perplexity(base_gguf, np.asarray(held[d]), ctx=ctx, lora=a.adapter if a else None)
        per[d] = {"ppl": r["ppl"], "nll": r["nll"], "n_tokens": r["n_tokens"], "adapter": a.run.name if a else None}
    return {"domains": per, "overall": mixed(per), "split": split}
