"""Which experts answered: for every token and layer, the experts llama.cpp's router chose and their weights.

Read from llama.cpp's own graph while it runs: llama-cpp-python's evaluation callback (`cb_eval`) is asked about
every tensor the graph computes and keeps two of each MoE layer, `ffn_moe_probs-L` (the softmax over the experts,
[n_expert, tokens]) and `ffn_moe_topk-L` (the chosen experts, [k, tokens]). A chosen expert's weight is its
probability, renormalised over the k chosen where the architecture does so (granitemoe, llama with experts, qwen3moe;
qwen2moe weights by the probabilities as they are). Every token is an output, so the last layer computes them all.
Each slot is named by the file's labels (converters/plan/names.py; the seed's slot, where routed, is the base's
own FFN); every token also runs the anchor, the always-on FFN, whatever the router chose.

`summary` gives each expert's share of the token-layers (top-1, and by weight); `heatmap` draws tokens x layers
coloured by each one's top-1 expert. tests/runtime/test_route.py holds them to the PyTorch reference's routing.

Example:
    >>> r = routes(Path("model.gguf"), "def main():")
    >>> summary(r)["experts"]["python"]["top1"]
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.gguf.slots import routed_slots

CAPTURED = ("ffn_moe_probs", "ffn_moe_topk")
_NAME = re.compile(rf"({'|'.join(CAPTURED)})-(\d+)")


class _Tensor(ctypes.Structure):
    """The head of ggml's `struct ggml_tensor` (ggml.h), as far as the data pointer and the name."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


GGML_F32, GGML_I32 = 0, 26  # ggml_type values of what is read


@dataclass
class Routes:
    ids: list[int]  # the tokens routed
    pieces: list[str]  # each token's text
    slots: np.ndarray  # (T, L, k) int: the experts chosen, by slot
    weights: np.ndarray  # (T, L, k) float: each one's weight in the layer's sum
    labels: list[str]  # each slot's name
    arch: str

    def as_json(self) -> dict:
        return {"tokens": self.pieces, "ids": self.ids, "labels": self.labels, "experts_per_token": int(self.slots.shape[2]),
                "layers": int(self.slots.shape[1]), "slots": self.slots.tolist(),
                "weights": np.round(self.weights, 6).tolist(), "summary": summary(self)}


def slot_labels(header) -> list[str]:
    """Each routed slot's label (gguf/slots.py): the seed's where the file routes it, then the experts'."""
    return [s["label"] for s in routed_slots(header.value)]


def routes(model: Path, text: str | None = None, *, ids: list[int] | None = None, experts_per_token: int | None = None,
           threads: int | None = None, batch: int = 512, llm=None) -> Routes:
    """The router's choices for TEXT (tokenized with a BOS where the vocab adds one), or for token `ids`; `llm` (an
    open Llama of MODEL, with the same experts a token) lends its weights instead of a second load."""
    import llama_cpp

    from mfgguf.gguf.header import read_gguf_header
    from mfgguf.gguf.schema import UNNORMALISED_TOPK
    from mfgguf.runtime.context import llama_context
    from mfgguf.runtime.llm import experts_override, read_header

    header = read_header(model)
    if not header.get("n_experts"):
        raise MfggufError(f"{model} has no routed experts; `mfgguf route` shows a MoE's routing")
    overrides = experts_override(header, experts_per_token)
    got: dict[str, list[np.ndarray]] = {}
    base = _ggml_base()

    @llama_cpp.ggml_backend_sched_eval_callback
    def cb(t, ask, _):
        tensor = ctypes.cast(t, ctypes.POINTER(_Tensor)).contents
        name = tensor.name.decode("utf-8", "replace")
        want = _NAME.fullmatch(name) is not None  # not its views ("ffn_moe_probs-3 (reshaped)")
        if ask or not want:
            return bool(want) if ask else True
        got.setdefault(name, []).append(_read(tensor, base))
        return True

    if ids is None and text is None:
        raise MfggufError("nothing to route; pass a text or a --file")
    with llama_context(model, n_ctx=_ctx(header, ids, text), n_batch=batch, threads=threads, overrides=overrides,
                       cb_eval=cb, model_of=llm) as lc:
        if ids is None:
            ids = lc.model.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        if not ids:
            raise MfggufError("the text has no tokens; pass some text to route")
        if len(ids) > llama_cpp.llama_n_ctx(lc.ctx.ctx):
            raise MfggufError(f"{len(ids)} tokens are more than the model's context of {header['context_length']}; pass"
                              " a shorter text")
        _decode_all(lc, ids)
        pieces = [lc.model.token_to_piece(i).rstrip(b"\0").decode("utf-8", "replace") for i in ids]
    n_layers = 1 + max(int(k.split("-")[1]) for k in got) if got else 0
    if not n_layers:
        raise MfggufError(f"llama.cpp computed no router in {Path(model).name}; is it a MoE file mfgguf wrote?")
    probs = [np.concatenate(got[f"ffn_moe_probs-{l}"], axis=0) for l in range(n_layers)]  # each (T, n_expert)
    topk = [np.concatenate(got[f"ffn_moe_topk-{l}"], axis=0) for l in range(n_layers)]  # each (T, k)
    slots = np.stack(topk, axis=1).astype(np.int64)  # (T, L, k)
    w = np.stack([np.take_along_axis(p, s, axis=1) for p, s in zip(probs, topk)], axis=1)  # (T, L, k)
    if header["arch"] not in UNNORMALISED_TOPK:
        w = w / w.sum(axis=-1, keepdims=True)
    return Routes(list(map(int, ids)), pieces, slots, w.astype(np.float64), slot_labels(read_gguf_header(model)),
                  header["arch"])


def route_text(model: Path, text: str | None = None, *, file: Path | None = None, experts_per_token: int | None = None,
               png: Path | None = None, threads: int | None = None) -> Routes:
    """Show which experts MODEL's router chose for every token of TEXT (or --file FILE), in every layer.

    Read from llama.cpp's own graph as it runs the text: each layer's chosen experts and their weights, named by the
    labels the file holds (their domains, or their clusters' terms). Prints each expert's share of the token-layers
    (first choice, and by weight; every token also runs the always-on anchor) and each token's most chosen experts;
    --json prints everything, every token and layer included; --png FILE draws tokens x layers coloured by each one's
    first choice. --experts-per-token K routes to K experts instead of the file's own count.

    Example:
        >>> route_text(Path("model.gguf"), "def main():", png=Path("routes.png"))
    """
    if file is not None:
        if not Path(file).is_file():
            raise MfggufError(f"text file not found: {file}")
        text = Path(file).read_text(encoding="utf-8", errors="replace")
    if not text:
        raise MfggufError("nothing to route; pass a text or a --file")
    r = routes(model, text, experts_per_token=experts_per_token, threads=threads)
    if png is not None:
        heatmap(r, Path(png))
    return r


def _ctx(header: dict, ids, text) -> int:
    """The context to route in: the model's, never more than the text needs (it is allocated up front)."""
    need = len(ids) if ids is not None else 4 * len(text or "") + 8  # a token holds at least a quarter of a character
    return max(16, min(header["context_length"], need))


def _decode_all(lc, ids: list[int]) -> None:
    """Every token decoded, in batches of n_batch, every one an output (so the last layer routes them all)."""
    import llama_cpp

    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(lc.ctx.ctx), True)
    batch = llama_cpp.llama_batch_init(lc.n_batch, 0, 1)
    try:
        for b0 in range(0, len(ids), lc.n_batch):
            part = ids[b0: b0 + lc.n_batch]
            for j, tok in enumerate(part):
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = tok, b0 + j, 1, True
                batch.seq_id[j][0] = 0
            batch.n_tokens = len(part)
            if llama_cpp.llama_decode(lc.ctx.ctx, batch) != 0:
                raise MfggufError("llama.cpp failed to decode the text; pass a shorter one")
    finally:
        llama_cpp.llama_batch_free(batch)


def _ggml_base():
    """libggml-base, beside libllama in llama-cpp-python's package: ggml_get_name's check of the struct above."""
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_get_name.restype, lib.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    return lib


def _read(t: _Tensor, base) -> np.ndarray:
    """A 2-D tensor's data as (columns, rows): ne[1] tokens of ne[0] values, by its strides (topk is a view)."""
    if base.ggml_get_name(ctypes.addressof(t)).decode("utf-8", "replace") != t.name.decode("utf-8", "replace"):
        raise MfggufError("this llama.cpp's ggml_tensor is not laid out as mfgguf reads it; routing cannot be shown")
    dtype = {GGML_F32: np.float32, GGML_I32: np.int32}.get(t.type)
    if dtype is None:
        raise MfggufError(f"llama.cpp's {t.name.decode()} is ggml type {t.type}; routing reads F32 and I32")
    ne0, ne1 = int(t.ne[0]), int(t.ne[1])
    nb0, nb1 = int(t.nb[0]), int(t.nb[1])
    span = (ne1 - 1) * nb1 + (ne0 - 1) * nb0 + np.dtype(dtype).itemsize
    raw = (ctypes.c_uint8 * span).from_address(t.data)  # a CPU tensor: its data is host memory
    return np.ndarray((ne1, ne0), dtype, buffer=raw, offset=0, strides=(nb1, nb0)).copy()


def summary(r: Routes) -> dict:
    """{"experts": {label: {"top1": share of token-layers it was first in, "weight": its share of the routing
    weight}}, "token_layers", "anchor": "every token"}: the file's experts, the most used first."""
    T, L, _ = r.slots.shape
    top1 = np.bincount(r.slots[:, :, 0].ravel(), minlength=len(r.labels)) / (T * L)
    weight = np.zeros(len(r.labels))
    np.add.at(weight, r.slots.ravel(), r.weights.ravel())
    weight /= max(weight.sum(), 1e-30)
    order = np.argsort(-top1, kind="stable")
    return {"token_layers": int(T * L), "anchor": "runs for every token in every layer, beside the experts chosen",
            "experts": {r.labels[s]: {"slot": int(s), "top1": float(top1[s]), "weight": float(weight[s])} for s in order}}


def heatmap(r: Routes, path: Path, max_tokens: int = 160) -> Path:
    """A PNG: tokens (across) x layers (down), each cell coloured by the token's top-1 expert in that layer."""
    from mfgguf.plots import pyplot, save_figure

    plt = pyplot()
    T = min(len(r.ids), max_tokens)
    first = r.slots[:T, :, 0].T  # (L, T)
    n = len(r.labels)
    cmap = plt.get_cmap("tab20", max(n, 2))
    fig, ax = plt.subplots(figsize=(min(24, 2 + 0.16 * T), 1.5 + 0.18 * first.shape[0]))
    ax.imshow(first, aspect="auto", cmap=cmap, vmin=-0.5, vmax=max(n, 2) - 0.5, interpolation="nearest")
    ax.set(xlabel="token", ylabel="layer", title=f"top-1 expert of each token in each layer ({T} of {len(r.ids)} tokens)")
    step = max(1, T // 40)
    ax.set_xticks(range(0, T, step), [repr(p)[1:-1][:8] for p in r.pieces[:T:step]], rotation=90, fontsize=6)
    used = sorted(set(first.ravel().tolist()))
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(s)) for s in used]
    ax.legend(handles, [r.labels[s] for s in used], fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return save_figure(fig, path, plt)


def per_token(r: Routes, top: int = 2) -> list[tuple[str, str]]:
    """Each token's text and its most chosen experts over the layers (top-1 counts), as `label n/L`."""
    L = r.slots.shape[1]
    out = []
    for t, piece in enumerate(r.pieces):
        c = np.bincount(r.slots[t, :, 0], minlength=len(r.labels))
        best = [s for s in np.argsort(-c, kind="stable")[:top] if c[s]]
        out.append((piece, ", ".join(f"{r.labels[s]} {c[s]}/{L}" for s in best)))
    return out


__all__ = ["Routes", "heatmap", "per_token", "route_text", "routes", "slot_labels", "summary"]
