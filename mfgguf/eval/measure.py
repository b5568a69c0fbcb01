"""What `mfgguf eval` measures of one model, apart from building it.

`measure`: a GGUF's perplexity per domain on the test split (or, for a choice among models, the
validation split) by llama.cpp, prompt and decode tokens/s, and peak RSS, in a process of its own
(`python -m mfgguf.eval.measure`) so that its RSS is its own.
`measure_stream`: the same process scoring document by document, each by the candidate (the GGUF
alone or with one of its adapters) of lowest loss on its opening (eval/domain_stream.py).
`routing_accuracy`: per layer, how much of each domain's text the MoE's top-1 router sends to
the experts trained mostly on that domain (the PyTorch reference with the GGUF's router rows).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from mfgguf.data.masks import split_masks
from mfgguf.run import RunDir
from mfgguf.stages import run_stage


SPLITS = ("test", "validation")


def measure(path: Path, rd: RunDir, domains: list[str], *, max_tokens: int, ctx: int | None, decode_tokens: int,
            split: str = "test", adapters: dict[str, str] | None = None) -> dict:
    """Perplexity per domain on `split`, tokens/s and peak RSS of one GGUF, in a process of its own (decode_tokens=0:
    no decode timing). `adapters` maps a domain to the llama.cpp LoRA adapter its text is scored with (the client
    picking its domain's adapter: eval/domain_loras.py); a domain without one is scored by the model alone."""
    assert split in SPLITS, split
    args = [sys.executable, "-m", "mfgguf.eval.measure", str(path), str(rd.root), ",".join(domains),
            str(max_tokens), str(ctx or 0), str(decode_tokens), split, json.dumps(adapters or {})]
    res, text = run_stage(f"measure {path.name}", args, capture=True)
    m = json.loads(text.strip().splitlines()[-1])
    m["peak_rss_mb"] = res.peak_rss_mb
    return m


def measure_stream(path: Path, rd: RunDir, domains: list[str], *, max_tokens: int, ctx: int | None,
                   candidates: dict[str, str | None], own: dict[str, str] | None = None, choose_tokens: int | None = None,
                   split: str = "test") -> dict:
    """`domain_stream` (eval/domain_stream.py) of one GGUF and its `candidates` on `split`, in a process of its own:
    its figures without the per-document list, and peak RSS."""
    from mfgguf.eval.domain_stream import CHOOSE_TOKENS

    assert split in SPLITS, split
    spec = {"candidates": candidates, "own": own, "choose_tokens": choose_tokens or CHOOSE_TOKENS}
    args = [sys.executable, "-m", "mfgguf.eval.measure", str(path), str(rd.root), ",".join(domains),
            str(max_tokens), str(ctx or 0), "0", split, "{}", json.dumps(spec)]
    res, text = run_stage(f"measure {path.name} (unknown-domain stream)", args, capture=True)
    m = json.loads(text.strip().splitlines()[-1])["stream"]
    m["peak_rss_mb"] = res.peak_rss_mb
    return m


def _main(path: str, run: str, domains: str, cap: str, ctx: str, decode: str, split: str, adapters: str = "{}",
          stream: str = "") -> None:
    """The measuring process: prints one JSON line (see `measure`; with a `stream` spec, `measure_stream`)."""
    from mfgguf.runtime.perplexity import perplexity_by_domain

    rd = RunDir(Path(run))
    held = rd.test_tokens(int(cap)) if split == "test" else rd.validation_tokens(int(cap))
    toks = {d: np.asarray(held[d]) for d in domains.split(",") if d in held}
    if stream:
        _stream(Path(path), rd, toks, json.loads(stream), int(ctx) or None, split)
        return
    adapter_of = json.loads(adapters)
    by_adapter: dict[str | None, dict] = {}
    for d, t in toks.items():  # one load of the model per adapter
        by_adapter.setdefault(adapter_of.get(d), {})[d] = t
    eos = rd.run_info().eos_id if split == "test" else None  # test keeps each document's figures (eval/spread.py)
    masks = split_masks(rd.test_dir if split == "test" else rd.validation_dir, toks)  # conversations: their answers
    parts = [perplexity_by_domain(Path(path), group, ctx=int(ctx) or None, lora=Path(a) if a else None, eos=eos,
                                  masks=masks)
             for a, group in by_adapter.items()]
    per = {d: {k: v[k] for k in ("ppl", "nll", "n_tokens", "documents") if k in v}
           for r in parts for d, v in r["domains"].items()}
    per = {d: per[d] for d in toks}
    overall = mixed(per)  # token-weighted: the mixed set
    prompt_tps = sum(p["overall"]["tokens_per_s"] or 0 for p in parts) / len(parts)
    if not int(decode):
        print(json.dumps({"domains": per, "overall": overall, "split": split, "prompt_tps": prompt_tps}))
        return
    from mfgguf.runtime.llm import loaded

    with loaded(Path(path)) as llm:
        t0 = time.perf_counter()
        c = llm.create_completion("def ", max_tokens=int(decode), temperature=0.0, seed=0)
        n_dec, t_dec = c["usage"]["completion_tokens"], time.perf_counter() - t0
    print(json.dumps({"domains": per, "overall": overall, "split": split, "prompt_tps": prompt_tps,
                      "decode_tps": n_dec / t_dec if n_dec else float("nan")}))


def _stream(path: Path, rd: RunDir, toks: dict, spec: dict, ctx: int | None, split: str) -> None:
    """The measuring process for `measure_stream`: prints {"stream": figures, "split"}."""
    from mfgguf.errors import MfggufError
    from mfgguf.eval.domain_stream import domain_stream

    eos = rd.run_info().eos_id
    if eos is None:
        raise MfggufError(f"{rd.run_json} records no eos_id, which splits its documents; re-create the run with"
                          " `mfgguf prepare`")
    r = domain_stream(path, toks, spec["candidates"], eos=int(eos), own=spec.get("own"),
                      choose_tokens=int(spec["choose_tokens"]), ctx=ctx)
    del r["documents"]  # report.json keeps the counts (r["choice"]), not a line per document
    print(json.dumps({"stream": r, "split": split}))


def mixed(per: dict) -> dict:
    """Token-weighted perplexity over domains measured by different models (the oracle's mixed set)."""
    n = sum(v["n_tokens"] for v in per.values())
    nll = sum(v["nll"] * v["n_tokens"] for v in per.values()) / n
    return {"ppl": math.exp(nll), "nll": nll, "n_tokens": n}


def routing_accuracy(rd: RunDir, domains: list[str], test: dict, gguf: Path) -> dict:
    """Per layer, the share of each domain's tokens whose top-1 expert was trained mostly on that domain.

    Uses the PyTorch reference with the router rows read back from the top-1 GGUF, i.e. exactly
    the routing llama.cpp performs (parity tests hold the two forwards together).
    """
    import torch

    from mfgguf.reference import reference_model

    from mfgguf.gguf.header import read_gguf_header

    model, _ = reference_model(rd.root, gguf)
    main = {s["id"]: max(s["domains"], key=s["domains"].get) for s in rd.run_info().shards}  # expert -> its main domain
    ids = read_gguf_header(gguf).value("mfgguf.experts") or sorted(main)  # the file's experts, in slot order
    home = {int(i): main[int(i)] for i in ids}  # slot order: an assembled subset (1,2,4,5) is not slots 1..4
    n_layers, n_exp = model.cfg.n_layers, len(home)
    first = model.cfg.n_experts - n_exp  # 1 when the seed is routed slot 0 (a seed gate): not counted
    counts = np.zeros((len(domains), n_layers, n_exp))  # domain x layer x expert
    ctx = model.cfg.ctx_len
    for di, d in enumerate(domains):
        toks = torch.as_tensor(np.asarray(test[d][: (len(test[d]) // ctx) * ctx], dtype=np.int64)).view(-1, ctx)

        def hook(layer, x, di=di):
            choice = (x.float() @ model.layers[layer].router[first:].float().T).argmax(-1)  # (B, T): best expert
            counts[di, layer] += np.bincount(choice.flatten().numpy(), minlength=n_exp)

        with torch.no_grad():
            for b in range(0, len(toks), 8):
                model(toks[b: b + 8], route="router", hook=hook)
    share = counts / counts.sum(-1, keepdims=True).clip(min=1)  # domain x layer x expert
    slot_domain = list(home.values())
    acc = {d: [float(sum(share[di, l, s] for s, h in enumerate(slot_domain) if h == d)) for l in range(n_layers)]
           for di, d in enumerate(domains)}
    return {"accuracy": acc, "confusion": share.mean(1).tolist(), "expert_domain": home}


__all__ = ["measure", "measure_stream", "mixed", "routing_accuracy"]

if __name__ == "__main__":  # the per-model measuring process (see measure)
    _main(*sys.argv[1:])
