"""Model and training configuration: dataclasses with a comment on every default, and named presets.

A preset is plain data: a `ModelConfig` (shapes) plus one `TrainConfig` for the trunk and one
for each expert. `vocab_size` and `n_experts` come from the RUN directory (the tokenizer and
the partition), not from the preset.

Example:
    >>> from mfgguf.config import get_preset
    >>> p = get_preset("tiny")
    >>> p.model.dim
    64
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

from mfgguf.errors import MfggufError

# The values a choice option takes, declared once: TrainConfig checks them when it is made (every
# preset, library call and CLI flag passes through it), and the CLI's help lists them.
ExpertInit = Literal["auto", "seed", "random", "anchor"]
StatsFrom = Literal["train", "pass"]
Shared = Literal["none", "norms", "attn", "all"]
Compile = Literal["off", "on", "auto"]
Schedule = Literal["cosine", "wsd"]
EXPERT_INITS: tuple[str, ...] = get_args(ExpertInit)
STATS_FROM: tuple[str, ...] = get_args(StatsFrom)
# Trunk tensors an expert job may train a private copy of (`train-expert --shared`), by GGUF name.
# Assembly merges the copies back into the trunk it writes (`assemble --merge`).
SHARED_CHOICES: tuple[str, ...] = get_args(Shared)
COMPILE_CHOICES: tuple[str, ...] = get_args(Compile)
SCHEDULES: tuple[str, ...] = get_args(Schedule)  # the LR schedules (mfgguf/train/engine/driver.py's lr_at)
CHOICES = {"expert_init": ExpertInit, "stats_from": StatsFrom, "shared": Shared, "compile": Compile,
           "schedule": Schedule}  # TrainConfig's choice fields and their values
FLAGS = {"expert_init": "--init"}  # CLI flags that are not --<field-name-with-dashes>


# A field added to ModelConfig or TrainConfig is an option of TrainOptions (mfgguf/options.py: its type, its help and
# the verbs that take it), or for ModelConfig one of its NOT_OPTIONS; tests/test_options.py fails until it is.
@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096  # overwritten by the RUN's tokenizer size
    dim: int = 256  # residual width (n_embd)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 8  # query heads; head_dim = dim // n_heads unless attn_head_dim says otherwise
    n_kv_heads: int = 4  # key/value heads (grouped-query attention when < n_heads)
    anchor_ff: int = 512  # hidden width of the always-on anchor SwiGLU (the shared expert)
    expert_ff: int = 512  # hidden width of each routed expert SwiGLU
    n_experts: int = 0  # routed experts in the assembled model; overwritten by the RUN
    top_k: int = 1  # experts used per token at inference (top-1 = the exact trained function)
    ctx_len: int = 256  # training context; also written as the GGUF context length
    rope_theta: float = 10000.0  # RoPE base frequency (llama.cpp's "normal" adjacent-pair rotation)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    seed_expert: bool = False  # the trunk also trains one expert-width FFN, the seed, that every expert starts
    #                            from (BTX-style upcycling); the trunk alone is then anchor + seed, a dense model
    family: str = "llama"  # the decoder family (mfgguf/families/): its rotation, extra tensors and GGUF archs
    attn_head_dim: int = 0  # imported Qwen3: a head width of its own (Q is n_heads x this wide); 0 = dim // n_heads
    rope_freq_factors: tuple[float, ...] = ()  # imported Llama 3.x: RoPE pair i's frequency is divided by entry i
    #                                            (llama.cpp's rope_freqs.weight); () = plain RoPE

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    def validate(self) -> None:
        if (self.dim % self.n_heads and not self.attn_head_dim) or self.n_heads % self.n_kv_heads:
            raise MfggufError(
                f"bad model shape: dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads};"
                " dim must divide by n_heads and n_heads by n_kv_heads"
            )
        if self.head_dim % 2:
            raise MfggufError(f"head_dim {self.head_dim} must be even for RoPE; change dim or n_heads")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:
            raise MfggufError(f"{len(self.rope_freq_factors)} rope frequency factors for head_dim {self.head_dim};"
                              f" there must be head_dim / 2 = {self.head_dim // 2}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if "rope_freq_factors" in known:  # a JSON list
            known["rope_freq_factors"] = tuple(float(x) for x in known["rope_freq_factors"])
        return cls(**known)

    # Parameter counts, used by `inspect`, the benchmarks and the dense baseline.
    def trunk_params(self) -> int:
        attn = self.dim * self.n_heads * self.head_dim * 2 + self.dim * self.n_kv_heads * self.head_dim * 2
        per_layer = attn + 3 * self.dim * self.trunk_ff + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.n_layers * per_layer + self.dim

    def non_embedding_params(self) -> int:
        """Trunk parameters outside the token embedding and output head: what tokens-per-parameter counts."""
        return self.trunk_params() - 2 * self.vocab_size * self.dim

    def expert_params(self) -> int:
        return self.n_layers * 3 * self.dim * self.expert_ff

    @property
    def trunk_ff(self) -> int:
        """FFN width the trunk trains and runs alone: the anchor, plus the seed when it has one."""
        return self.anchor_ff + (self.expert_ff if self.seed_expert else 0)


@dataclass(frozen=True)
class TrainConfig:
    tokens: int = 2_000_000  # training tokens (steps = tokens // (batch_size * ctx_len))
    batch_size: int = 16  # sequences per step
    lr: float = 3e-3  # peak learning rate (AdamW)
    min_lr_frac: float = 0.1  # the schedule decays to lr * min_lr_frac
    warmup_frac: float = 0.05  # share of steps with linear warm-up
    weight_decay: float = 0.1  # AdamW decoupled weight decay on matrices (not norms)
    grad_clip: float = 1.0  # global gradient-norm clip
    adam_eps: float = 1e-8  # AdamW epsilon: an element whose gradient is near this gets an update of any size
    #                         between 0 and lr, so rounding differences there are amplified by up to lr / eps
    seed: int = 1234  # init and data-order seed
    ckpt_every: int = 50  # steps between checkpoints (a killed run resumes from the last one)
    eval_tokens: int = 65_536  # held-out tokens scored per domain at the end of training
    expert_init: ExpertInit = "auto"  # experts: how an expert starts: seed (the trunk's seed FFN, all of it), random, or
    #                            anchor (the anchor's gate/up rows, zero down-projection); auto = seed if the trunk has one
    eval_every: int = 50  # steps between held-out evaluations during training (the curve); 0 = only at the end
    #                       (a small share of training time: docs/benchmarks.md)
    curve_tokens: int = 4096  # held-out tokens per domain at each curve point (cheaper than eval_tokens)
    stats_tokens: int = 0  # experts: shard tokens the router statistics (FFN-input means) are measured over, and
    #                        the pooled second moment over each expert's shard; 0 = 4 x eval_tokens
    #                        (fewer cost routed perplexity: scripts/bench/bench_stats_tokens.py)
    stats_from: StatsFrom = "train"  # experts: where those means come from: train = the forward of training's last steps that
    #                            cover stats_tokens (free; tailstats.py), pass = a pass over the shard after training
    shared: Shared = "none"  # experts: trunk tensors to also train a private copy of (SHARED_CHOICES): none (the FFN
    #                       only), norms, attn (norms + attention) or all
    shared_lr_scale: float = 1.0  # experts: peak LR of the shared copies = lr * this (same warm-up and cosine)
    compile: Compile = "off"  # torch.compile the training step: on, off, or auto = on for a schedule of at least
    #                           loop.COMPILE_MIN_FLOPS of matmul work without recompute. The step runs faster after a
    #                           one-off compile and a resumed run is bit-identical, but the whole recipe was slower with
    #                           it on 2 cores (the compile and each job's start eat the gain), so it is opt-in
    #                           (docs/benchmarks.md, the recipe's wall)
    rounds: int = 1  # experts: sync rounds R (with shared); the schedule is cut into R equal parts, `mfgguf sync`
    #                  between them; 1 = no communication between experts (the original contract)
    schedule: Schedule = "cosine"  # LR schedule: cosine (warm-up, cosine decay) or wsd (warm-up, stable at lr, then a 1-sqrt
    #                           cooldown); a wsd trunk keeps its state where the cooldown begins (the branch point) and
    #                           wsd experts start from it at its LR with no warm-up
    cooldown: float = 0.2  # wsd: share of the steps in the final cooldown (the share that matched cosine in
    #                        arXiv 2405.18392: docs/benchmarks.md)

    def __post_init__(self):
        """Refuse a choice outside its declared values, by the flag the user typed, before anything runs."""
        for name, kind in CHOICES.items():
            value, allowed = getattr(self, name), get_args(kind)
            if value not in allowed:
                flag = FLAGS.get(name, "--" + name.replace("_", "-"))
                raise MfggufError(f"unknown {flag} {value!r}; choose one of {', '.join(allowed)}")


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelConfig
    trunk: TrainConfig
    expert: TrainConfig
    description: str = ""


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        description="tests: trains in seconds",
        model=ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, anchor_ff=128, expert_ff=128, ctx_len=64),
        trunk=TrainConfig(tokens=40_000, batch_size=8, lr=3e-3, ckpt_every=10, eval_tokens=4096, eval_every=10,
                          curve_tokens=1024),
        expert=TrainConfig(tokens=20_000, batch_size=8, lr=3e-3, ckpt_every=10, eval_tokens=4096, eval_every=10,
                          curve_tokens=1024),
    ),
    "small": Preset(
        name="small",
        description="the demo: minutes on 2 cores",
        model=ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, anchor_ff=512, expert_ff=512, ctx_len=256),
        trunk=TrainConfig(tokens=1_500_000, batch_size=16, lr=2e-3, ckpt_every=25),
        # experts: the final held-out score is the curve's last point (eval_tokens = curve_tokens), and the router
        # statistics 4 x that: fewer move routed perplexity, more cost time after training for little
        # (docs/benchmarks.md, scripts/bench/bench_stats_tokens.py)
        expert=TrainConfig(tokens=400_000, batch_size=16, lr=2e-3, ckpt_every=25, eval_tokens=4096),
    ),
    "1b": Preset(
        name="1b",
        description="the mission: 100 experts of ~9.4M parameters, ~1.27B in total",
        model=ModelConfig(
            vocab_size=32768, dim=1024, n_layers=12, n_heads=16, n_kv_heads=4,
            anchor_ff=6144, expert_ff=256, n_experts=100, ctx_len=512,
        ),
        trunk=TrainConfig(tokens=50_000_000, batch_size=8, lr=6e-4, ckpt_every=100),
        expert=TrainConfig(tokens=5_000_000, batch_size=4, lr=1e-3, ckpt_every=100, eval_tokens=4096),
    ),
}

DEFAULT_PRESET = "small"  # where none is named: the commands' default, and what a record without a preset is read as


def shared_tensor_names(cfg: ModelConfig, choice: str) -> list[str]:
    """GGUF names of the trunk tensors that `--shared CHOICE` trains, in file order.

    norms = every RMSNorm weight; attn = norms + attention projections; all = the whole trunk
    (embeddings, output head and the anchor FFN too).

    Example:
        >>> shared_tensor_names(get_preset("tiny").model, "norms")[:2]
        ['blk.0.attn_norm.weight', 'blk.0.ffn_norm.weight']
    """
    if choice not in SHARED_CHOICES:
        raise MfggufError(f"unknown --shared {choice!r}; choose one of {', '.join(SHARED_CHOICES)}")
    if choice == "none":
        return []
    norms = ("attn_norm", "ffn_norm")
    attn = ("attn_q", "attn_k", "attn_v", "attn_output")
    anchor = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
    per = {"norms": norms, "attn": norms + attn, "all": norms + attn + anchor}[choice]
    names = ["token_embd.weight"] if choice == "all" else []
    for l in range(cfg.n_layers):
        names += [f"blk.{l}.{t}.weight" for t in per]
    names += ["output_norm.weight"] + (["output.weight"] if choice == "all" else [])
    return names


def get_preset(name: str) -> Preset:
    """Return the named preset; raise a one-line error listing the names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise MfggufError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


__all__ = ["ModelConfig", "TrainConfig", "Preset", "PRESETS", "DEFAULT_PRESET", "SCHEDULES", "SHARED_CHOICES", "EXPERT_INITS", "STATS_FROM",
           "COMPILE_CHOICES", "CHOICES", "FLAGS", "get_preset", "shared_tensor_names"]
