"""The branch point of a `--schedule wsd` trunk: its stable-phase state where the cooldown begins.

A wsd trunk trains at a constant LR, then cools down over its last `cooldown` share of steps. The
cooled-down trunk is the one written for use alone (modules/trunk.safetensors); the state just
before the cooldown -- every weight and AdamW's two moments -- is kept beside it as the branch
point, so that wsd experts continue from a trunk still at its stable LR instead of re-warming a
converged one (expert.py), and cool down themselves at the end of their last round.

Files: while training, RUN/checkpoints/trunk/branch.safetensors (written atomically at the step
the cooldown begins, before that step's checkpoint, so a resumed run never needs it again); once
the trunk is written, RUN/modules/trunk_branch.safetensors and trunk_branch.json, which names the
trunk it belongs to (trunk_sha256). Tensors `param.<torch name>`, `exp_avg.<torch name>` and
`exp_avg_sq.<torch name>`, f32 in the parameter's shape; the header metadata holds the JSON
(step, AdamW's step count, the LR, the training config). No pickle.

Example:
    >>> b = read_branch(RunDir("RUN"), trunk_meta)  # None for a cosine trunk
    >>> start_state = start_from_branch(b, named, branch_names(cfg, tc))  # an expert's run_loop start
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mfgguf.config import ModelConfig, TrainConfig
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, atomic_path, file_digests, link_or_copy, read_json, write_json
from mfgguf.run.records import ModuleMeta
from mfgguf.train.experts import shared as sh

BRANCH_FORMAT = "mfgguf-branch"
BRANCH_VERSION = 1
BRANCH_FILE = "branch.safetensors"  # its name in the trunk's checkpoint directory
PARTS = ("param", "exp_avg", "exp_avg_sq")  # tensors kept per parameter


def branch_files(rd: RunDir) -> tuple[Path, Path]:
    """(the published branch point's safetensors, its JSON), beside the trunk in RUN/modules."""
    return rd.modules / "trunk_branch.safetensors", rd.modules / "trunk_branch.json"


def save_branch(path: Path, shapes: dict[str, tuple], read: Callable[[str, str], np.ndarray], state: dict) -> None:
    """Write the branch point atomically, one tensor in memory at a time.

    `shapes` {torch name: shape}; `read(part, name)` gives that parameter's f32 `part` (PARTS).
    """
    keys = [(part, n) for n in sorted(shapes) for part in PARTS]
    state = {"format": BRANCH_FORMAT, "version": BRANCH_VERSION, **state}
    header, off = {"__metadata__": {"branch": json.dumps(state)}}, 0
    for part, n in keys:
        size = 4 * int(np.prod(shapes[n], dtype=np.int64))
        header[f"{part}.{n}"] = {"dtype": "F32", "shape": list(shapes[n]), "data_offsets": [off, off + size]}
        off += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads its header to 8 bytes with spaces
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for part, n in keys:
            a = np.ascontiguousarray(read(part, n), dtype=np.float32)
            assert a.size == int(np.prod(shapes[n], dtype=np.int64)), (part, n)
            f.write(memoryview(a).cast("B"))


def save_in_memory(path: Path, named: dict[str, torch.Tensor], opt: torch.optim.Optimizer, state: dict) -> None:
    """The branch point of an in-memory run: `named` parameters and their AdamW moments (zeros before the
    first step)."""

    def read(part: str, n: str) -> np.ndarray:
        p = named[n]
        t = p if part == "param" else opt.state.get(p, {}).get(part, torch.zeros_like(p))
        return t.detach().to("cpu", torch.float32).numpy()

    steps = {int(opt.state[p]["step"]) for p in named.values() if p in opt.state}
    save_branch(path, {n: tuple(p.shape) for n, p in named.items()}, read,
                {**state, "adam_step": steps.pop() if len(steps) == 1 else 0})


def branch_meta(path: Path) -> dict:
    """The JSON state in a branch file's header."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {})["branch"])
    except Exception as e:  # safetensors raises several types for a damaged file
        raise MfggufError(f"branch point {path} is unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__});"
                          " retrain the trunk with `mfgguf train-trunk RUN --schedule wsd --restart`") from None


def publish(rd: RunDir, ckpt_dir: Path, trunk_meta: ModuleMeta | dict) -> dict:
    """Put the branch point kept in `ckpt_dir` beside the trunk just written; return its JSON.

    A hard link (free), renamed into place: the checkpoint's copy stays until the checkpoint
    directory is removed, so a kill at any point leaves something a re-run can publish again.
    """
    src = Path(ckpt_dir) / BRANCH_FILE
    if not src.is_file():
        raise MfggufError(f"the wsd trunk's branch point {src} is missing (deleted during training?); retrain the"
                          f" trunk with `mfgguf train-trunk {rd.root} --schedule wsd --restart`")
    st, js = branch_files(rd)
    tmp = st.with_name(f".{st.name}.publish.tmp")
    tmp.unlink(missing_ok=True)
    link_or_copy(src, tmp)
    os.replace(tmp, st)
    meta = {**branch_meta(st), "file": st.name, **file_digests(st), "bytes": st.stat().st_size,
            "trunk_sha256": ModuleMeta.of(trunk_meta).sha256}
    write_json(js, meta)
    return meta


def clear(rd: RunDir) -> None:
    """Remove a published branch point (a trunk trained without one replaces the trunk it belonged to)."""
    for f in branch_files(rd):
        f.unlink(missing_ok=True)


def read_branch(rd: RunDir, trunk_meta: ModuleMeta | dict) -> dict | None:
    """The branch point of RUN's trunk (its JSON, with "path"), or None when the trunk was not trained with wsd.

    A wsd trunk whose branch point is missing, damaged or another trunk's is a one-line error: its experts
    would otherwise silently start from the cooled-down trunk.
    """
    trunk = ModuleMeta.of(trunk_meta)
    if trunk.schedule != "wsd":
        return None
    st, js = branch_files(rd)
    retrain = f"retrain the trunk with `mfgguf train-trunk {rd.root} --schedule wsd --restart`"
    if not st.is_file() or not js.is_file():
        raise MfggufError(f"the wsd trunk's branch point {st} is missing; {retrain}, or train the experts with"
                          " --schedule cosine")
    branch = ModuleMeta.from_json(read_json(js, "the branch point's metadata"))
    if branch.format != BRANCH_FORMAT or branch.version != BRANCH_VERSION:
        raise MfggufError(f"{js} was written by an incompatible mfgguf; {retrain}")
    if branch.trunk_sha256 != trunk.sha256:
        raise MfggufError(f"the branch point {st} belongs to another trunk than {rd.module_file(0)}; {retrain}")
    if st.stat().st_size != branch.bytes:
        raise MfggufError(f"{st} does not match its recorded size (modified or damaged); {retrain}")
    return {**branch.to_json(), "path": str(st)}


def load_branch_state(branch: dict, names) -> dict[str, dict[str, torch.Tensor]]:
    """{torch name: {"param", "exp_avg", "exp_avg_sq"}} of the named parameters (f32, CPU), one read each."""
    from safetensors import safe_open

    out = {}
    with safe_open(branch["path"], framework="pt") as f:
        have = set(f.keys())
        for n in names:
            if f"param.{n}" not in have:
                raise MfggufError(f"the branch point {branch['path']} has no tensor {n}; retrain the trunk")
            out[n] = {part: f.get_tensor(f"{part}.{n}") for part in PARTS}
    return out


# ---- wsd experts: where they start -----------------------------------------------------------------


def branch_names(cfg: ModelConfig, tc: TrainConfig) -> list[str]:
    """The expert's parameters that start from the branch point: its shared copies, and its FFN when it
    starts from the seed (--init seed, or auto with a seed); a random or anchor FFN has nothing to continue."""
    init = tc.expert_init if tc.expert_init != "auto" else ("seed" if cfg.seed_expert else "random")
    ffn = [f"layers.{l}.experts.0.{f}.weight" for l in range(cfg.n_layers) for f in ("gate", "up", "down")]
    return [*(ffn if init == "seed" else []), *sh.shared_names(cfg, tc.shared)]


def start_from_branch(branch: dict, named: dict[str, torch.nn.Parameter], names: list[str]) -> dict[str, dict]:
    """Set `names` of `named` to the branch point's weights; return their AdamW moments (run_loop's start_state).

    The frozen trunk stays the cooled-down one the MoE will run with: only what the expert trains
    continues from the branch point.
    """
    start = load_branch_state(branch, names)
    with torch.no_grad():
        for n, st in start.items():
            p = named[n]
            if tuple(st["param"].shape) != tuple(p.shape):
                raise MfggufError(f"the branch point's {n} has shape {tuple(st['param'].shape)}, the expert's"
                                  f" {tuple(p.shape)}; retrain the trunk")
            p.copy_(st["param"])
    return {n: {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"], "step": branch["adam_step"]}
            for n, st in start.items()}


def branch_record(trunk: ModuleMeta, tc: TrainConfig) -> dict | None:
    """The expert JSON's record of where it started: the trunk's branch point (wsd), else None."""
    b = trunk.branch
    return {**b, "tensors": len(branch_names(ModelConfig.from_dict(trunk.config), tc))} if b and tc.schedule == "wsd" else None


__all__ = ["BRANCH_FILE", "PARTS", "branch_files", "save_branch", "save_in_memory", "branch_meta", "publish", "clear",
           "read_branch", "load_branch_state", "branch_names", "start_from_branch", "branch_record"]
