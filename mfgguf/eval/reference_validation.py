"""An assembled model's validation loss on the training side's own measure, beside the LR grids it is chosen against.

The baselines' LR grids, the experts' records and the base's "before" are scored in PyTorch on the first
`eval_tokens` of each domain's validation split (`train/engine/loop.py`'s `validation_losses`), while
`mfgguf eval` scores GGUFs by llama.cpp on other windows and token counts: two measures a few hundredths
of a nat apart, more than the margins they decide. A served MoE (merged trunk, router, top-k, seed gate)
is scored here through the PyTorch reference built from its GGUF (`reference.py`: the routing llama.cpp
performs, held to it by the parity tests), so it sits on the grids' own scale: the figure that says
whether the merge and the router kept the experts' lead, before anything reads test.

Example:
    >>> reference_validation(RunDir(run), Path("moe-ridge-top1-f16.gguf"), eval_tokens=4096)
    {'c': 1.49, 'cpp': 1.28, 'english': 2.93, 'man': 1.93, 'python': 1.69}
"""

from __future__ import annotations

from pathlib import Path

import torch

from mfgguf.run import RunDir


@torch.no_grad()
def reference_validation(rd: RunDir, gguf: Path, eval_tokens: int, device: str = "cpu",
                         precision: str = "auto") -> dict[str, float]:
    """{domain: mean loss in nats} of the model `gguf` holds (assembled from `rd`) on the first `eval_tokens` of each
    domain's validation split (a RUN prepared before validation existed: its held-out split), as train-base's and
    train-expert's records score theirs at --eval-tokens."""
    from mfgguf.reference import reference_model
    from mfgguf.train.engine.loop import validation_losses, resolve_device, resolve_precision

    dev = resolve_device(device)
    model, route = reference_model(rd.root, Path(gguf))
    return validation_losses(rd.validation_dir, model.to(dev), eval_tokens, route, dev, resolve_precision(precision, dev))


__all__ = ["reference_validation"]
