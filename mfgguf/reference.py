"""The PyTorch reference of an assembled model: the same trunk, experts, router rows and top-k.

`reference_model(run, gguf_path)` reads which experts (in which slot order), which top-k and
which router rows an assembled file holds (the router is read back from its F32
`ffn_gate_inp` tensors, so the reference routes exactly like the file) and loads the f32
module weights into `mfgguf.model.Transformer(cfg, n_experts=N)`. Forward with
`route="router"` (or `route="anchor"` for a dense trunk-alone file) is what llama.cpp should
compute; parity tests and evaluation compare the two. Both layouts have the same reference:
the folded layout's experts compute anchor + expert exactly (see assemble.py).
Trunk tensors that the experts trained copies of are merged the way the file says
(`mfgguf.merge`) by the assembler's own functions (modules/merge.py).

Example:
    >>> model, route = reference_model(Path("RUN"), Path("model.gguf"))
    >>> logits = model(idx, route=route)  # (B, T, V)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from mfgguf.families import layout_name
from mfgguf.modules.module import model_config
from mfgguf.modules.tokenizer import run_tokenizer_kv
from mfgguf.modules.merge import merge_arrays
from mfgguf.gguf.header import read_gguf_header
from mfgguf.gguf.schema import UNNORMALISED_TOPK
from mfgguf.errors import MfggufError, retired
from mfgguf.model import Transformer, trunk_model
from mfgguf.run import SHARED_PREFIX, RunDir, read_module


def gguf_provenance(path: Path) -> dict:
    """experts, top_k, layout, router and the router rows per layer (list of (N, dim) f32) of a file."""
    h = read_gguf_header(path)  # our parser: gguf-py's reader takes seconds over a real base's vocabulary
    value = h.value
    experts = value("mfgguf.experts") or []
    routed_seed = bool(value("mfgguf.complement"))  # routed slot 0 is the seed
    rows = {}
    with open(path, "rb") as f:
        for t in h.tensors:
            if t.name.endswith("ffn_gate_inp.weight"):
                dtype = {0: np.float32, 1: np.float16}.get(t.ggml_type)  # ggml's F32, F16: what assembly writes
                if dtype is None:
                    raise MfggufError(f"{path}: {t.name} is ggml type {t.ggml_type}; router rows are F32 or F16")
                f.seek(h.data_offset + t.offset)
                n = int(np.prod(t.shape))
                rows[int(t.name.split(".")[1])] = np.fromfile(f, dtype, n).astype(np.float32).reshape(
                    len(experts) + routed_seed, -1)  # (N, dim)
    return {"experts": [int(e) for e in experts], "top_k": int(value("mfgguf.top_k") or 0),
            "layout": layout_name(value("mfgguf.layout") or ""), "router": value("mfgguf.router"),
            "merge": value("mfgguf.merge") or "none",
            "router_rows": [rows[l] for l in sorted(rows)], "routed_seed": routed_seed, "arch": value("general.architecture")}


def merged_trunk_tensors(rd: RunDir, trunk: dict[str, np.ndarray], experts: list[int], merge: str) -> dict[str, np.ndarray]:
    """{trunk tensor: merged f32 array} for every tensor an included expert trained a copy of.

    The experts' copies are read one tensor at a time; the arithmetic is merge.py's (the assembler's).
    """
    from safetensors import safe_open

    if merge == "none":
        return {}
    metas = {i: read_module(rd, i) for i in experts}
    out = {}
    for name in trunk:  # trunk order; copies in slot order, as the assembler adds them
        holders = [i for i in experts if name in metas[i].shared_tensors and not metas[i].shared_merged]
        if not holders:
            continue
        copies = []
        for i in holders:
            with safe_open(str(rd.module_file(i)), "np") as f:
                copies.append(f.get_tensor(SHARED_PREFIX + name))
        tokens = [int(metas[i].tokens_seen or 0) for i in holders]
        out[name] = merge_arrays(merge, np.asarray(trunk[name], np.float32), copies, tokens)
    return out


def reference_model(run: Path, gguf_path: Path | None = None, *, experts: list[int] | None = None,
                    router_rows: list[np.ndarray] | None = None, top_k: int = 1, merge: str = "mean",
                    routed_seed: bool = False) -> tuple[Transformer, str]:
    """Build the f32 reference Transformer of an assembled model; returns (model, route).

    With `gguf_path`, experts, top-k, router rows and the merge come from that file; otherwise
    pass them (merge as `assemble`'s). `routed_seed`: the seed is routed slot 0, the experts follow it.
    """
    from safetensors.torch import load_file

    rd = RunDir(run)
    if gguf_path is not None:
        prov = gguf_provenance(Path(gguf_path))
        experts, top_k, router_rows = prov["experts"], prov["top_k"], prov["router_rows"]
        routed_seed = prov["routed_seed"]
        merge = prov["merge"]
        if merge == "ties":  # the file runs in llama.cpp as it is; only its trunk cannot be rebuilt here
            raise retired(f"{gguf_path} was assembled", "--merge ties", "assemble it again with --merge mean")
    experts = list(experts or [])
    _, vocab = run_tokenizer_kv(rd)
    trunk_meta = read_module(rd, 0)

    class _M:  # the minimal shape model_config reads
        meta = trunk_meta

    cfg = replace(model_config(_M, vocab), n_experts=len(experts) + routed_seed, top_k=max(1, top_k))
    trunk = load_file(str(rd.module_file(0)))
    if not experts:  # the trunk alone: anchor, + the seed FFN when it has one
        model, route = trunk_model(cfg)
        model.load_trunk(trunk)
        if cfg.seed_expert:
            model.load_seed(trunk)
        return model.eval(), route
    model = Transformer(cfg, n_experts=cfg.n_experts)
    merged = merged_trunk_tensors(rd, {k: v.numpy() for k, v in trunk.items()}, experts, merge)
    trunk.update({k: torch.from_numpy(v) for k, v in merged.items()})
    model.load_trunk(trunk)
    if routed_seed:
        model.load_seed(trunk)  # into slot 0
    for slot, i in enumerate(experts, start=int(routed_seed)):
        model.load_expert(load_file(str(rd.module_file(i))), slot)
    if router_rows is None or len(router_rows) != cfg.n_layers:
        raise MfggufError("the reference needs router rows for every layer; pass gguf_path or router_rows")
    model.set_router([torch.from_numpy(np.asarray(w, np.float32)) for w in router_rows])
    if gguf_path is not None and prov["arch"] in UNNORMALISED_TOPK:
        for layer in model.layers:
            layer.renormalise_topk = False
    return model.eval(), "router"


def reference_routes(run: Path, gguf_path: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The reference's routing of token `ids` (one sequence): ((T, L, k) experts chosen by slot, (T, L, k) their
    weights), what the file's llama.cpp graph chooses (runtime/route.py reads it there)."""
    model, _ = reference_model(run, gguf_path)
    k = min(model.cfg.top_k, model.cfg.n_experts)
    slots, weights = [], []

    def hook(layer, x):
        rows = model.layers[layer].router  # (E, C)
        probs = torch.softmax(x.float() @ rows.float().T, dim=-1)[0]  # (T, E)
        w, idx = probs.topk(k, dim=-1)  # (T, k)
        if model.layers[layer].renormalise_topk:
            w = w / w.sum(-1, keepdim=True)
        slots.append(idx.numpy())
        weights.append(w.double().numpy())

    with torch.no_grad():
        model(torch.as_tensor([ids], dtype=torch.int64), route="router", hook=hook)
    return np.stack(slots, axis=1), np.stack(weights, axis=1)  # (T, L, k)
