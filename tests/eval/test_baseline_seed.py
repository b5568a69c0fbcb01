"""`mfgguf eval --seed` and `--full-lrs` / `--lora-lrs`: the seed and the LR grids reach every baseline's training,
and a baseline trained with another seed is trained again rather than reused. No training runs here: the stage that would train is recorded instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.errors import MfggufError
from mfgguf.eval import evaluate as ev_mod
from mfgguf.eval.baselines import imported
from mfgguf.eval.baselines.baseline import Job, Outcome
from mfgguf.run import ModuleMeta, RunDir


def test_eval_cli_seed_reaches_the_config(monkeypatch, tmp_path):
    def fake(run, out, cfg, force=False):
        raise MfggufError(f"seed {cfg.seed} baselines {cfg.baselines}")

    import mfgguf.cli.evaluate as cli_eval

    monkeypatch.setattr(cli_eval, "evaluate", fake)
    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--seed", "3", "--baselines", "lora-domain"])
    assert r.exit_code == 1 and "seed 3 baselines ('lora-domain',)" in r.output
    r = CliRunner().invoke(app, ["eval", str(tmp_path)])
    assert "seed None baselines None" in r.output


def test_eval_cli_lr_grids_reach_the_config_and_bad_ones_stop(monkeypatch, tmp_path):
    import mfgguf.cli.evaluate as cli_eval

    monkeypatch.setattr(cli_eval, "evaluate", lambda run, out, cfg, force=False: (_ for _ in ()).throw(
        MfggufError(f"lrs {cfg.baseline_lrs}")))
    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--full-lrs", "3e-4", "--lora-lrs", "1e-3,3e-3"])
    assert r.exit_code == 1 and "lrs {'full': (0.0003,), 'lora': (0.001, 0.003)}" in r.output
    assert "lrs None" in CliRunner().invoke(app, ["eval", str(tmp_path)]).output  # GRID's, per mode
    for bad in ("3", "fast", "-1e-3"):
        r = CliRunner().invoke(app, ["eval", str(tmp_path), "--full-lrs", bad])
        assert r.exit_code == 1 and "--full-lrs" in r.output and "Traceback" not in r.output
        assert len(r.output.strip().splitlines()) == 1, r.output


def test_the_config_seed_reaches_the_imported_side(monkeypatch, tmp_path):
    seen = {}

    class Side:
        def train(self, job: Job) -> Outcome:
            seen["job"] = job
            return Outcome()

    monkeypatch.setattr(ev_mod, "side_for", lambda trunk: Side())
    ev = ev_mod.Evaluation(RunDir(tmp_path), ev_mod.EvalConfig(seed=5), False,
                           {0: ModuleMeta.from_json({"source": "base"})}, None, {}, tmp_path)
    ev_mod.train_baselines(ev)
    assert seen["job"].seed == 5

    monkeypatch.setattr(imported, "plan_and_train", lambda rd, metas, out, which, force, seed, lrs:
                        seen.update(seed=seed, lrs=lrs) or ([], {}))
    imported.Imported().train(Job(RunDir(tmp_path), {0: ModuleMeta()}, tmp_path, None, False, ("cosine",), seed=5,
                                  lrs={"lora": (3e-3,)}))
    assert seen["seed"] == 5 and seen["lrs"] == {"lora": (3e-3,)}


def test_train_base_passes_the_seed_and_retrains_for_another(monkeypatch, tmp_path):
    run = tmp_path / "grid-lora-lr0.001"
    (run / "modules").mkdir(parents=True)
    (run / "modules" / "trunk.json").write_text("{}")
    (run / "modules" / "trunk.safetensors").write_bytes(b"")  # its weights: a record without them is trained again
    record = {"tokens_seen": 4096, "continued": {"mode": "lora", "lr": 1e-3, "shards": [1, 2],
                                                 "from_trunk_sha256": "abc", "seed": 7}}
    calls = []
    monkeypatch.setattr(imported, "read_module", lambda rd, i, **kw: ModuleMeta.from_json(json.loads(json.dumps(record))))
    monkeypatch.setattr(imported, "run_stage", lambda name, args: calls.append([str(a) for a in args]))
    kw = dict(mode="lora", tokens=4096, lr=1e-3, shards=[1, 2], trunk_sha256="abc")
    rd = RunDir(tmp_path)
    assert imported.train_base(rd, run, seed=7, **kw).to_json() == record and calls == []  # this very training: reused
    imported.train_base(rd, run, seed=8, **kw)
    assert len(calls) == 1 and calls[0][-2:] == ["--seed", "8"]
    imported.train_base(rd, run, **kw)  # no seed: one trained with seed 7 is not what no seed trains
    assert len(calls) == 2 and "--seed" not in calls[1]
    del record["continued"]["seed"]  # a record from before --seed existed: what no seed trains, reused
    imported.train_base(rd, run, **kw)
    assert len(calls) == 2
    (run / "modules" / "trunk.json").unlink()  # weights without their record (killed between the two): trained again
    imported.train_base(rd, run, **kw)
    assert len(calls) == 3
    assert Path(calls[0][1]) == tmp_path and calls[0][0] == "train-base"


def test_train_base_reuses_a_training_whose_step_did_not_divide_the_tokens(monkeypatch, tmp_path):
    """FLOP-matched tokens come in the experts' steps (batch 4 x 256 here); train-base trains whole steps of its own
    batch (16 x 256), so it saw fewer than asked. Its record's request is what a rerun of eval matches: training it
    again would replace the finished baseline (train-base --force) for the same result."""
    run = tmp_path / "grid-full-lr0.0003"
    (run / "modules").mkdir(parents=True)
    (run / "modules" / "trunk.json").write_text("{}")
    (run / "modules" / "trunk.safetensors").write_bytes(b"")
    record = {"tokens_seen": 282_624, "train": {"tokens": 283_648},
              "continued": {"mode": "full", "lr": 3e-4, "shards": [1, 2], "from_trunk_sha256": "abc", "seed": 1}}
    calls = []
    monkeypatch.setattr(imported, "read_module", lambda rd, i, **kw: ModuleMeta.from_json(json.loads(json.dumps(record))))
    monkeypatch.setattr(imported, "run_stage", lambda name, args: calls.append([str(a) for a in args]))
    kw = dict(mode="full", lr=3e-4, shards=[1, 2], trunk_sha256="abc", seed=1)
    assert imported.train_base(RunDir(tmp_path), run, tokens=283_648, **kw).to_json() == record and calls == []
    imported.train_base(RunDir(tmp_path), run, tokens=287_744, **kw)  # another budget: trained again
    assert len(calls) == 1


def test_a_dense_baseline_is_trained_with_the_seed_and_again_for_another(monkeypatch, tmp_path):
    from mfgguf.eval.baselines import scratch

    trunk = ModuleMeta.from_json({"preset": "tiny", "train": {"batch_size": 8, "lr": 1e-3, "seed": 1234, "eval_tokens": 512}})
    plan = scratch.Baseline("flop", "dense, FLOP-matched", 64, 1e12, 8192, 1e6)
    (tmp_path / "dense-flop" / "modules").mkdir(parents=True)
    (tmp_path / "dense-flop" / "modules" / "trunk.json").write_text("{}")
    record = {"config": {"anchor_ff": 64}, "tokens_seen": 8192, "train": {"schedule": "cosine", "seed": 1234}}
    calls = []
    monkeypatch.setattr(scratch, "read_module", lambda rd, i: ModuleMeta.from_json(record))
    monkeypatch.setattr(scratch, "data_view", lambda rd, out: RunDir(out))
    monkeypatch.setattr(scratch, "run_stage", lambda name, args: calls.append([str(a) for a in args]))
    scratch.train_baseline(RunDir(tmp_path), trunk, plan, tmp_path)  # the trunk's seed, as recorded: reused
    assert calls == []
    scratch.train_baseline(RunDir(tmp_path), trunk, plan, tmp_path, seed=2)
    assert len(calls) == 1 and calls[0][calls[0].index("--seed") + 1] == "2"


def test_a_domain_adapter_keeps_no_merged_trunk_and_is_reused_without_one(monkeypatch, tmp_path):
    """A per-cluster LoRA is served as an adapter on the base: its merged trunk (a whole base's weights) is deleted
    once trained, and its record with the adapter is what a rerun reuses."""
    run = tmp_path / "lora-shard3"
    record = {"tokens_seen": 4096, "continued": {"mode": "lora", "lr": 1e-3, "shards": [3],
                                                 "from_trunk_sha256": "abc", "seed": 1}}
    calls = []

    def fake_train_base(name, args):  # what train-base leaves: the record, the merged trunk and the adapter
        calls.append(name)
        (run / "modules").mkdir(parents=True, exist_ok=True)
        (run / "modules" / "trunk.json").write_text("{}")
        (run / "modules" / "trunk.safetensors").write_bytes(b"weights")
        (run / "lora.gguf").write_bytes(b"GGUF")

    monkeypatch.setattr(imported, "read_module", lambda rd, i, **kw: ModuleMeta.from_json(json.loads(json.dumps(record))))
    monkeypatch.setattr(imported, "run_stage", fake_train_base)
    kw = dict(mode="lora", tokens=4096, lr=1e-3, shards=[3], trunk_sha256="abc", seed=1, needs=("lora.gguf",))
    imported.train_base(RunDir(tmp_path), run, weights=False, **kw)
    assert len(calls) == 1 and not (run / "modules" / "trunk.safetensors").exists()
    assert (run / "lora.gguf").is_file() and (run / "modules" / "trunk.json").is_file()
    assert imported.train_base(RunDir(tmp_path), run, weights=False, **kw).to_json() == record and len(calls) == 1  # reused
    imported.train_base(RunDir(tmp_path), run, **kw)  # the merged weights asked for: they are gone, so trained again
    assert len(calls) == 2
    (run / "lora.gguf").unlink()  # the adapter is what it is kept for: without it, trained again
    imported.train_base(RunDir(tmp_path), run, weights=False, **kw)
    assert len(calls) == 3 and not (run / "modules" / "trunk.safetensors").exists()


def test_the_cluster_loras_alone_with_one_lr_train_no_grid(monkeypatch, tmp_path):
    """`--baselines lora-domain --lora-lrs 3e-3`: the one LR is taken as given; the one LoRA the grid would train
    only to choose it is not trained. With two LRs, or with the one-LoRA baseline asked for, the grid runs."""
    from mfgguf.config import get_preset

    trained, cluster_loras = [], []
    monkeypatch.setattr(imported, "train_base", lambda rd, run, **kw: trained.append(run.name) or
                        ModuleMeta.from_json({"validation_loss": {"c": 1.0}, "tokens_seen": 4096, "tokens_per_s": 1.0}))
    monkeypatch.setattr(imported, "train_domain_loras", lambda rd, metas, out, lr, force, seed:
                        cluster_loras.append(lr) or [])
    for name in ("critical_path_s", "first_trunk_sha256"):
        monkeypatch.setattr(imported, name, lambda *a: 0)
    monkeypatch.setattr(imported, "module_flops", lambda m: 1e12)
    monkeypatch.setattr(imported, "first_trunk_view", lambda rd, out: None)
    cfg = get_preset("tiny").model.__dict__
    metas = {0: ModuleMeta.from_json({"config": cfg}),
             1: ModuleMeta.from_json({"train": {"batch_size": 4}, "shard": 1, "shard_domains": ["c"]})}
    rd = RunDir(tmp_path)
    plans, grid = imported.plan_and_train(rd, metas, tmp_path / "b", ("lora-domain",), lrs={"lora": (3e-3,)})
    assert trained == [] and cluster_loras == [3e-3] and [p.key for p in plans] == ["lora-domain"]
    assert grid["lora"]["chosen_lr"] == 3e-3 and grid["lora"]["validation_loss_trained_domains"] == {}
    imported.plan_and_train(rd, metas, tmp_path / "b", ("lora-domain",), lrs={"lora": (1e-3, 3e-3)})
    assert trained == ["grid-lora-lr0.001", "grid-lora-lr0.003"]  # two LRs: the grid chooses
    imported.plan_and_train(rd, metas, tmp_path / "b", ("lora", "lora-domain"), lrs={"lora": (3e-3,)})
    assert trained[2:] == ["grid-lora-lr0.003"]  # the one LoRA is that grid's run: trained
