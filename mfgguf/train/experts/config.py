"""An expert's effective configuration, resolved in one place for `train-expert`, `train-experts` and the fan-out.

The shape is the trunk's (its recorded config); the TrainConfig is the options over the trunk's preset's
expert defaults, and a wsd expert of a wsd trunk continues at the trunk's branch LR (`at_branch_lr`).
`train-expert` trains with it; `train-experts` counts its jobs with it (fanout/plan.py) and every job it
fans out resolves the same one. Torch-free: the plan is counted before anything imports torch.

Example:
    >>> ec = expert_config(trunk_meta, TrainOptions(tokens=20_480))
    >>> ec.cfg.n_layers, ec.tc.lr, ec.preset
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mfgguf.config import DEFAULT_PRESET, ModelConfig, TrainConfig, get_preset
from mfgguf.options import TrainOptions
from mfgguf.run import ModuleMeta


@dataclass(frozen=True)
class ExpertConfig:
    cfg: ModelConfig  # the trunk's shape
    tc: TrainConfig  # what every expert job of this trunk trains with
    preset: str  # the trunk's preset, whose expert defaults the options override


def expert_config(trunk: ModuleMeta, options: TrainOptions) -> ExpertConfig:
    """The shape and the TrainConfig an expert of this trunk (its module record) trains with under `options`."""
    preset = trunk.preset or DEFAULT_PRESET
    tc = at_branch_lr(options.train_config(get_preset(preset).expert), trunk, options)
    return ExpertConfig(ModelConfig.from_dict(trunk.config), tc, preset)


def at_branch_lr(tc: TrainConfig, trunk: ModuleMeta, options) -> TrainConfig:
    """A wsd expert of a wsd trunk runs at the trunk's branch LR (its stable LR) with no warm-up: it continues
    a trunk that never cooled down instead of re-warming one that did. --lr / --warmup-frac, when given, win."""
    b = trunk.branch
    if tc.schedule != "wsd" or not b:
        return tc
    return replace(tc, lr=b["lr"] if options.lr is None else tc.lr,
                   warmup_frac=0.0 if options.warmup_frac is None else tc.warmup_frac)
