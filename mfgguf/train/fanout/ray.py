"""The Ray backend of `train-experts`: one Ray task per expert job.

Each task declares its CPUs and the measured memory of one job of the preset (schedule.JOB_MB),
so Ray places no more on a node than fits, and retries a task whose worker process died
(`max_retries`). A task runs `train_expert` in the worker itself:
  - shared: RUN is on a filesystem the worker sees (same path, same trunk hash): it trains there,
    checkpoints included, so a retried task resumes from the dead one's last checkpoint;
  - copy:   nothing is shared: the driver puts the trunk, tokenizer, run files, validation split,
            the expert's shard (and, between sync rounds, its checkpoint) in Ray's object store;
            the worker rebuilds a RUN under its temp dir, keyed by the trunk's hash and the job's
            options (a retry on the same node finds its checkpoint there), and sends back the module file, its metadata,
            its loss plot and its checkpoint. The driver writes them into RUN atomically after
            checking the module's sha256 against its metadata, then records it in the manifest.
A job's status (step, tokens/s, ETA, where) travels through a small actor, the live view's source.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

from mfgguf.errors import MfggufError
from mfgguf.options import JobOptions
from mfgguf.run import RunDir, atomic_path, manifest, module_name, sha256_file, update_manifest, write_json
from mfgguf.run.records import ModuleMeta
from mfgguf.train.fanout.jobs import Job, status_path
from mfgguf.train.engine.status import ENV as STATUS_ENV
from mfgguf.train.engine.status import read_status
from mfgguf.train.experts.tailstats import moments_path

POLL_S = 0.5
TRANSFERS = ("auto", "shared", "copy")


def _ray():
    try:
        import ray
    except ImportError:
        raise MfggufError("Ray is not installed; `pip install 'mfgguf[ray]'` (or leave out --ray for local processes)") from None
    return ray


class RayBackend:
    own_progress = False  # the scheduler's table shows the jobs' status files

    def __init__(self, rd: RunDir, address: str, job_mb: int, *, transfer: str = "auto", retries: int = 2,
                 cpus_per_job: int = 1):
        if transfer not in TRANSFERS:
            raise MfggufError(f"unknown --transfer {transfer!r}; choose one of {', '.join(TRANSFERS)}")
        ray = _ray()
        self.rd, self.job_mb, self.transfer, self.retries, self.cpus = rd, job_mb, transfer, retries, cpus_per_job
        self.started_here = False
        if not ray.is_initialized():
            # Ray starts workers at nice 15; a training job is the work itself, not background work
            os.environ.setdefault("RAY_worker_niceness", "0")
            try:
                if address == "local":
                    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
                else:
                    ray.init(address=address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
            except ConnectionError as e:
                raise MfggufError(f"cannot reach a Ray cluster at {address!r} ({e}); start one with `ray start --head`"
                                  " or use --ray local") from None
            self.started_here = True
        self.ray = ray
        self.board = ray.remote(num_cpus=0)(_Board).remote()
        self.task = ray.remote(_job)
        res = ray.cluster_resources()
        self.where = f"Ray ({int(res.get('CPU', 0))} CPUs on {len(ray.nodes())} node(s), transfer {transfer})"

    def describe(self) -> str:
        return self.where

    def close(self) -> None:
        if self.started_here:
            self.ray.shutdown()

    def run(self, jobs: list[Job], opts: JobOptions, view) -> None:
        ray, rd = self.ray, self.rd
        trunk_sha = manifest(rd).sha256("trunk")
        common = ray.put(_files(rd, _common_paths(rd))) if self.transfer != "shared" else None
        refs = {}
        for job in jobs:
            own = None
            if self.transfer != "shared":
                own = ray.put(_files(rd, [rd.shard(job.expert), *_tree(rd.checkpoint_dir(job.expert))]))
            ref = self.task.options(num_cpus=self.cpus, memory=self.job_mb << 20, max_retries=self.retries).remote(
                str(rd.root), job.expert, opts.to_dict(), self.transfer, trunk_sha, common, own, self.board)
            refs[ref] = job
            job.state = "queued"
        try:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=POLL_S)
                board = ray.get(self.board.snapshot.remote())
                for job in refs.values():
                    b = board.get(job.expert)
                    if b:
                        job.status, job.where = b["status"] or job.status, b["where"]
                        job.state, job.retries = "running", max(0, b["attempts"] - 1)
                for ref in ready:
                    job = refs.pop(ref)
                    self._finish(job, ref)
                view.refresh()
        finally:
            view.close()

    def _finish(self, job: Job, ref) -> None:
        ray = self.ray
        try:
            out = ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # the job raised: a real error, reported, not retried
            cause = getattr(e, "cause", None)
            job.state, job.error = "failed", str(cause) if cause is not None else str(e).strip().splitlines()[-1]
            _log(job, {"event": "failed", "where": job.where, "attempts": job.retries + 1, "error": job.error,
                       "detail": str(e)})
            return
        except ray.exceptions.RayError as e:  # the worker died and the retries are spent
            job.state, job.error = "failed", f"{type(e).__name__}: worker lost {self.retries + 1} time(s)"
            _log(job, {"event": "failed", "error": job.error, "detail": str(e)})
            return
        job.wall_s, job.peak_rss_mb, job.where = out["wall_s"], out["peak_rss_mb"], out["where"]
        job.retries = max(job.retries, out["attempts"] - 1)
        if out["mode"] == "copy":
            _receive(self.rd, job.expert, out)
        job.state = "done"
        _log(job, {"event": "done", "where": job.where, "attempts": job.retries + 1, "mode": out["mode"],
                   "wall_s": job.wall_s, "peak_rss_mb": round(job.peak_rss_mb, 1), "status": job.status})


def _log(job: Job, event: dict) -> None:
    """The driver's log of a Ray job: one JSON line per outcome (the worker's own output stays in Ray's logs)."""
    p = Path(job.log)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        f.write(json.dumps({"time": time.time(), "expert": job.expert, "round": job.round, **event}) + "\n")


# ---- the task (runs in a Ray worker) -------------------------------------------------------------


def _job(root: str, i: int, opts: dict, transfer: str, trunk_sha: str, common, own, board) -> dict:
    import resource

    import torch

    import ray

    # waited for: the count is this attempt's own, whatever the driver's last poll saw
    attempt = ray.get(board.started.remote(i, socket.gethostname(), os.getpid()))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or 1)))
    shared = transfer == "shared" or (transfer == "auto" and _sees_run(Path(root), trunk_sha))
    if shared:
        rd = RunDir(Path(root))
    else:
        key = hashlib.sha256(json.dumps([trunk_sha, opts], sort_keys=True).encode()).hexdigest()[:16]
        rd = _materialize(key, ray.get(common) if isinstance(common, ray.ObjectRef) else common,
                          ray.get(own) if isinstance(own, ray.ObjectRef) else own, i)
    status = status_path(rd, i)
    os.environ[STATUS_ENV] = str(status)
    stop = threading.Event()

    def push():  # the status file, to the driver's live view
        while not stop.wait(1.0):
            board.update.remote(i, read_status(status))

    threading.Thread(target=push, daemon=True).start()
    t0 = time.perf_counter()
    try:
        from mfgguf.train.experts.expert import train_expert

        o = JobOptions.from_dict(opts)
        trained = ModuleMeta.of(train_expert(rd.root, i, options=o.train, device=o.device, precision=o.precision,
                                             progress=False))
    finally:
        stop.set()
        os.environ.pop(STATUS_ENV, None)
    out = {"attempts": attempt, "mode": "shared" if shared else "copy", "wall_s": round(time.perf_counter() - t0, 2),
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "where": f"{socket.gethostname()} pid {os.getpid()}"}
    if not shared:
        name = module_name(i)
        record = ModuleMeta.from_json(json.loads(rd.module_meta(i).read_text()))
        out["meta"] = record.to_json()
        moments = [m] if (m := moments_path(rd, i)).is_file() else []  # the last round's, for the final sync
        out["files"] = _files(rd, [rd.module_file(i), rd.plots / f"loss_{name}.png", *moments, *_tree(rd.checkpoint_dir(i))])
        assert record.sha256 == trained.sha256
        shutil.rmtree(rd.checkpoint_dir(i), ignore_errors=True)  # shipped: the driver keeps it from now on
    return out


class _Board:
    """Ray actor: each job's host, attempts and last status, for the driver's live view."""

    def __init__(self):
        self.jobs: dict[int, dict] = {}

    def started(self, i: int, host: str, pid: int) -> int:
        j = self.jobs.setdefault(i, {"attempts": 0, "status": {}})
        j.update(attempts=j["attempts"] + 1, where=f"{host} pid {pid}", status={})
        return j["attempts"]

    def update(self, i: int, status: dict) -> None:
        if i in self.jobs and status:
            self.jobs[i]["status"] = status

    def snapshot(self) -> dict:
        return self.jobs


# ---- files in and out ----------------------------------------------------------------------------


def _common_paths(rd: RunDir) -> list[Path]:
    """What every job needs besides its shard: run files, tokenizer, trunk, the validation split it scores."""
    tok = [rd.tokenizer] if rd.tokenizer.is_file() else []  # a GGUF-only imported base has none (RUN/base/ holds its vocab)
    from mfgguf.train.whole.branch import branch_files

    branch = [f for f in branch_files(rd) if f.is_file()]  # a wsd trunk's branch point: wsd experts start from it
    return [rd.run_json, *tok, rd.module_file(0), rd.module_meta(0), *branch, *_tree(rd.validation_dir)]


def _tree(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file()) if d.is_dir() else []


def _files(rd: RunDir, paths: list[Path]) -> dict[str, bytes]:
    return {str(p.relative_to(rd.root)): p.read_bytes() for p in paths if p.is_file()}


def _sees_run(root: Path, trunk_sha: str) -> bool:
    """This worker sees RUN itself (a shared filesystem, or the driver's machine)."""
    try:
        return json.loads((root / "manifest.json").read_text())["modules"]["trunk"]["sha256"] == trunk_sha
    except (OSError, ValueError, KeyError):
        return False


def _materialize(key: str, common: dict[str, bytes], own: dict[str, bytes], i: int) -> RunDir:
    """A RUN for this job under the worker's temp dir, keyed by the trunk's hash and the job's options
    (a retry of the same job finds its checkpoint; another job never sees a stale one)."""
    rd = RunDir(Path(tempfile.gettempdir()) / "mfgguf-ray" / key)
    ckpt = str(rd.checkpoint_dir(i).relative_to(rd.root))
    keep_ckpt = rd.checkpoint_dir(i).is_dir()  # a dead attempt of this very round: resume from it
    for rel, data in {**common, **own}.items():
        if rel.startswith(ckpt + os.sep) and keep_ckpt:
            continue
        p = rd.root / rel
        if p.is_file() and p.stat().st_size == len(data) and p.read_bytes() == data:
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(p) as tmp:
            tmp.write_bytes(data)
    meta = json.loads(common[str(rd.module_meta(0).relative_to(rd.root))])
    manifest = {"format": "mfgguf-manifest", "modules": {}}
    if not rd.manifest.is_file():
        write_json(rd.manifest, manifest)
    update_manifest(rd, 0, meta)
    return rd


def _receive(rd: RunDir, i: int, out: dict) -> None:
    """Write a copy-mode job's results into RUN: module (hash checked), metadata, plot, checkpoint."""
    files, meta = out["files"], ModuleMeta.from_json(out["meta"])
    mod_rel = str(rd.module_file(i).relative_to(rd.root))
    ckpt = rd.checkpoint_dir(i)
    with atomic_path(rd.module_file(i)) as tmp:
        tmp.write_bytes(files[mod_rel])
        if sha256_file(tmp) != meta.sha256:
            raise MfggufError(f"{module_name(i)} arrived damaged (sha256 differs from its metadata); re-run train-experts")
    write_json(rd.module_meta(i), meta.to_json())
    update_manifest(rd, i, meta)
    if ckpt.is_dir():
        shutil.rmtree(ckpt)  # replaced by the job's (between rounds) or gone (after the last round), as locally
    for rel, data in files.items():
        if rel == mod_rel:
            continue
        p = rd.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(p) as tmp:
            tmp.write_bytes(data)


__all__ = ["RayBackend", "TRANSFERS"]
