"""Training options a user sets on top of a preset, declared once: the `TrainOptions` dataclass below.

`TrainOptions` has one field per `TrainConfig` field and per `ModelConfig` field a trunk may change,
each None = "the preset's", typed as the config field is. Each field's metadata declares, beside it,
its scope (which train verbs take it: `TAKES`) and its help (the CLI's: `option_help`); the config
dataclasses' comments stay the documentation of the defaults. tests/test_options.py keeps the class in
step with those dataclasses. A verb refuses an option outside its scope in one line (`check`), and
`train-experts` passes the options to every job (`JobOptions`: a child's command line, or a Ray task's
arguments). `parse_experts` reads every `--experts` selection (train-experts, assemble).

Example:
    >>> o = TrainOptions(lr=1e-3, anchor_ff=256)
    >>> o.train_config(get_preset("tiny").trunk).lr, o.model_changes()
    (0.001, {'anchor_ff': 256})
    >>> o.argv()
    ['--lr', '0.001', '--anchor-ff', '256']
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cache

from mfgguf.config import FLAGS, Compile, ExpertInit, Schedule, Shared, StatsFrom, TrainConfig
from mfgguf.errors import MfggufError

# An option's scope, which train verbs take it: "both" (train-trunk and the expert verbs), "expert" (train-expert
# and train-experts), "trunk" (train-trunk), or "model" (a ModelConfig field: the trunk's shape, train-trunk only;
# experts use their trunk's).
TAKES = {"trunk": ("both", "trunk", "model"), "expert": ("both", "expert")}  # a job's kind -> the scopes it takes
_WHAT = {"expert": "an expert option", "trunk": "a trunk option",
         "model": "a model shape option (experts use the trunk's)"}  # how a refusal names a scope
# The ModelConfig fields that are no option: vocab_size and n_experts come from the RUN, top_k is assembly's;
# family, attn_head_dim and rope_freq_factors describe an imported base (import-base sets them), not a trunk trained here.
NOT_OPTIONS = ("vocab_size", "n_experts", "top_k", "family", "attn_head_dim", "rope_freq_factors")


def _option(scope: str, help: str) -> typing.Any:
    """A TrainOptions field, None = the preset's: `scope` says which verbs take it, `help` is its CLI help."""
    return field(default=None, metadata={"scope": scope, "help": help})


@dataclass(frozen=True)
class TrainOptions:
    """Training options over a preset, each None = the preset's. Unknown names are a TypeError."""

    # TrainConfig's fields, in its order
    tokens: int | None = _option("both", "training tokens (steps = tokens // (batch_size * ctx_len))")
    batch_size: int | None = _option("both", "sequences per step")
    lr: float | None = _option("both", "peak learning rate (AdamW)")
    min_lr_frac: float | None = _option("both", "the schedule decays to lr * min_lr_frac")
    warmup_frac: float | None = _option("both", "share of steps with linear warm-up")
    weight_decay: float | None = _option("both", "AdamW decoupled weight decay on matrices (not norms)")
    grad_clip: float | None = _option("both", "global gradient-norm clip")
    adam_eps: float | None = _option("both", "AdamW epsilon: an element whose gradient is near this gets an update of"
                                     " any size between 0 and lr, so rounding differences there are amplified by up"
                                     " to lr / eps")
    seed: int | None = _option("both", "init and data-order seed")
    ckpt_every: int | None = _option("both", "steps between checkpoints (a killed run resumes from the last one)")
    eval_tokens: int | None = _option("both", "held-out tokens scored per domain at the end of training")
    expert_init: ExpertInit | None = _option("expert", "how an expert starts: seed (the trunk's seed FFN, all of it),"
                                             " random, or anchor (the anchor's gate/up rows, zero down-projection);"
                                             " auto = seed if the trunk has one")
    eval_every: int | None = _option("both", "steps between held-out evaluations during training (the curve); 0 = only"
                                     " at the end (a small share of training time: docs/benchmarks.md)")
    curve_tokens: int | None = _option("both", "held-out tokens per domain at each curve point (cheaper than"
                                       " eval_tokens)")
    stats_tokens: int | None = _option("expert", "shard tokens the router statistics (FFN-input means) are measured"
                                       " over, and the pooled second moment over each expert's shard; 0 = 4 x"
                                       " eval_tokens (fewer cost routed perplexity:"
                                       " scripts/bench/bench_stats_tokens.py)")
    stats_from: StatsFrom | None = _option("expert", "where those means come from: train = the forward of training's"
                                           " last steps that cover stats_tokens (free; tailstats.py), pass = a pass"
                                           " over the shard after training")
    shared: Shared | None = _option("expert", "trunk tensors to also train a private copy of (SHARED_CHOICES): none"
                                    " (the FFN only), norms, attn (norms + attention) or all")
    shared_lr_scale: float | None = _option("expert", "peak LR of the shared copies = lr * this (same warm-up and"
                                            " cosine)")
    compile: Compile | None = _option("both", "torch.compile the training step: on, off, or auto = on for a schedule"
                                      " of at least loop.COMPILE_MIN_FLOPS of matmul work without recompute. The step"
                                      " runs faster after a one-off compile and a resumed run is bit-identical, but"
                                      " the whole recipe was slower with it on 2 cores (the compile and each job's"
                                      " start eat the gain), so it is opt-in (docs/benchmarks.md, the recipe's wall)")
    rounds: int | None = _option("expert", "sync rounds R (with shared); the schedule is cut into R equal parts,"
                                 " `mfgguf sync` between them; 1 = no communication between experts (the original"
                                 " contract)")
    schedule: Schedule | None = _option("both", "LR schedule: cosine (warm-up, cosine decay) or wsd (warm-up, stable"
                                        " at lr, then a 1-sqrt cooldown); a wsd trunk keeps its state where the"
                                        " cooldown begins (the branch point) and wsd experts start from it at its LR"
                                        " with no warm-up")
    cooldown: float | None = _option("both", "wsd: share of the steps in the final cooldown (the share that matched"
                                     " cosine in arXiv 2405.18392: docs/benchmarks.md)")
    # ModelConfig's fields a trunk may change (not NOT_OPTIONS), in its order
    dim: int | None = _option("model", "residual width (n_embd)")
    n_layers: int | None = _option("model", "transformer blocks")
    n_heads: int | None = _option("model", "query heads; head_dim = dim // n_heads unless attn_head_dim says"
                                  " otherwise")
    n_kv_heads: int | None = _option("model", "key/value heads (grouped-query attention when < n_heads)")
    anchor_ff: int | None = _option("model", "hidden width of the always-on anchor SwiGLU (the shared expert)")
    expert_ff: int | None = _option("model", "hidden width of each routed expert SwiGLU")
    ctx_len: int | None = _option("model", "training context; also written as the GGUF context length")
    rope_theta: float | None = _option("model", "RoPE base frequency (llama.cpp's \"normal\" adjacent-pair rotation)")
    norm_eps: float | None = _option("model", "RMSNorm epsilon")
    seed_expert: bool | None = _option("model", "the trunk also trains one expert-width FFN, the seed, that every"
                                       " expert starts from (BTX-style upcycling); the trunk alone is then anchor +"
                                       " seed, a dense model")

    def set_fields(self) -> dict:
        """The options given (not None), in declaration order."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def train_config(self, base: TrainConfig) -> TrainConfig:
        """`base` (a preset's TrainConfig) with the TrainConfig options given."""
        return replace(base, **{k: v for k, v in self.set_fields().items() if k in TrainConfig.__dataclass_fields__})

    def model_changes(self) -> dict:
        """The ModelConfig options given, for `dataclasses.replace` on the preset's model."""
        return {k: v for k, v in self.set_fields().items() if k in MODEL_OPTIONS}

    def argv(self) -> list[str]:
        """The options given as CLI flags (a child `mfgguf train-expert` process's)."""
        out: list[str] = []
        for k, v in self.set_fields().items():
            out += [typed_flag(k, v)] if isinstance(v, bool) else [flag(k), str(v)]
        return out

    def check(self, kind: str, verb: str) -> TrainOptions:
        """Refuse, in one line, the first option given that a `kind` job ("trunk" or "expert") does not take
        (`TAKES`); `verb` names the verb refusing it. Returns the options.

        Example:
            >>> TrainOptions(rounds=4).check("trunk", "train-trunk")
            Traceback (most recent call last):
            mfgguf.errors.MfggufError: --rounds is an expert option; train-trunk does not take it
        """
        for k, v in self.set_fields().items():
            if scope(k) not in TAKES[kind]:
                raise MfggufError(f"{typed_flag(k, v)} is {_WHAT[scope(k)]}; {verb} does not take it")
        return self


MODEL_OPTIONS = tuple(f.name for f in fields(TrainOptions) if f.metadata["scope"] == "model")


def flag(name: str) -> str:
    """The CLI flag of an option: `--batch-size` for batch_size, `--init` for expert_init."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def typed_flag(name: str, value) -> str:
    """The flag as the user typed it: `--no-seed-expert` for seed_expert=False, else `flag(name)`."""
    return "--no-" + flag(name)[2:] if value is False else flag(name)


def scope(name: str) -> str:
    """An option's scope: both, expert, trunk or model (which verbs take it: `TAKES`)."""
    return TrainOptions.__dataclass_fields__[name].metadata["scope"]


def option_names(kind: str) -> list[str]:
    """The options a `kind` job ("trunk" or "expert") takes, in declaration order."""
    if kind not in TAKES:
        raise ValueError(f"unknown kind {kind!r}")
    return [f.name for f in fields(TrainOptions) if f.metadata["scope"] in TAKES[kind]]


@cache
def option_types() -> dict[str, type]:
    """{option: its type without None} (int, float, str or bool), for building CLI options. A choice
    (a Literal) is a str here: TrainConfig checks its value, with the one error every caller gets."""
    out = {}
    for name, hint in typing.get_type_hints(TrainOptions).items():
        kind = next(a for a in typing.get_args(hint) if a is not type(None))
        out[name] = str if typing.get_origin(kind) is typing.Literal else kind
    return out


def option_help(name: str) -> str:
    """An option's help: its declared help (after "experts: " for an expert option), first letter capitalized,
    and where its default comes from.

    Example:
        >>> option_help("lr")
        "Peak learning rate (AdamW) (default: the preset's)."
    """
    text = TrainOptions.__dataclass_fields__[name].metadata["help"]
    text = f"experts: {text}" if scope(name) == "expert" else text
    return f"{text[:1].upper()}{text[1:]} (default: the preset's)."


@dataclass(frozen=True)
class JobOptions:
    """What every expert job of `train-experts` runs with, the same for all of them."""

    train: TrainOptions = field(default_factory=TrainOptions)  # training options over the trunk's preset
    device: str = "cpu"  # cpu or cuda
    precision: str = "auto"  # auto (bf16 where native, else fp32), bf16 or fp32

    def argv(self) -> list[str]:
        """The flags of a child `mfgguf train-expert` process (defaults left out)."""
        return (self.train.argv() + (["--device", self.device] if self.device != "cpu" else [])
                + (["--precision", self.precision] if self.precision != "auto" else []))

    def to_dict(self) -> dict:
        """JSON-able, for a Ray task's arguments (and the key of its temp RUN)."""
        return {"train": self.train.set_fields(), "device": self.device, "precision": self.precision}

    @classmethod
    def from_dict(cls, d: dict) -> "JobOptions":
        return cls(TrainOptions(**d["train"]), d["device"], d["precision"])


def parse_experts(spec: str | None, n: int | None = None) -> list[int] | None:
    """An `--experts` selection: '1-40,45' -> [1..40, 45] in the order given; 'none' or '' -> [].

    None or 'all' is every expert: 1..n, or None when n is not given (the caller's "all"). With n,
    each index must be in 1..n. Duplicates are kept: the caller decides whether they are an error.

    Example:
        >>> parse_experts("1-3,5", 8)
        [1, 2, 3, 5]
    """
    if spec is None or spec.strip().lower() == "all":
        return None if n is None else list(range(1, n + 1))
    if spec.strip().lower() in ("", "none"):
        return []
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            a, _, b = part.partition("-")
            lo, hi = int(a), int(b or a)
            if hi < lo:
                raise ValueError
        except ValueError:
            raise MfggufError(f"bad --experts {spec!r}: use indices and ranges such as 1-40,45") from None
        if n is not None and not 1 <= lo <= hi <= n:
            raise MfggufError(f"--experts {part} is out of range; this run has experts 1..{n}")
        out += range(lo, hi + 1)
    return out


def parse_floats(spec: str, what: str) -> tuple[float, ...]:
    """A comma-separated list of numbers given to option `what`: '0.5,1,2' -> (0.5, 1.0, 2.0); '' -> ().

    Example:
        >>> parse_floats("0.4,0.6", "--seed-gates")
        (0.4, 0.6)
    """
    try:
        return tuple(float(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise MfggufError(f"{what} {spec!r} is not a comma-separated list of numbers, e.g. 0.5,1,2") from None


__all__ = ["TrainOptions", "JobOptions", "MODEL_OPTIONS", "NOT_OPTIONS", "TAKES", "flag", "typed_flag", "scope",
           "option_names", "option_help", "option_types", "parse_experts", "parse_floats"]
