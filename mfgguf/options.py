"""Training options a user sets on top of a preset, declared once: by the config dataclasses' fields.

`TrainOptions` has one field per `TrainConfig` field and per `ModelConfig` field a trunk may
change (MODEL_OPTIONS), each None = "the preset's". It is built from those dataclasses, so a
new `TrainConfig` field is at once a library option, a CLI option of the train verbs (the field's
comment is its help: `field_help`, cli/options.py), and passed by `train-experts` to every job
(`JobOptions`: a child's command line, or a Ray task's arguments). `parse_experts` reads every
`--experts` selection (train-experts, assemble).

Example:
    >>> o = TrainOptions(lr=1e-3, anchor_ff=256)
    >>> o.train_config(get_preset("tiny").trunk).lr, o.model_changes()
    (0.001, {'anchor_ff': 256})
    >>> o.argv()
    ['--lr', '0.001', '--anchor-ff', '256']
"""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize
import typing
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace
from functools import cache

from mfgguf.config import FLAGS, ModelConfig, TrainConfig
from mfgguf.errors import MfggufError

# ModelConfig fields a trunk may change; vocab_size and n_experts come from the RUN, top_k is assembly's.
# family, attn_head_dim and rope_freq_factors describe an imported base (import-base sets them), not a trunk trained here
MODEL_OPTIONS = tuple(f.name for f in fields(ModelConfig) if f.name not in ("vocab_size", "n_experts", "top_k", "family",
                                                                             "attn_head_dim", "rope_freq_factors"))
# TrainConfig fields only expert jobs use: the train-expert and train-experts verbs take them, train-trunk does not.
EXPERT_ONLY = ("expert_init", "shared", "shared_lr_scale", "rounds", "stats_tokens", "stats_from")


def flag(name: str) -> str:
    """The CLI flag of an option: `--batch-size` for batch_size, `--init` for expert_init."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))


class _Options:
    """Methods of the generated TrainOptions dataclass."""

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
            if isinstance(v, bool):
                out.append(flag(k) if v else "--no-" + flag(k)[2:])
            else:
                out += [flag(k), str(v)]
        return out


def _optional_fields() -> list[tuple]:
    hints = typing.get_type_hints(TrainConfig) | typing.get_type_hints(ModelConfig)
    names = [f.name for f in fields(TrainConfig)] + list(MODEL_OPTIONS)
    return [(n, hints[n] | None, field(default=None)) for n in names]


TrainOptions = make_dataclass("TrainOptions", _optional_fields(), bases=(_Options,), frozen=True,
                              namespace={"__module__": __name__})
TrainOptions.__doc__ = ("Training options over a preset: every TrainConfig field and the ModelConfig fields in"
                        " MODEL_OPTIONS, each None = the preset's. Unknown names are a TypeError.")


def option_types() -> dict[str, type]:
    """{option: its type without None} (int, float, str or bool), for building CLI options. A choice
    (a Literal) is a str here: TrainConfig checks its value, with the one error every caller gets."""
    hints = typing.get_type_hints(TrainConfig) | typing.get_type_hints(ModelConfig)
    return {f.name: str if typing.get_origin(hints[f.name]) is typing.Literal else hints[f.name]
            for f in fields(TrainOptions)}


@cache
def field_help(cls: type) -> dict[str, str]:
    """{field: its comment} of a config dataclass, continuation comment lines joined: the CLI's help.

    Example:
        >>> field_help(TrainConfig)["batch_size"]
        'sequences per step'
    """
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT}
    out = {}
    for node in ast.parse(src).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            n, parts = node.lineno, []
            while n in comments and (n == node.lineno or lines[n - 1].lstrip().startswith("#")):
                parts.append(comments[n])
                n += 1
            out[node.target.id] = " ".join(parts)
    return out


def option_help(name: str) -> str:
    """An option's help: its field's comment, first letter capitalized, and where its default comes from."""
    text = (field_help(TrainConfig) | field_help(ModelConfig)).get(name, "")
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


__all__ = ["TrainOptions", "JobOptions", "MODEL_OPTIONS", "EXPERT_ONLY", "flag", "field_help", "option_help",
           "option_types", "parse_experts", "parse_floats"]
