"""Router quality against the number of shard tokens each expert's router statistics are measured over.

An expert records, per layer, the mean of the FFN inputs on its shard (the ridge router's
right-hand side): gathered by training's last steps (the default), or by a forward pass over the
shard after training (`--stats-from pass`). The pass costs time (on SmolLM2, 175 s for the
262,144 tokens that 4 x the default eval_tokens asked for, 7x the 16,384-token training it
followed); this measures what fewer tokens cost the router. For each K in --tokens: a view of RUN
whose trained experts' means are recomputed over K tokens of their shards (the same evenly spread
windows the pass takes), the pooled second moment kept as it is (only the means vary), assembled
(q8_0, ridge, top-1) and scored by llama.cpp on the validation split. Prints JSON lines:

  {"tokens": K, "pass_s": seconds of the four passes, "ppl": {domain: ...}, "mixed_trained": ...,
   "over_reference": mixed_trained / that of the largest K, "mean_rel_err": mean over experts and layers of
   |mu_K - mu_rec| / |mu_rec| against the means the experts recorded}
  {"tokens": "recorded", ...}   the means as the experts recorded them (`train-expert --stats-from train`: gathered
   by training's last steps; pass: their own pass), scored the same way, against the same reference

    python scripts/bench/bench_stats_tokens.py RUN --tokens 1024,4096,16384,65536 --out /tmp/stats-tokens
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

from bench_train import cpu_flags  # noqa: E402


def view_with_means(rd, out: Path, ids: list[int], k: int) -> tuple[object, float, dict]:
    """A copy of RUN at `out` (trunk and data linked) whose experts' means are measured over k tokens."""
    import torch

    from mfgguf.config import ModelConfig
    from mfgguf.run import data_view, link_or_copy, read_module_meta, write_module, write_router_stats
    from mfgguf.train.experts.expert import build_expert_model
    from mfgguf.train.engine.loop import evaluate, load_tokens, resolve_precision
    from mfgguf.train.experts.stats import RouterStats
    from mfgguf.train.engine.weights import read_safetensors

    v = data_view(rd, out)
    shutil.copy2(rd.manifest, v.manifest)
    v.modules.mkdir()
    for f in ("trunk.safetensors", "trunk.json"):
        link_or_copy(rd.modules / f, v.modules / f)
    trunk = read_module_meta(rd, 0)
    cfg = ModelConfig.from_dict(trunk["config"])
    dev = torch.device("cpu")
    prec = resolve_precision("auto", dev)
    model = build_expert_model(rd, cfg, 0, dev, bf16_trunk=prec == "bf16", init="random", trunk_path=rd.module_file(0))
    pass_s, errs, shas = 0.0, [], {}
    for i in ids:
        meta = read_module_meta(rd, i)
        tensors = dict(read_safetensors(rd.module_file(i)))
        model.load_expert(tensors)
        stats = RouterStats(cfg.n_layers, cfg.dim)
        t0 = time.perf_counter()
        evaluate(model, load_tokens(rd.shard(i), f"shard {i}"), k, "single", dev, prec, hook=stats.hook)
        pass_s += time.perf_counter() - t0
        new = stats.tensors()
        for name, mu in new.items():
            ref = tensors[name].float()
            errs.append(float((mu - ref).norm() / ref.norm()))
        keep = {kk: vv for kk, vv in meta.items() if kk not in ("sha256", "blake3", "bytes", "file", "name")}
        m = write_module(v, i, {**tensors, **new}, {**keep, "router_stats_count": stats.n})
        shas[m["name"]] = m["sha256"]
    from safetensors.numpy import load_file

    pooled = json.loads(rd.router_stats_meta.read_text())
    write_router_stats(v, load_file(str(rd.router_stats)), {**{kk: vv for kk, vv in pooled.items()
                                                               if kk not in ("sha256", "blake3", "bytes", "file", "name",
                                                                             "format", "version", "kind")},
                                                            "experts": shas})
    return v, pass_s, {"mean_rel_err": float(np.mean(errs)), "max_rel_err": float(np.max(errs))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--tokens", default="1024,4096,16384,65536")
    ap.add_argument("--out", type=Path, default=Path("/tmp/stats-tokens"))
    ap.add_argument("--max-tokens-per-domain", type=int, default=32768)
    a = ap.parse_args()

    from mfgguf.converters.assemble import assemble
    from mfgguf.run import RunDir
    from mfgguf.runtime.perplexity import perplexity_by_domain

    rd = RunDir(a.run)
    n = int(rd.info()["n_experts"])
    ids = [i for i in range(1, n + 1) if rd.module_meta(i).is_file()]
    trained = sorted({d for i in ids for d in json.loads(rd.module_meta(i).read_text()).get("shard_domains") or []})
    held = rd.validation_tokens(a.max_tokens_per_domain)  # a choice of statistics: read validation, never test
    print(json.dumps({"bench": "stats_tokens", "event": "start", "experts": ids, "trained_domains": trained,
                      **cpu_flags()}), flush=True)
    def score(root: Path, gguf: Path) -> dict:
        assemble(root, gguf, quant="q8_0", experts=ids, force=True, progress=False)
        r = perplexity_by_domain(gguf, held)
        gguf.unlink()
        nll = sum(r["domains"][d]["nll"] * r["domains"][d]["n_tokens"] for d in trained)
        cnt = sum(r["domains"][d]["n_tokens"] for d in trained)
        return {"ppl": {d: round(x["ppl"], 4) for d, x in r["domains"].items()},
                "mixed_trained": round(float(np.exp(nll / cnt)), 4), "mixed_all": round(r["overall"]["ppl"], 4)}

    rows = []
    for k in sorted(int(x) for x in a.tokens.split(",")):
        v, pass_s, err = view_with_means(rd, a.out / f"k{k}", ids, k)
        rows.append({"bench": "stats_tokens", "tokens": k, "pass_s": round(pass_s, 2),
                     **score(v.root, a.out / f"k{k}.gguf"), **err})
        shutil.rmtree(v.root)
    ref = rows[-1]["mixed_trained"]
    # the statistics as the experts recorded them (from training's last steps, or their own pass: --stats-from)
    metas = [json.loads(rd.module_meta(i).read_text()) for i in ids]
    rows.append({"bench": "stats_tokens", "tokens": "recorded", "pass_s": 0.0,
                 "router_stats_from": sorted({m.get("router_stats_from", "pass") for m in metas}),
                 "router_stats_count": sorted({m.get("router_stats_count") for m in metas}),
                 **score(rd.root, a.out / "recorded.gguf")})
    for row in rows:
        print(json.dumps({**row, "over_reference": round(row["mixed_trained"] / ref, 5)}), flush=True)


if __name__ == "__main__":
    main()
