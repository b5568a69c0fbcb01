"""`mfgguf eval --budget-flops`: an imported base's baselines alone, at FLOPs given instead of trained experts'. The
option reaches the config and a malformed one stops in one line; planned experts set the baselines' tokens as trained
experts of the same FLOPs would, and a wall-clock-matched baseline (which reads the experts' walls) is refused. No
training runs here: the stage that would train is recorded instead."""

from __future__ import annotations

from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import get_preset
from mfgguf.errors import MfggufError
from mfgguf.eval.baselines import imported
from mfgguf.eval.baselines.budgeted import evaluate_baselines
from mfgguf.eval.evaluate import EvalConfig
from mfgguf.flops import continued_step_flops
from mfgguf.run import ModuleMeta, RunDir


def test_the_cli_passes_the_budget_to_the_baselines_alone_and_refuses_a_malformed_one(monkeypatch, tmp_path):
    import mfgguf.eval.baselines.budgeted as only

    monkeypatch.setattr(only, "evaluate_baselines", lambda run, out, cfg, force=False: (_ for _ in ()).throw(
        MfggufError(f"budget {cfg.budget_flops} baselines {cfg.baselines}")))
    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--baselines", "flop", "--budget-flops", "4:2e14, 5:1.5e14"])
    assert r.exit_code == 1 and "budget {4: 200000000000000.0, 5: 150000000000000.0} baselines ('flop',)" in r.output
    for bad in ("4", "four:1e14", "4:-1"):
        r = CliRunner().invoke(app, ["eval", str(tmp_path), "--budget-flops", bad])
        assert r.exit_code == 1 and "--budget-flops" in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_budget_without_budgeted_baselines_is_refused(tmp_path):
    for which in ((), ("wallclock",), ("flop", "wallclock")):
        try:
            evaluate_baselines(tmp_path, None, EvalConfig(baselines=which, budget_flops={4: 1e14}))
        except MfggufError as e:
            assert "--budget-flops trains flop, lora, lora-domain" in str(e)
        else:
            raise AssertionError(which)


def test_planned_experts_set_the_baselines_tokens_from_their_flops(monkeypatch, tmp_path):
    cfg = get_preset("tiny").model
    step = 8 * cfg.ctx_len
    budget = {4: 3e12, 5: 1e12}
    planned = {i: ModuleMeta.from_json({"kind": "expert", "index": i, "shard": i, "shard_domains": {f"d{i}": 100},
                                        "config": cfg.to_dict(), "train": {"batch_size": 8}, "tokens_seen": 0,
                                        "planned_flops": f}) for i, f in budget.items()}
    metas = {0: ModuleMeta.from_json({"config": cfg.to_dict(), "source": "base"}), **planned}
    trained = []

    def fake_train(rd, run, *, mode, tokens, lr, shards, trunk_sha256, force=False, needs=(), seed=None,
                   weights=True):
        trained.append((run.name, mode, tokens, shards))
        return ModuleMeta.from_json({"tokens_seen": tokens, "validation_loss": {"d4": 1.0, "d5": 1.0}})

    monkeypatch.setattr(imported, "train_base", fake_train)
    monkeypatch.setattr(imported, "first_trunk_sha256", lambda rd: "sha")
    monkeypatch.setattr(imported, "first_trunk_view", lambda rd, out: None)
    assert imported.expert_flops(planned[4]) == 3e12
    plans, _ = imported.plan_and_train(RunDir(tmp_path), metas, tmp_path, ("flop", "lora", "lora-domain"), seed=1,
                                       lrs={"full": (3e-4,), "lora": (3e-3,)})
    full, lora = continued_step_flops(cfg, "full").total, continued_step_flops(cfg, "lora").total
    assert ("grid-full-lr0.0003", "full", imported.matched_tokens(4e12, full, step), [4, 5]) in trained
    assert ("grid-lora-lr0.003", "lora", imported.matched_tokens(4e12, lora, step), [4, 5]) in trained
    for i, f in budget.items():  # a LoRA per shard at its own expert's FLOPs
        assert (f"lora-shard{i}", "lora", imported.matched_tokens(f, lora, step), [i]) in trained
    assert [p.key for p in plans] == ["flop", "lora", "lora-domain"] and all(p.budget == 4e12 for p in plans)
