"""The RUN directory contract: where every stage reads and writes, and the module-file format.

    RUN/
      run.json                  format/version, n_experts, partition, domains, shards, validation and test sizes
      tokenizer.json            byte-level BPE (tokenizers); llama.cpp tokenizes it identically
      data/train.npy            mixed training tokens for the trunk (uint16/uint32, memory-mapped)
      data/shard_001.npy ...    expert i's training tokens
      data/valid/<domain>.npy   validation tokens per domain: every choice made on data reads these
      data/valid/<domain>.txt   the same validation documents as text
      data/test/<domain>.npy    test tokens per domain, scored once per final model (`eval`, `perplexity --run`)
      data/test/<domain>.txt    the same test documents as text (for `perplexity --data`)
      data/clusters.safetensors k-means centres (partition=cluster only)
      modules/trunk.safetensors + trunk.json            module 0
      modules/expert_001.safetensors + expert_001.json  experts 1..N
      modules/router_stats.safetensors + .json          pooled router statistics of this trunk + experts
      manifest.json             every finished module with its sha256
      checkpoints/<module>/     resumable training state
      rounds/sync_<k>/          `mfgguf sync`: the modules before and after merge k, and its plan
      rounds/moments/           each expert's second moments of its last training steps (tailstats.py)
      plots/                    loss curves

A module file is one safetensors file of GGUF-named tensors (see `model.trunk_name_map`); an expert's also
holds its FFN inputs' mean per layer, `router_stats.blk.{l}.mean` (dim,), and with `--shared` its trained
copies `shared.<trunk GGUF name>` (f32; listed as `shared_tensors`, merged into the trunk at assembly). The
router's dim x dim second moment is pooled once per trunk (train/experts/pooled.py). A module of format 1 (mfgguf
before 0.2: a second moment in every expert, no blake3) is refused where it is read (`read_module`), in one line
that says what to retrain. The JSON beside a module holds the rest (see `write_module`).
No pickle anywhere: safetensors, numpy .npy (allow_pickle=False) and JSON only.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mfgguf.errors import MfggufError, Outdated
# the file helpers and records live in modules of their own; stages import them from here as before
from mfgguf.run.files import (atomic_path, file_digests, link_or_copy, read_json, sha256_file, swap_dir_into_place,
                          write_json, write_text, blake3_file)
from mfgguf.run.legacy import test_dir_of
from mfgguf.run.records import ModuleMeta, RunInfo, Untrained, check_not_retired, module_name
from mfgguf.run.safetensors_f32 import save_f32, save_f32_streamed

RUN_FORMAT = "mfgguf-run"
RUN_VERSION = 1
MODULE_FORMAT = "mfgguf-module"
MODULE_VERSION = 2  # 2: experts hold weights and means only (the second moment is pooled once)
STATS_PREFIX = "router_stats."
SHARED_PREFIX = "shared."  # an expert's trained private copy of a trunk tensor: shared.<trunk GGUF name>


@dataclass(frozen=True)
class RunDir:
    """Paths inside a RUN directory. Creating one touches nothing on disk."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    @property
    def run_json(self) -> Path: return self.root / "run.json"
    @property
    def tokenizer(self) -> Path: return self.root / "tokenizer.json"
    @property
    def data(self) -> Path: return self.root / "data"
    @property
    def train_tokens(self) -> Path: return self.data / "train.npy"
    @property
    def test_dir(self) -> Path:
        """The test split: data/test/, or where a RUN prepared before it had that name keeps it (legacy.py)."""
        return test_dir_of(self.data)
    @property
    def valid_dir(self) -> Path: return self.data / "valid"

    @property
    def validation_dir(self) -> Path:
        """The split every choice made on data reads: training curves, LR grids, schedules, the oracle's expert,
        the best router. A RUN prepared before the validation split existed has only its held-out split, which then
        serves both roles (`split_roles` says so)."""
        return self.valid_dir if self.valid_dir.is_dir() else self.test_dir

    def split_roles(self) -> dict[str, str]:
        """{"validation": dir name, "test": dir name} as this RUN has them, for reports."""
        return {"validation": self.validation_dir.name, "test": self.test_dir.name}

    @property
    def vocab_files(self) -> list[Path]:
        """What defines this RUN's vocabulary: tokenizer.json of a RUN prepared from scratch, base/ of an imported base
        (which holds the tokenizer, and no tokenizer.json in RUN/ when the base was a GGUF). A view of the RUN copies
        these."""
        return [p for p in (self.tokenizer, self.root / "base") if p.exists()]

    def copy_vocab_to(self, dst: "RunDir") -> None:
        """run.json and the vocabulary files into another RUN directory (a view over this one's data)."""
        dst.root.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.run_json, dst.run_json)
        for src in self.vocab_files:
            target = dst.root / src.name
            if src.is_dir():
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(src, target)
            else:
                shutil.copy2(src, target)
    @property
    def clusters(self) -> Path: return self.data / "clusters.safetensors"
    @property
    def modules(self) -> Path: return self.root / "modules"
    @property
    def manifest(self) -> Path: return self.root / "manifest.json"
    @property
    def plots(self) -> Path: return self.root / "plots"
    @property
    def rounds(self) -> Path: return self.root / "rounds"  # `mfgguf sync`: sync_<k>/{before,after,sync.json}

    def pending_sync(self) -> Path | None:
        """The sync.json of a `mfgguf sync` that staged its modules but was killed before publishing them all."""
        for f in sorted(self.rounds.glob("sync_*/sync.json")) if self.rounds.is_dir() else []:
            if read_json(f, "a sync plan").get("state") != "published":
                return f
        return None

    def check_no_pending_sync(self) -> None:
        """Refuse to read modules while a killed `mfgguf sync` has published only some of them."""
        if self.pending_sync() is not None:
            raise MfggufError(f"a `mfgguf sync` of {self.root} was interrupted; run `mfgguf sync {self.root}` again to finish it")

    def shard(self, i: int) -> Path:
        return self.data / f"shard_{i:03d}.npy"

    def test(self, domain: str) -> Path:
        return self.test_dir / f"{domain}.npy"

    def test_text(self, domain: str) -> Path:
        return self.test_dir / f"{domain}.txt"

    def valid(self, domain: str) -> Path:
        return self.valid_dir / f"{domain}.npy"

    def valid_text(self, domain: str) -> Path:
        return self.valid_dir / f"{domain}.txt"

    @property
    def router_stats(self) -> Path: return self.modules / "router_stats.safetensors"  # pooled, per trunk
    @property
    def router_stats_meta(self) -> Path: return self.modules / "router_stats.json"

    def module_file(self, index: int) -> Path:
        return self.modules / f"{module_name(index)}.safetensors"

    def module_meta(self, index: int) -> Path:
        return self.modules / f"{module_name(index)}.json"

    def checkpoint_dir(self, index: int) -> Path:
        return self.root / "checkpoints" / module_name(index)

    def sync_dir(self, k: int) -> Path: return self.rounds / f"sync_{k:02d}"  # `mfgguf sync` number k, 1-based

    @property
    def first_trunk(self) -> tuple[Path, Path]:
        """(weights, record) of the trunk before the first `mfgguf sync` (the imported base, kept in its before/), or
        modules/' trunk where the RUN was never synced: after a sync modules/ holds the merged one, the experts' training in it."""
        before = self.sync_dir(1) / "before"
        at = (before / self.module_file(0).name, before / self.module_meta(0).name)
        return at if at[0].is_file() else (self.module_file(0), self.module_meta(0))

    # ---- run.json ----------------------------------------------------------------------------

    def run_info(self) -> RunInfo:
        """run.json, validated: a clear error for a missing or incompatible RUN directory."""
        if not self.run_json.is_file():
            raise MfggufError(f"{self.root} is not a RUN directory (no run.json); create one with `mfgguf prepare`")
        try:
            info = RunInfo.from_json(json.loads(self.run_json.read_text()))
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise MfggufError(f"{self.run_json} is unreadable ({e}); re-create the run with `mfgguf prepare`") from None
        if info.format != RUN_FORMAT or info.version != RUN_VERSION:
            raise MfggufError(
                f"{self.root} was made by an incompatible mfgguf (format {info.format!r} version"
                f" {info.version!r}, this mfgguf reads {RUN_FORMAT!r} version {RUN_VERSION});"
                " re-create it with `mfgguf prepare`"
            )
        return info

    def info(self) -> dict:
        """run.json as a dict (`run_info` typed), for stages that still read dicts."""
        return self.run_info().to_json()

    def test_tokens(self, cap: int | None = None) -> dict:
        """{domain: memory-mapped test tokens (first `cap`)}, for every domain that has a test split.

        A domain with a single document has none (prepare keeps it for training), so it is skipped.
        """
        return self._split_tokens(self.test_dir, cap)

    def validation_tokens(self, cap: int | None = None) -> dict:
        """{domain: memory-mapped validation tokens (first `cap`)}: `test_tokens` of `validation_dir`."""
        return self._split_tokens(self.validation_dir, cap)

    def _split_tokens(self, d: Path, cap: int | None) -> dict:
        import numpy as np

        names = self.run_info().domains or sorted(p.stem for p in d.glob("*.npy"))
        names = [x for x in names if (d / f"{x}.npy").is_file()]
        if not names:
            raise MfggufError(f"{d} holds no <domain>.npy tokens; re-create the run with `mfgguf prepare`")
        return {x: np.load(d / f"{x}.npy", mmap_mode="r", allow_pickle=False)[:cap] for x in names}

    def check_expert_index(self, i: int) -> int:
        n = self.run_info().n_experts
        if not 1 <= i <= n:
            raise MfggufError(f"expert index {i} is out of range; this run has experts 1..{n}")
        return i


# ---- views ---------------------------------------------------------------------------------------


def data_view(src: RunDir, out: Path, *, keep_checkpoints: bool = False) -> RunDir:
    """A fresh RUN at `out` (whatever was there removed: a caller's own stale output) with `src`'s run.json,
    tokenizer and imported base copied (small) and its data linked, not copied; no modules yet. The dense
    baselines and a trained-further base train in one each. `keep_checkpoints` leaves out/checkpoints alone
    (a killed training of the same run resumes from it)."""
    view = RunDir(out)
    if view.root.exists() and keep_checkpoints:
        for p in view.root.iterdir():
            if p.name == "checkpoints":
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    elif view.root.exists():
        shutil.rmtree(view.root)
    src.copy_vocab_to(view)
    view.data.symlink_to(src.data.resolve())
    return view


# ---- modules and the manifest --------------------------------------------------------------------


def write_module(run: RunDir, index: int, tensors: dict, meta: dict, beside: Callable[[str], object] | None = None) -> dict:
    """Write module `index` (safetensors of GGUF-named tensors + JSON), then record it in the manifest.

    `tensors` maps names to torch tensors or numpy arrays (router statistics included for
    experts). `meta` should carry kind, preset, config, trunk_sha256 (experts), shard,
    partition, tokens_seen, final_loss, validation_loss, router_stats_count (experts).
    `beside(sha256)` writes files naming the module before its record (a job killed between reruns).
    Returns the full metadata written.

    Example:
        >>> write_module(RunDir("RUN"), 0, model.trunk_tensors(), {"kind": "trunk", ...})
    """
    path = run.module_file(index)
    return _publish(run, index, save_f32(path, tensors, f"{MODULE_FORMAT}/{module_name(index)}"), meta, beside)


def write_module_streamed(run: RunDir, index: int, shapes: dict[str, tuple], read, meta: dict) -> dict:
    """`write_module` for a module too large to hold: `read(name)` gives one f32 tensor at a time."""
    path = run.module_file(index)
    return _publish(run, index, save_f32_streamed(path, shapes, read, f"{MODULE_FORMAT}/{module_name(index)}"), meta)


def _publish(run: RunDir, index: int, shapes: dict[str, list[int]], meta: dict, beside: Callable | None = None) -> dict:
    """The module file just written: its JSON record beside it and its manifest entry; the record."""
    full = ModuleMeta.from_json(module_meta_for(run.module_file(index), index, meta, shapes))
    if beside is not None:  # before the record that makes the module count as trained
        beside(full.sha256)
    write_json(run.module_meta(index), full.to_json())
    update_manifest(run, index, full)
    return full.to_json()


def module_meta_for(path: Path, index: int, meta: dict, shapes: dict[str, list[int]]) -> dict:
    """The full JSON of a module file already written at `path` (hash, size, tensor shapes)."""
    return {
        "format": MODULE_FORMAT, "version": MODULE_VERSION, "name": module_name(index), "index": index,
        **{k: v for k, v in meta.items() if k not in ("file", "sha256", "blake3", "bytes", "tensors", "version")},
        "file": f"{module_name(index)}.safetensors",  # its name once published in RUN/modules
        **file_digests(path),
        "bytes": Path(path).stat().st_size,
        "tensors": {k: s for k, s in shapes.items() if not k.startswith(STATS_PREFIX)},
    }


def read_module(run: RunDir, index: int, at: tuple[Path, Path] | None = None, weights_kept: bool = True) -> ModuleMeta:
    """Module `index`'s JSON record (or the module at (weights, record)), typed; a one-line error if missing or foreign
    (weights_kept=False: a record whose weights were not kept on purpose, as a LoRA served as an adapter)."""
    weights, record = at or (run.module_file(index), run.module_meta(index))
    name = module_name(index)
    hint = "mfgguf train-trunk RUN" if index == 0 else f"mfgguf train-expert RUN --expert {index}"
    if not record.is_file() or (weights_kept and not weights.is_file()):
        raise MfggufError(f"module {name} is missing in {weights.parent}; train it with `{hint}`")
    meta = read_json(record, f"metadata of module {name}")
    if meta.get("format") == MODULE_FORMAT and meta.get("version") == 1:
        raise Outdated(f"{name} was written in module format 1 (mfgguf before 0.2); retrain it with `{hint} --restart`")
    if meta.get("format") != MODULE_FORMAT or meta.get("version") != MODULE_VERSION:
        raise MfggufError(f"module {name} was written by an incompatible mfgguf; retrain it")
    check_not_retired(meta, name, index)
    return ModuleMeta.from_json(meta)


def read_module_meta(run: RunDir, index: int, weights_kept: bool = True) -> dict:
    """`read_module` as a dict, for stages that still read dicts."""
    return read_module(run, index, weights_kept=weights_kept).to_json()


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # experts may finish at once in parallel processes
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def _manifest(run: RunDir):
    """The manifest as a dict to edit, under the lock, written back atomically on exit."""
    with _locked(run.manifest):
        man = json.loads(run.manifest.read_text()) if run.manifest.is_file() else {"format": "mfgguf-manifest", "modules": {}}
        yield man
        write_json(run.manifest, man)


def update_manifest(run: RunDir, index: int, meta: ModuleMeta | dict) -> None:
    m = meta if isinstance(meta, ModuleMeta) else ModuleMeta.from_json(meta)
    if m.file is None or m.sha256 is None or m.bytes is None:
        raise KeyError("a module record needs file, sha256 and bytes to enter the manifest")
    with _manifest(run) as man:
        man["modules"][module_name(index)] = {
            "index": index,
            "file": f"modules/{m.file}",
            "sha256": m.sha256,
            **({"blake3": m.blake3} if m.blake3 else {}),
            "bytes": m.bytes,
            "kind": m.kind,
            "trunk_sha256": m.trunk_sha256,
        }
        man["modules"] = dict(sorted(man["modules"].items(), key=lambda kv: kv[1]["index"]))


def write_router_stats(run: RunDir, tensors: dict, meta: dict) -> dict:
    """Write the pooled router statistics of the current trunk (modules/router_stats.*), recorded in
    the manifest under "router_stats" with their hashes, like a module. Returns the metadata."""
    path = run.router_stats
    save_f32(path, tensors, f"{MODULE_FORMAT}/router_stats")
    full = {"format": MODULE_FORMAT, "version": MODULE_VERSION, "name": "router_stats", "kind": "router_stats",
            **{k: v for k, v in meta.items() if k not in ("sha256", "blake3", "bytes", "file")},
            "file": path.name, **file_digests(path), "bytes": path.stat().st_size}
    write_json(run.router_stats_meta, full)
    with _manifest(run) as man:
        man["router_stats"] = {"file": f"modules/{path.name}", "sha256": full["sha256"], "blake3": full["blake3"],
                               "bytes": full["bytes"], "trunk_sha256": full.get("trunk_sha256")}
    return full


def finished_against(expert_meta: ModuleMeta | dict, trunk_sha256: str) -> bool:
    """An expert module has trained its last round against this trunk: nothing left to train or sync."""
    m = expert_meta if isinstance(expert_meta, ModuleMeta) else ModuleMeta.from_json(expert_meta)
    return m.finished_against(trunk_sha256)


def untrained(rd: RunDir, trunk_sha256: str, i: int) -> Untrained | None:
    """Why expert i cannot be used with this trunk, or None when its module is here and finished."""
    if not rd.module_meta(i).is_file() or not rd.module_file(i).is_file():
        return Untrained.MISSING
    if not read_module(rd, i).finished_against(trunk_sha256):
        return Untrained.UNFINISHED
    return None


def untrained_reason(rd: RunDir, trunk_sha256: str, i: int) -> str | None:
    """`untrained` as a message ("expert_003 is not trained yet"), or None."""
    why = untrained(rd, trunk_sha256, i)
    return None if why is None else why.says(module_name(i))


def trained_expert(rd: RunDir, trunk_sha256: str, i: int, verb: str) -> ModuleMeta:
    """Expert i's record, when it has finished training against this trunk; else the error that says
    what to run before `verb` (the verb that needs it, as the user types it: "mfgguf router-stats")."""
    why = untrained(rd, trunk_sha256, i)
    if why is Untrained.MISSING:
        raise MfggufError(f"{why.says(module_name(i))}; `{verb}` needs trained experts:"
                          f" `mfgguf train-expert {rd.root} --expert {i}` first")
    if why is Untrained.UNFINISHED:
        raise MfggufError(f"{why.says(module_name(i))}; finish it (`mfgguf train-expert {rd.root} --expert {i}`,"
                          f" `mfgguf sync {rd.root}`) before `{verb}`")
    return read_module(rd, i)


def trained_expert_meta(rd: RunDir, trunk_sha256: str, i: int, verb: str) -> dict:
    """`trained_expert` as a dict, for stages that still read dicts."""
    return trained_expert(rd, trunk_sha256, i, verb).to_json()


def recorded_experts(trunk_meta: ModuleMeta | dict) -> list[int] | None:
    """The experts the trunk's syncs merged (`sync --experts`), or None where no sync recorded a set."""
    m = trunk_meta if isinstance(trunk_meta, ModuleMeta) else ModuleMeta.from_json(trunk_meta)
    return m.sync_experts


def trained_copies(meta: dict) -> bool:
    """An expert's record says it trained shared copies (`shared_tensors`)."""
    return bool(meta.get("shared_tensors"))


def router_stats_stale(meta: ModuleMeta | dict, trunk_sha256: str, experts: dict[str, str]) -> str | None:
    """Why pooled router statistics (their record `meta`) do not describe this trunk and these experts
    ({name: sha256}), or None when they do (ModuleMeta.pooled_stale)."""
    return (meta if isinstance(meta, ModuleMeta) else ModuleMeta.from_json(meta)).pooled_stale(trunk_sha256, experts)


def read_manifest(run: RunDir) -> dict:
    return read_json(run.manifest, "the run manifest (train the trunk first)")


__all__ = ["RUN_FORMAT", "RUN_VERSION", "MODULE_FORMAT", "MODULE_VERSION", "STATS_PREFIX",
           "SHARED_PREFIX", "RunDir", "ModuleMeta", "RunInfo", "Untrained", "module_name", "data_view",
           "atomic_path", "blake3_file", "file_digests", "link_or_copy", "read_json", "sha256_file", "swap_dir_into_place",
           "write_json", "write_text", "write_module", "write_module_streamed", "module_meta_for", "read_module",
           "read_module_meta", "update_manifest", "write_router_stats", "finished_against", "untrained",
           "untrained_reason", "trained_expert", "trained_expert_meta", "recorded_experts", "trained_copies", "router_stats_stale",
           "read_manifest"]
