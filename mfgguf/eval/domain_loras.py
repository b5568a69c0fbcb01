"""The practitioner's modular alternative on an imported base: one LoRA per domain, served by llama.cpp.

llama-server loads one base and several LoRA adapters and applies the one a request names; the client
picks its domain's adapter, since it knows what it sends. That is routing by an oracle, and the
modular thing a user would build instead of experts. Each trained shard gets a LoRA of its own
(`train-base --mode lora --shards i`) for the FLOPs its expert spent (a LoRA step costs less, so it
sees more tokens), at the peak LR the LoRA grid chose on validation; eval/baselines/imported.py
trains them (`train_domain_loras`). Its adapter (OUT/lora.gguf) is applied by llama.cpp to the
base's own dense GGUF (the trunk alone) and scored on its domain's text; a domain no shard was
trained on gets the base alone (no adapter is for it). With `stream=True` the same adapters are also
measured where the client does not know the domain: each document served by the candidate (the base
alone or one adapter) of lowest loss on its first 128 tokens (eval/domain_stream.py).

Example:
    >>> adapters = train_domain_loras(rd, metas, out, lr=3e-3)   # eval/baselines/imported.py
    >>> r = measure_domain_loras(Path("trunk-f16.gguf"), adapters, rd, ["python", "english"], max_tokens=32768,
    ...                          stream=True)
    >>> r["overall"]["ppl"], r["stream"]["after_choice"]["ppl"], r["stream"]["own_choice"]
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mfgguf.modules.lora_adapter import ADAPTER_FILE
from mfgguf.eval.domain_stream import CHOOSE_TOKENS, stream_candidates
from mfgguf.run import RunDir

LABEL = "base + a LoRA r16 per domain (llama.cpp adapters, client picks), FLOP-matched"


@dataclass(frozen=True)
class DomainAdapter:
    shard: int  # the expert's shard the adapter trained on
    domains: tuple[str, ...]  # the domains that shard holds
    tokens: int
    lr: float
    run: Path  # the RUN train-base wrote; its lora.gguf is the adapter
    weights: tuple[int, ...] = ()  # the shard's tokens of each of `domains`, where run.json counts them

    @property
    def adapter(self) -> Path:
        return self.run / ADAPTER_FILE


def domain_owners(adapters: list[DomainAdapter]) -> dict[str, DomainAdapter]:
    """Each domain's adapter, the one a client that knows the domain picks: the adapter of the shard holding most of
    that domain's tokens. A label shard holds one domain, so that is its own; a cluster holds several, and a domain
    goes to the cluster with most of it (the last shard listing it, where shards do not count their tokens)."""
    best: dict[str, tuple[int, DomainAdapter]] = {}
    for a in adapters:
        for d, w in zip(a.domains, a.weights or (0,) * len(a.domains)):
            if d not in best or w >= best[d][0]:
                best[d] = (w, a)
    return {d: a for d, (_, a) in best.items()}


def measure_domain_loras(base_gguf: Path, adapters: list[DomainAdapter], rd: RunDir, domains: list[str], *,
                         max_tokens: int, ctx: int | None = None, split: str = "test", stream: bool = False,
                         choose_tokens: int = CHOOSE_TOKENS) -> dict:
    """Each domain's perplexity with its shard's adapter on the base (the base alone where none trained on it), by
    eval's measuring process: {"domains": {d: {ppl, nll, n_tokens, adapter}}, "overall": the token-weighted mix};
    with `stream`, also "stream": the same adapters with the domain unknown (`domain_stream`'s figures, candidates
    named by their RUN's folder, documents chosen on their first `choose_tokens`), measured in a process of its own."""
    from mfgguf.eval.measure import measure, measure_stream

    by_domain = domain_owners(adapters)
    paths = {d: str(a.adapter) for d, a in by_domain.items()}
    r = measure(base_gguf, rd, domains, max_tokens=max_tokens, ctx=ctx, decode_tokens=0, split=split, adapters=paths)
    for d, v in r["domains"].items():
        v["adapter"] = by_domain[d].run.name if d in by_domain else None
    if stream:
        candidates, own = stream_candidates(paths, [str(a.adapter) for a in adapters])  # every adapter a candidate
        r["stream"] = measure_stream(base_gguf, rd, domains, max_tokens=max_tokens, ctx=ctx, candidates=candidates,
                                     own=own, choose_tokens=choose_tokens, split=split)
    return r
