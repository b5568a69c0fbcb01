"""The GGUF format as mfgguf writes it, declared once as data: types, tensor names, per-tensor type rules, keys.

Everything here is plain data or a pure function of metadata; the layout, the writer, the
reference model and `inspect` all read it, so a name or a type rule lives in one place.

Quant types mirror ggml's `enum ggml_type` (ggml.h) and its block sizes (gguf-py's
GGML_QUANT_SIZES holds the same numbers; a test checks they agree). Type rules follow
llama.cpp's `llama-quant.cpp` where it matters for quality and loading:
  - 1-D tensors (norms) and the router (`ffn_gate_inp`) stay F32;
  - `output.weight` becomes Q6_K for every quantized type except Q8_0 (which keeps Q8_0);
  - a row length that is not a multiple of the block size falls back like llama.cpp does:
    q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0, then any 32-block type -> f16.
  The q4_k/q5_k files are the "_S" flavour: no per-layer mix of higher types.

Layouts (`--layout`; the earlier names granitemoe and mixtral are still accepted, families.OLD_LAYOUTS):
  - shared-expert (granitemoe, qwen2moe): anchor = shared expert (`*_shexp`), routed experts stacked in `*_exps`;
  - folded (`llama`, qwen3moe): no shared expert, the anchor is folded into every routed expert
    (see assemble.py's docstring for why that is exact);
  - dense (`llama` arch, no experts): the trunk alone, anchor = `ffn_gate/up/down`.

Example:
    >>> tensor_type("blk.0.ffn_norm.weight", (64,), "q8_0")
    ('f32', 'norm (1-D) stays F32')
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from mfgguf.errors import MfggufError
from mfgguf.families import archs, family, layout_name, moe_arch

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32  # general.alignment default; every tensor's data starts at a multiple of it


@dataclass(frozen=True)
class QType:
    name: str  # mfgguf/CLI name
    ggml: int  # enum ggml_type value
    block: int  # elements per block
    type_size: int  # bytes per block

    def row_bytes(self, n: int) -> int:
        return n // self.block * self.type_size


QTYPES: dict[str, QType] = {q.name: q for q in (
    QType("f32", 0, 1, 4),
    QType("f16", 1, 1, 2),
    QType("q4_0", 2, 32, 18),
    QType("q4_1", 3, 32, 20),
    QType("q5_0", 6, 32, 22),
    QType("q5_1", 7, 32, 24),
    QType("q8_0", 8, 32, 34),
    QType("q4_k", 12, 256, 144),
    QType("q5_k", 13, 256, 176),
    QType("q6_k", 14, 256, 210),
    QType("bf16", 30, 1, 2),
)}
QTYPE_BY_ID = {q.ggml: q for q in QTYPES.values()}
USER_QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")  # what --quant accepts
K_QUANTS = ("q4_k", "q5_k", "q6_k")
FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "q4_0": "f16", "q4_1": "f16", "q5_0": "f16", "q5_1": "f16", "q8_0": "f16"}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* for general.file_type (informational)
FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q4_k": 14, "q5_k": 16, "q6_k": 18, "bf16": 32}
LAYOUTS = ("shared-expert", "folded")  # + "auto": the model family's own (families.resolve_layout)
ROUTERS = ("ridge", "centroid", "uniform", "random")


def qtype(name: str) -> QType:
    try:
        return QTYPES[name]
    except KeyError:
        raise MfggufError(f"unknown quant type {name!r}; choose one of {', '.join(USER_QUANTS)}") from None


def tensor_type(name: str, shape: tuple[int, ...], quant: str) -> tuple[str, str | None]:
    """Storage type of tensor `name` (numpy shape) for requested `quant`, and why it differs, if it does."""
    qtype(quant)
    if len(shape) == 1:
        return "f32", "norm (1-D) stays F32"
    if name.endswith("ffn_gate_inp.weight"):
        return "f32", "router stays F32"
    t, why = quant, None
    if name == "output.weight" and quant not in ("f32", "f16", "bf16", "q8_0"):
        t, why = "q6_k", "output head as llama.cpp: Q6_K"
    n = shape[-1]
    while n % QTYPES[t].block:
        nxt = FALLBACK[t]
        why = f"row length {n} not a multiple of {QTYPES[t].block}: {t} -> {nxt}"
        t = nxt
    return t, why


def tensor_nbytes(shape: tuple[int, ...], t: str) -> int:
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows * QTYPES[t].row_bytes(shape[-1])


# ---- tensor names ------------------------------------------------------------------------------

GLOBAL_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight")
ATTN = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")
FFN = ("gate", "up", "down")


def blk(l: int, t: str) -> str:
    return f"blk.{l}.{t}.weight"


def arch_of(layout: str, n_experts: int, family_name: str = "llama") -> str:
    """GGUF architecture for a layout and model family (families/): llama's are granitemoe, or llama (the folded
    layout and the dense trunk); qwen2's qwen2moe, or qwen2 for the trunk alone."""
    layout = layout_name(layout)
    if layout not in LAYOUTS:
        raise MfggufError(f"unknown layout {layout!r}; choose {' or '.join(LAYOUTS)}")
    f = family(family_name)
    return moe_arch(f, layout) if n_experts else f.gguf_arch


# What each written architecture's llama.cpp graph does, as tables derived from the families' declarations
# (families/family.py's Arch): a new architecture is declared in its family's file, not here.
ARCH_ROPE = {a.name: a.rope for a in archs().values()}  # "normal" adjacent pairs or "neox" halves; a family whose own
#   rotation differs (qwen2 written as llama) has its Q/K rows permuted on the way (writers/base.py)
SHEXP_GATED = tuple(a.name for a in archs().values() if a.shexp_gated)  # shared expert x sigmoid(ffn_gate_inp_shexp . x)
SHARED_EXPERT_ARCHS = tuple(a.name for a in archs().values() if a.shared_expert)  # the anchor is the shared expert
UNNORMALISED_TOPK = tuple(a.name for a in archs().values() if not a.renormalises_topk)  # top-k weighted by their
#   softmax probabilities as they are (llama.cpp's norm_w = false): top-1 is p x expert, not the expert
MOE_KEYS = {a.name: a.moe_keys for a in archs().values() if a.moe_keys}  # keys beyond the common ones (model_kv)
SHEXP_GATE_LOGIT_SCALE = 2.0 ** -64  # every entry of that gate's row (writers/qwen2moe.py)


# ---- tokenizer defaults --------------------------------------------------------------------------

# A plain role-prefixed template: llama.cpp chat front-ends (llama-cpp-python's Jinja formatter,
# llama-server) render it; the model was never chat-tuned, so it just continues the dialogue.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
EOS_TOKEN = "<|endoftext|>"
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # llama.cpp's llama_token_type (gguf.TokenType)


def model_kv(arch: str, cfg, *, n_experts: int, top_k: int, ff: int, shexp_ff: int | None) -> list[tuple[str, str, object]]:
    """Architecture keys as (key, value type, value); value types are gguf.GGUFValueType names.

    `ff` is `{arch}.feed_forward_length`: the routed expert width for MoE layouts (llama.cpp reads
    n_ff for the `_exps` shapes), the anchor width for the dense file.
    """
    a = arch
    kv = [
        (f"{a}.context_length", "UINT32", cfg.ctx_len),
        (f"{a}.embedding_length", "UINT32", cfg.dim),
        (f"{a}.block_count", "UINT32", cfg.n_layers),
        (f"{a}.feed_forward_length", "UINT32", ff),
        (f"{a}.attention.head_count", "UINT32", cfg.n_heads),
        (f"{a}.attention.head_count_kv", "UINT32", cfg.n_kv_heads),
        (f"{a}.rope.freq_base", "FLOAT32", float(cfg.rope_theta)),
        (f"{a}.rope.dimension_count", "UINT32", cfg.head_dim),
        (f"{a}.attention.layer_norm_rms_epsilon", "FLOAT32", float(cfg.norm_eps)),
        (f"{a}.vocab_size", "UINT32", cfg.vocab_size),
    ]
    if cfg.head_dim * cfg.n_heads != cfg.dim:  # Qwen3: heads of their own width; only then, so other files stay the same
        kv += [(f"{a}.attention.key_length", "UINT32", cfg.head_dim), (f"{a}.attention.value_length", "UINT32", cfg.head_dim)]
    if n_experts:
        kv += [(f"{a}.expert_count", "UINT32", n_experts), (f"{a}.expert_used_count", "UINT32", top_k)]
    for key, vt, what in MOE_KEYS.get(arch, ()):
        kv.append((f"{a}.{key}", vt, {"one": 1.0, "shexp_ff": shexp_ff, "expert_ff": cfg.expert_ff, "ff": ff}[what]))
    return kv


class VType(IntEnum):  # gguf_type; same numbers as gguf.GGUFValueType
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# ---- router statistics carried in the file (converters/routing/stats.py writes them, converters/extend.py reads them)

# What `mfgguf extend` needs to recompute the router in closed form without the modules. Per expert
# slot: its FFN-input means (layers, dim) f32 and their token count; per source (one RUN's pooled
# statistics): its second moment G (layers, dim, dim) f32 and the token count it is a mean over.
# The float arrays are one raw f32 block after the tensor data (converters/routing/stats.py), where no reader
# looks; the key-values below say where it is and how many arrays it holds.
RS_COUNTS = "mfgguf.router.counts"  # UINT64 [N]: tokens expert p's means are over
RS_EXPERT_SOURCE = "mfgguf.router.expert_source"  # UINT32 [N]: the source expert p came with
RS_SOURCES = "mfgguf.router.sources"  # STRING [S]: sha256 of each source's pooled statistics file ("" if none)
RS_SOURCE_COUNTS = "mfgguf.router.source_counts"  # UINT64 [S]: tokens each source's G is a mean over
RS_RIDGE = "mfgguf.router.has_second_moments"  # BOOL: the block holds each source's G after the means (ridge)
RS_OFFSET = "mfgguf.router.stats_offset"  # UINT64: the block (means, then G), offset in the data section
# files of mfgguf 0.1 carried the float arrays in the header instead, as base64 strings under these keys:
# the header readers refuse such a file (header.check_not_v01)
RS_OLD_BLOBS = ("mfgguf.router.means", "mfgguf.router.second_moments")

# records of router rows edited after assembly (JSON strings); they describe those rows only, so `extend`
# drops them when it recomputes the rows and keeps them with --keep-routing
CALIBRATION_KEY = "mfgguf.calibration"  # `mfgguf calibrate`: top-k, temperature and bias chosen, perplexities
TUNING_KEY = "mfgguf.router_tuning"  # `mfgguf tune-router`: settings and validation perplexities
ROUTING_RECORDS = (CALIBRATION_KEY, TUNING_KEY)
