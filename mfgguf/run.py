"""The RUN directory contract: where every stage reads and writes, and the module-file format.

    RUN/
      run.json                  format/version, n_experts, partition, domains, shards, held-out sizes
      tokenizer.json            byte-level BPE (tokenizers); llama.cpp tokenizes it identically
      data/train.npy            mixed training tokens for the trunk (uint16/uint32, memory-mapped)
      data/shard_001.npy ...    expert i's training tokens
      data/valid/<domain>.npy   validation tokens per domain: every choice made on data reads these
      data/valid/<domain>.txt   the same validation documents as text
      data/heldout/<domain>.npy test tokens per domain, scored once per final model (`eval`, `perplexity --run`)
      data/heldout/<domain>.txt the same test documents as text (for `perplexity --data`)
      data/clusters.safetensors k-means centres (partition=cluster only)
      modules/trunk.safetensors + trunk.json            module 0
      modules/expert_001.safetensors + expert_001.json  experts 1..N
      modules/router_stats.safetensors + .json          pooled router statistics of this trunk + experts
      manifest.json             every finished module with its sha256
      checkpoints/<module>/     resumable training state
      rounds/sync_<k>/          `mfgguf sync`: the modules before and after merge k, and its plan
      plots/                    loss curves

A module file is one safetensors file of GGUF-named tensors (see `model.trunk_name_map`); an
expert's file also holds the mean of its FFN inputs per layer, `router_stats.blk.{l}.mean` (dim,),
over `router_stats_count` tokens (the count lives in the JSON). The router's one dim x dim
statistic, the second moment of the FFN inputs, is pooled once per trunk instead of stored per
expert: `modules/router_stats.safetensors` (`router_stats.blk.{l}.second_moment`, from trunk +
each expert over its shard sample, see train/experts/pooled.py). Module format 1 (earlier mfgguf)
stored a second moment in every expert; such runs still assemble as they are. An expert trained
with `--shared` also holds its trained copy of each chosen trunk tensor as `shared.<trunk GGUF
name>` (f32, the trunk tensor's shape), listed in its JSON as `shared_tensors`; assembly merges
them into the trunk it writes. The JSON beside it holds everything else (see `write_module`).
No pickle anywhere: safetensors, numpy .npy (allow_pickle=False) and JSON only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mfgguf.errors import MfggufError

RUN_FORMAT = "mfgguf-run"
RUN_VERSION = 1
MODULE_FORMAT = "mfgguf-module"
MODULE_VERSION = 2  # 2: experts hold weights and means only (the second moment is pooled once)
READABLE_MODULE_VERSIONS = (1, 2)
STATS_PREFIX = "router_stats."
SHARED_PREFIX = "shared."  # an expert's trained private copy of a trunk tensor: shared.<trunk GGUF name>


def module_name(index: int) -> str:
    """0 -> 'trunk', i -> 'expert_00i'."""
    return "trunk" if index == 0 else f"expert_{index:03d}"


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
    def heldout_dir(self) -> Path: return self.data / "heldout"  # the test split (its name predates validation)
    @property
    def valid_dir(self) -> Path: return self.data / "valid"

    @property
    def validation_dir(self) -> Path:
        """The split every choice made on data reads: training curves, LR grids, schedules, the oracle's expert,
        the best router. A RUN prepared before the validation split existed has only its held-out split, which then
        serves both roles (`split_roles` says so)."""
        return self.valid_dir if self.valid_dir.is_dir() else self.heldout_dir

    def split_roles(self) -> dict[str, str]:
        """{"validation": dir name, "test": dir name} as this RUN has them, for reports."""
        return {"validation": self.validation_dir.name, "test": self.heldout_dir.name}

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

    def heldout(self, domain: str) -> Path:
        return self.heldout_dir / f"{domain}.npy"

    def heldout_text(self, domain: str) -> Path:
        return self.heldout_dir / f"{domain}.txt"

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

    # ---- run.json ----------------------------------------------------------------------------

    def info(self) -> dict:
        """run.json, validated: a clear error for a missing or incompatible RUN directory."""
        if not self.run_json.is_file():
            raise MfggufError(f"{self.root} is not a RUN directory (no run.json); create one with `mfgguf prepare`")
        try:
            info = json.loads(self.run_json.read_text())
        except (OSError, ValueError) as e:
            raise MfggufError(f"{self.run_json} is unreadable ({e}); re-create the run with `mfgguf prepare`") from None
        if info.get("format") != RUN_FORMAT or info.get("version") != RUN_VERSION:
            raise MfggufError(
                f"{self.root} was made by an incompatible mfgguf (format {info.get('format')!r} version"
                f" {info.get('version')!r}, this mfgguf reads {RUN_FORMAT!r} version {RUN_VERSION});"
                " re-create it with `mfgguf prepare`"
            )
        return info

    def heldout_tokens(self, cap: int | None = None) -> dict:
        """{domain: memory-mapped test tokens (first `cap`)}, for every domain that has a test split.

        A domain with a single document has none (prepare keeps it for training), so it is skipped.
        """
        return self._split_tokens(self.heldout_dir, cap)

    def validation_tokens(self, cap: int | None = None) -> dict:
        """{domain: memory-mapped validation tokens (first `cap`)}: `heldout_tokens` of `validation_dir`."""
        return self._split_tokens(self.validation_dir, cap)

    def _split_tokens(self, d: Path, cap: int | None) -> dict:
        import numpy as np

        names = list(self.info().get("domains") or []) or sorted(p.stem for p in d.glob("*.npy"))
        names = [x for x in names if (d / f"{x}.npy").is_file()]
        if not names:
            raise MfggufError(f"{d} holds no <domain>.npy tokens; re-create the run with `mfgguf prepare`")
        return {x: np.load(d / f"{x}.npy", mmap_mode="r", allow_pickle=False)[:cap] for x in names}

    def check_expert_index(self, i: int) -> int:
        n = self.info()["n_experts"]
        if not 1 <= i <= n:
            raise MfggufError(f"expert index {i} is out of range; this run has experts 1..{n}")
        return i


# ---- small file helpers ------------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    return file_digests(path, chunk)["sha256"]


def file_digests(path: Path, chunk: int = 1 << 22) -> dict[str, str]:
    """{"sha256": ..., "blake3": ...} of a file, in one read.

    sha256 names a module (experts record their trunk's); blake3 is what assembly checks every
    byte against, because it runs at ~3 GB/s per core (and releases the GIL) where sha256 manages
    ~1 GB/s: the integrity check no longer dominates an assembly.
    """
    from blake3 import blake3

    h, b3 = hashlib.sha256(), blake3()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
            b3.update(b)
    return {"sha256": h.hexdigest(), "blake3": b3.hexdigest()}


@contextmanager
def atomic_path(dest: Path, suffix: str = ""):
    """Yield a temporary path beside `dest`; on success fsync and rename it over `dest`.

    On any error the temporary file is removed and `dest` is untouched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=suffix + ".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def swap_dir_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory `tmp` to `out`; an old `out` is moved aside first (and put back if
    the rename fails), then removed: `out` is always either the old directory or the new one."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rmdir(old)
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def link_or_copy(src: Path, dst: Path) -> None:
    """A hard link of `src` at `dst` (free, and immune to `src` being replaced later), else a copy."""
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(src, dst)


def data_view(src: RunDir, out: Path) -> RunDir:
    """A fresh RUN at `out` (whatever was there removed: a caller's own stale output) with `src`'s run.json,
    tokenizer and imported base copied (small) and its data linked, not copied; no modules yet. The dense
    baselines and a trained-further base train in one each."""
    view = RunDir(out)
    if view.root.exists():
        shutil.rmtree(view.root)
    src.copy_vocab_to(view)
    view.data.symlink_to(src.data.resolve())
    return view


def write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically: readers see the old file or the new one, never half."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MfggufError(f"{what} is missing: {path}") from None
    except (OSError, ValueError) as e:
        raise MfggufError(f"{what} is unreadable: {path} ({e})") from None


# ---- modules and the manifest --------------------------------------------------------------------


def write_module(run: RunDir, index: int, tensors: dict, meta: dict) -> dict:
    """Write module `index` (safetensors of GGUF-named tensors + JSON), then record it in the manifest.

    `tensors` maps names to torch tensors or numpy arrays (router statistics included for
    experts). `meta` should carry kind, preset, config, trunk_sha256 (experts), shard,
    partition, tokens_seen, final_loss, heldout_loss, router_stats_count (experts).
    Returns the full metadata written.

    Example:
        >>> write_module(RunDir("RUN"), 0, model.trunk_tensors(), {"kind": "trunk", ...})
    """
    path = run.module_file(index)
    shapes = _save_f32(path, tensors, module_name(index))
    full = module_meta_for(path, index, meta, shapes)
    write_json(run.module_meta(index), full)
    update_manifest(run, index, full)
    return full


def write_module_streamed(run: RunDir, index: int, shapes: dict[str, tuple], read, meta: dict) -> dict:
    """`write_module` for a module too large to hold: `read(name)` gives one f32 tensor at a time.

    The same safetensors file `write_module` writes (tensors in name order, one metadata key),
    built by hand so that only one tensor is ever in memory.
    """
    import numpy as np

    names = sorted(shapes)
    header, off = {"__metadata__": {"format": f"{MODULE_FORMAT}/{module_name(index)}"}}, 0
    for k in names:
        n = 4 * int(np.prod(shapes[k]))
        header[k] = {"dtype": "F32", "shape": list(shapes[k]), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads its header to 8 bytes with spaces
    path = run.module_file(index)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for k in names:
            a = np.ascontiguousarray(read(k), dtype=np.float32)
            assert a.size == int(np.prod(shapes[k])), k
            f.write(memoryview(a).cast("B"))
    full = module_meta_for(path, index, meta, {k: list(v) for k, v in shapes.items()})
    write_json(run.module_meta(index), full)
    update_manifest(run, index, full)
    return full


def module_meta_for(path: Path, index: int, meta: dict, shapes: dict[str, list[int]]) -> dict:
    """The full JSON of a module file already written at `path` (hash, size, tensor shapes)."""
    return {
        "format": MODULE_FORMAT,
        "version": MODULE_VERSION,
        "name": module_name(index),
        "index": index,
        **{k: v for k, v in meta.items() if k not in ("file", "sha256", "blake3", "bytes", "tensors", "version")},
        "file": f"{module_name(index)}.safetensors",  # its name once published in RUN/modules
        **file_digests(path),
        "bytes": Path(path).stat().st_size,
        "tensors": {k: s for k, s in shapes.items() if not k.startswith(STATS_PREFIX)},
    }


def read_module_meta(run: RunDir, index: int) -> dict:
    name = module_name(index)
    if not run.module_meta(index).is_file() or not run.module_file(index).is_file():
        hint = "mfgguf train-trunk RUN" if index == 0 else f"mfgguf train-expert RUN --expert {index}"
        raise MfggufError(f"module {name} is missing in {run.modules}; train it with `{hint}`")
    meta = read_json(run.module_meta(index), f"metadata of module {name}")
    if meta.get("format") != MODULE_FORMAT or meta.get("version") not in READABLE_MODULE_VERSIONS:
        raise MfggufError(f"module {name} was written by an incompatible mfgguf; retrain it")
    return meta


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # experts may finish at once in parallel processes
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _save_f32(path: Path, tensors: dict, name: str) -> dict[str, list[int]]:
    """Write `tensors` (torch or numpy) as f32 safetensors at `path`, atomically; their shapes."""
    import numpy as np
    from safetensors.numpy import save_file

    arrays = {}
    for k, v in tensors.items():
        if hasattr(v, "detach"):
            v = v.detach().to("cpu").float().contiguous().numpy()
        arrays[k] = np.ascontiguousarray(v, dtype=np.float32)
    with atomic_path(path) as tmp:
        # One metadata key: safetensors writes the metadata map in hash order, so two keys would
        # make the sha256 of bit-identical weights differ from run to run.
        save_file(arrays, str(tmp), metadata={"format": f"{MODULE_FORMAT}/{name}"})
    return {k: list(a.shape) for k, a in arrays.items()}


@contextmanager
def _manifest(run: RunDir):
    """The manifest as a dict to edit, under the lock, written back atomically on exit."""
    with _locked(run.manifest):
        man = json.loads(run.manifest.read_text()) if run.manifest.is_file() else {"format": "mfgguf-manifest", "modules": {}}
        yield man
        write_json(run.manifest, man)


def update_manifest(run: RunDir, index: int, meta: dict) -> None:
    with _manifest(run) as man:
        man["modules"][module_name(index)] = {
            "index": index,
            "file": f"modules/{meta['file']}",
            "sha256": meta["sha256"],
            **({"blake3": meta["blake3"]} if meta.get("blake3") else {}),
            "bytes": meta["bytes"],
            "kind": meta.get("kind"),
            "trunk_sha256": meta.get("trunk_sha256"),
        }
        man["modules"] = dict(sorted(man["modules"].items(), key=lambda kv: kv[1]["index"]))


def write_router_stats(run: RunDir, tensors: dict, meta: dict) -> dict:
    """Write the pooled router statistics of the current trunk (modules/router_stats.*), recorded in
    the manifest under "router_stats" with their hashes, like a module. Returns the metadata."""
    path = run.router_stats
    _save_f32(path, tensors, "router_stats")
    full = {"format": MODULE_FORMAT, "version": MODULE_VERSION, "name": "router_stats", "kind": "router_stats",
            **{k: v for k, v in meta.items() if k not in ("sha256", "blake3", "bytes", "file")},
            "file": path.name, **file_digests(path), "bytes": path.stat().st_size}
    write_json(run.router_stats_meta, full)
    with _manifest(run) as man:
        man["router_stats"] = {"file": f"modules/{path.name}", "sha256": full["sha256"], "blake3": full["blake3"],
                               "bytes": full["bytes"], "trunk_sha256": full.get("trunk_sha256")}
    return full


def finished_against(expert_meta: dict, trunk_sha256: str) -> bool:
    """An expert module has trained its last round against this trunk: nothing left to train or sync."""
    return (expert_meta.get("trunk_sha256") == trunk_sha256
            and int(expert_meta.get("round", 1)) >= int(expert_meta.get("rounds", 1)))


def untrained_reason(rd: "RunDir", trunk_sha256: str, i: int) -> str | None:
    """Why expert i cannot be used with this trunk ("expert_003 is not trained yet", or has not finished
    training against it), or None when its module is here and finished."""
    if not rd.module_meta(i).is_file() or not rd.module_file(i).is_file():
        return f"{module_name(i)} is not trained yet"
    if not finished_against(read_module_meta(rd, i), trunk_sha256):
        return f"{module_name(i)} has not finished training against the current trunk"
    return None


def trained_expert_meta(rd: "RunDir", trunk_sha256: str, i: int, verb: str) -> dict:
    """Expert i's JSON record, when it has finished training against this trunk; else the error that says
    what to run before `verb` (the verb that needs it, as the user types it: "mfgguf router-stats")."""
    why = untrained_reason(rd, trunk_sha256, i)
    if why is not None and why.endswith("yet"):
        raise MfggufError(f"{why}; `{verb}` needs trained experts: `mfgguf train-expert {rd.root} --expert {i}` first")
    if why is not None:
        raise MfggufError(f"{why}; finish it (`mfgguf train-expert {rd.root} --expert {i}`, `mfgguf sync {rd.root}`)"
                          f" before `{verb}`")
    return read_module_meta(rd, i)


def recorded_experts(trunk_meta: dict) -> list[int] | None:
    """The experts the trunk's syncs merged (`sync --experts`), or None where no sync recorded a set."""
    return (trunk_meta.get("sync") or {}).get("expert_ids")


def router_stats_stale(meta: dict, trunk_sha256: str, experts: dict[str, str]) -> str | None:
    """Why pooled router statistics (their JSON `meta`) do not describe this trunk and these experts
    ({name: sha256}), or None when they do."""
    if meta.get("trunk_sha256") != trunk_sha256:
        return "belong to another version of the trunk"
    if meta.get("source") != "trunk":  # the trunk's own pass holds for any experts
        pooled = meta.get("experts") or {}
        for name, sha in experts.items():
            if name not in pooled:
                return f"cover other experts, not {name}"
            if pooled[name] != sha:
                return f"predate {name} (trained since)"
    return None


def router_stats_current(run: RunDir, ids: list[int] | None = None) -> bool:
    """The pooled router statistics were computed on the current trunk and every expert (or experts `ids`) as it
    is now."""
    if not run.router_stats_meta.is_file() or not run.module_meta(0).is_file():
        return False
    ids = range(1, int(run.info()["n_experts"]) + 1) if ids is None else ids
    experts = {module_name(i): read_json(run.module_meta(i), "an expert's metadata").get("sha256")
               if run.module_meta(i).is_file() else "" for i in ids}  # "": untrained, never current
    return router_stats_stale(read_json(run.router_stats_meta, "the pooled router statistics"),
                              read_json(run.module_meta(0), "the trunk's metadata").get("sha256"), experts) is None


def read_manifest(run: RunDir) -> dict:
    return read_json(run.manifest, "the run manifest (train the trunk first)")
