"""`mfgguf train-base` and eval's baselines on an imported base: the base itself trained further, full or LoRA.

A small random `LlamaForCausalLM` saved by transformers is imported (tests/base), prepared on the
built-in corpus, and trained on: peft's LoRA merged into the weights computes what the adapted model
computed; continued pretraining changes every tensor and LoRA only the adapted linears; `mfgguf eval`
on an imported run trains the practitioner's baselines FLOP-matched to its experts and scores them
with llama.cpp beside the MoE.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import ModelConfig
from mfgguf.flops import continued_step_flops, expert_step_flops, module_flops, trunk_step_flops
from mfgguf.eval.domain_loras import LABEL as LORA_DOMAIN_LABEL
from mfgguf.run import RunDir, read_module, read_module_meta
from mfgguf.train.whole.continued import _inject_lora, _merged
from mfgguf.train.engine.weights import trunk_alone
from tests.base.test_import_base import save_hf_llama
from tests.conftest import sigkill_at_checkpoint
from tests.converters import text_sample
from tests.runtime.choice.files import write_hellaswag

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    from mfgguf.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("continued")
    tok = d / "tokenizer.json"
    train_tokenizer([text_sample(60_000)] * 2, 400).save(str(tok))
    run = d / "run"
    r = cli("import-base", save_hf_llama(d / "hf", tok, tied=False), "--out", run)
    assert r.exit_code == 0, r.output
    r = cli("prepare", "builtin", "--out", run, "--experts", "2", "--max-chars-per-domain", "150000", "--no-progress")
    assert r.exit_code == 0, r.output
    return run


def test_merged_lora_computes_what_the_adapted_model_computed(base_run):
    rd = RunDir(base_run)
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    model, route = trunk_alone(rd.module_file(0), cfg, torch.device("cpu"))
    named = _inject_lora(model, rank=4)
    assert named and all("lora_" in n for n in named)
    with torch.no_grad():
        for n, p in named.items():  # lora_B starts at zero: give the adapters something to merge
            p.normal_(0.0, 0.05)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    before = model(idx, route=route)
    merged = _merged(model, cfg)
    assert not any("lora" in n for n in dict(merged.named_parameters()))
    torch.testing.assert_close(merged(idx, route=route), before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_train_base_writes_a_trunk_llama_cpp_runs(base_run, tmp_path, mode):
    out = tmp_path / mode
    r = cli("train-base", base_run, "-o", out, "--mode", mode, "--tokens", 4096, "--lr", 1e-2, "--rank", 4, "--no-progress")
    assert r.exit_code == 0, r.output
    meta = read_module_meta(RunDir(out), 0)
    assert meta["continued"]["mode"] == mode and meta["tokens_seen"] == 4096 and meta["source"] == "base"
    assert 0 < meta["epochs"] < 1  # 4,096 tokens of the shards' many more
    old, new = load_file(str(RunDir(base_run).module_file(0))), load_file(str(RunDir(out).module_file(0)))
    assert old.keys() == new.keys()
    changed = {k for k in old if not np.array_equal(old[k], new[k])}
    if mode == "full":
        assert changed == set(old)  # every parameter trained
    else:  # the adapted linears only: embedding, norms and head as they were
        assert changed and all(k.startswith("blk.") and "norm" not in k for k in changed)
        assert "token_embd.weight" not in changed and "output.weight" not in changed
    gguf = tmp_path / f"{mode}.gguf"
    r = cli("assemble", out, "-o", gguf, "--experts", "none", "--quant", "f32", "-q")
    assert r.exit_code == 0, r.output
    from mfgguf.runtime.perplexity import perplexity

    held = next(iter(RunDir(out).test_tokens(512).values()))
    assert np.isfinite(perplexity(gguf, held, ctx=64)["ppl"])


def test_train_base_seed_sets_the_data_order_and_the_loras_start(base_run, tmp_path):
    from mfgguf.config import get_preset

    def train(name: str, *seed) -> tuple[dict, dict]:
        out = tmp_path / name
        r = cli("train-base", base_run, "-o", out, "--mode", "lora", "--tokens", 4096, "--lr", 1e-2, "--rank", 4,
                "--no-progress", *seed)
        assert r.exit_code == 0, r.output
        return read_module_meta(RunDir(out), 0), load_file(str(RunDir(out).module_file(0)))

    (m5, w5), (m6, w6) = train("s5", "--seed", 5), train("s6", "--seed", 6)
    assert (m5["continued"]["seed"], m5["train"]["seed"], m6["train"]["seed"]) == (5, 5, 6)
    assert any(not np.array_equal(w5[k], w6[k]) for k in w5)
    m, _ = train("default")  # as before the option: the preset's data order, recorded as no seed given
    assert m["continued"]["seed"] is None and m["train"]["seed"] == get_preset(m["preset"]).expert.seed


def test_train_base_refuses_in_one_line(base_run, tmp_path):
    (tmp_path / "taken").mkdir()
    r = cli("train-base", base_run, "-o", tmp_path / "taken", "--tokens", 4096, "--lr", 1e-3)
    assert r.exit_code == 1 and "already exists" in r.output and "--force" in r.output and "Traceback" not in r.output
    r = cli("train-base", base_run, "-o", tmp_path / "x", "--mode", "adapter", "--tokens", 4096, "--lr", 1e-3)
    assert r.exit_code == 1 and "unknown baseline mode" in r.output and not (tmp_path / "x").exists()
    r = cli("train-base", base_run, "-o", tmp_path / "x", "--shards", "1,7", "--tokens", 4096, "--lr", 1e-3)
    assert r.exit_code == 1 and "--shards 1,7 is out of range" in r.output and not (tmp_path / "x").exists()


def test_a_killed_train_base_resumes_to_the_same_bytes(base_run, tmp_path):
    """SIGKILL after a checkpoint (one after every step here), run the same command again: it resumes, and its
    trunk is bit for bit the uninterrupted run's; another training in that OUT needs --force and starts over."""
    import signal

    meta = read_module_meta(RunDir(base_run), 0)
    from mfgguf.config import get_preset

    tc = get_preset(meta.get("preset", "small")).expert
    tokens = 60 * tc.batch_size * meta["config"]["ctx_len"]  # 60 steps: the kill lands long before the end
    args = ["train-base", str(base_run), "--mode", "full", "--tokens", str(tokens), "--lr", "1e-3", "--no-progress"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert cli(*args[:2], "-o", whole, *args[2:]).exit_code == 0
    code = "import mfgguf.train.whole.continued as c; c.CKPT_SECONDS = 0.0; from mfgguf.cli.app import main; main()"
    state = RunDir(killed).checkpoint_dir(0) / "state.safetensors"
    assert sigkill_at_checkpoint(code, [*args[:2], "-o", str(killed), *args[2:]], state) == -signal.SIGKILL
    assert not RunDir(killed).module_file(0).exists(), "train-base finished before it was killed"
    r = cli(*args[:2], "-o", killed, *args[2:])  # the same command again: no --force needed to resume
    assert r.exit_code == 0, r.output
    m = read_module_meta(RunDir(killed), 0)
    assert 0 < m["resumed_from_step"] < 60 and m["tokens_seen"] == tokens
    # its wall is the training's: the killed process's training seconds are in it
    assert m["resumed_train_s"] > 0 and m["wall_s"] > m["train_s"] + m["resumed_train_s"]
    a, b = load_file(str(RunDir(whole).module_file(0))), load_file(str(RunDir(killed).module_file(0)))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not RunDir(killed).checkpoint_dir(0).exists()
    r = cli(*args[:2], "-o", killed, *args[2:6], "--lr", "3e-3", "--no-progress")  # another training: asked first
    assert r.exit_code == 1 and "already exists" in r.output and "--force" in r.output
    assert RunDir(killed).module_file(0).exists()


def test_continued_flops_count_what_trains():
    cfg = ModelConfig(vocab_size=400, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, anchor_ff=128, expert_ff=32,
                      ctx_len=64, seed_expert=True)
    full = continued_step_flops(cfg, "full").total
    assert full == trunk_step_flops(cfg).total  # the seed trains with the anchor: the base's whole FFN
    lora = continued_step_flops(cfg, "lora", rank=4).total
    expert = expert_step_flops(cfg).total
    assert expert < full and lora < full  # no weight gradients for the frozen base


def test_eval_on_an_imported_base_trains_the_practitioners_baselines(base_run, tmp_path):
    run = tmp_path / "run"
    import shutil

    shutil.copytree(base_run, run, symlinks=True)
    r = cli("train-expert", run, "--expert", 1, "--tokens", 4096, "--eval-tokens", 512, "--no-progress")
    assert r.exit_code == 0, r.output
    hellaswag = write_hellaswag(tmp_path / "hellaswag.txt")
    r = cli("eval", run, "--routers", "ridge", "--top-k", "1", "--quants", "", "--baselines", "flop,lora,lora-domain",
            "--max-tokens", 1024, "--ctx", 64, "--hellaswag", hellaswag)
    assert r.exit_code == 0, r.output
    rep = json.loads((run / "eval" / "report.json").read_text())
    plans = rep["base_baselines"]["plans"]
    labels = [p["label"] for p in plans]
    assert labels == ["base, continued pretraining, FLOP-matched", "base + LoRA r16, FLOP-matched", LORA_DOMAIN_LABEL]
    # general ability: the base, the MoE and every baseline on the same HellaSwag tasks, each paired with the base
    g = rep["general"]["hellaswag"]
    assert list(g["models"]) == ["trunk alone", "moe ridge top-1", *labels] and g["base"] == "trunk alone"
    assert set(g["paired"]) == set(g["models"]) - {"trunk alone"} and g["tasks"] == 12
    assert all(p["low"] <= p["points"] <= p["high"] and p["tasks"] == 12 for p in g["paired"].values())
    assert len({tuple(v["task_ids"]) for v in g["verdicts"].values()}) == 1  # the same tasks, in the same order
    assert sum(g["models"][LORA_DOMAIN_LABEL]["choice"].values()) == 12  # each task through the candidate it chose
    assert set(g["models"][LORA_DOMAIN_LABEL]["choice"]) == {"base", "lora-shard1"}
    assert "## General ability: hellaswag" in (run / "eval" / "report.md").read_text()
    assert (run / "eval" / "general_hellaswag.png").stat().st_size > 0
    for key in ("moe_over_flop_dense_mixed", "moe_over_lora_dense_mixed", "moe_over_lora-domain_dense_mixed"):
        assert rep["goals"][key] > 0
    # the per-domain LoRAs: expert 1's domains scored through its shard's llama.cpp adapter, the others by the base
    own = read_module_meta(RunDir(run), 1)["shard_domains"]
    adapters = rep["models"][LORA_DOMAIN_LABEL]["adapters"]
    assert set(adapters) == set(own) and all(Path(a).name == "lora.gguf" and Path(a).is_file() for a in adapters.values())
    assert [a["shard"] for a in plans[2]["adapters"]] == [1] and plans[2]["lr"] == rep["base_baselines"]["grid"]["lora"]["chosen_lr"]
    # served unmerged on the base: the adapter keeps its record, not the whole base's weights merged with it
    assert not RunDir(Path(plans[2]["adapters"][0]["run"])).module_file(0).exists()
    res = rep["results"]
    for d in set(res["trunk alone"]["domains"]) - set(own):  # no adapter is for it: the base alone, exactly
        assert res[LORA_DOMAIN_LABEL]["domains"][d]["ppl"] == res["trunk alone"]["domains"][d]["ppl"]
    # the same adapters with the domain unknown (each document picks by its opening), and the MoE on those documents
    st = rep["domain_stream"]
    assert (st["lora"], st["moe"]) == (LORA_DOMAIN_LABEL, rep["best"])
    lora_s, moe_s = st["results"][st["lora"]], st["results"][st["moe"]]
    assert lora_s["candidates"] == ["base", "lora-shard1"] and moe_s["candidates"] == [rep["best"]]
    for part in ("overall", "after_choice"):
        assert lora_s[part]["n_tokens"] == moe_s[part]["n_tokens"] > 0
    assert sum(sum(c.values()) for c in lora_s["choice"].values()) == sum(v["documents"] for v in lora_s["domains"].values())
    assert rep["goals"]["moe_over_lora-domain_stream_after_choice"] > 0
    assert "domain unknown" in (run / "eval" / "report.md").read_text()
    # the MoE validation chose, on the grid points' own measure: the same validation tokens, the same precision
    g, grid_meta = rep["moe_on_grid_scale"], read_module_meta(RunDir(plans[0]["run"]), 0)
    assert g["model"] == rep["best"] and g["eval_tokens"] == grid_meta["train"]["eval_tokens"]
    assert g["loss"].keys() == grid_meta["validation_loss"].keys() and g["trained_domains"] == sorted(own)
    assert g["mean_trained"] == pytest.approx(sum(g["loss"][d] for d in own) / len(own))
    assert g["grid"] == {m: v["validation_loss_trained_domains"] for m, v in rep["base_baselines"]["grid"].items()}
    assert "## The MoE on the LR grids' measure" in (run / "eval" / "report.md").read_text()
    plans = plans[:2]
    expert_flops = module_flops(read_module_meta(RunDir(run), 1))
    step = 16 * 256
    for p in plans:  # FLOP-matched within half an optimizer step
        meta = read_module_meta(RunDir(p["run"]), 0)
        per_tok = module_flops(meta) / meta["tokens_seen"]
        assert abs(module_flops(meta) - expert_flops) <= per_tok * step / 2 + 1e-6 * expert_flops
    assert set(rep["base_baselines"]["grid"]) == {"full", "lora"}
    assert rep["results"]["moe ridge top-1"]["domains"].keys() == rep["results"][labels[0]]["domains"].keys()
    # the base GGUF the adapters are served on is assembled again when an adapter is newer: it may hold another trunk
    # than the one they trained from (a RUN whose baselines once started from its merged trunk)
    import os

    base = run / "eval" / "models" / "base-lora-domain-f16.gguf"
    built = base.stat().st_mtime
    os.utime(next(iter(adapters.values())), (built + 5, built + 5))
    r = cli("eval", run, "--routers", "ridge", "--top-k", "1", "--quants", "", "--baselines", "flop,lora,lora-domain",
            "--max-tokens", 1024, "--ctx", 64)
    assert r.exit_code == 0, r.output
    assert base.stat().st_mtime > built and "assemble base-lora-domain-f16" in r.output
    # a baseline whose weights were pruned (its record kept) is trained again, not read
    pruned = RunDir(plans[0]["run"])
    pruned.module_file(0).unlink()
    r = cli("eval", run, "--routers", "ridge", "--top-k", "1", "--quants", "", "--baselines", "flop,lora,lora-domain",
            "--max-tokens", 1024, "--ctx", 64)
    assert r.exit_code == 0, r.output
    assert pruned.module_file(0).is_file()


def test_eval_on_a_gguf_base_with_sync_rounds_reads_validation_for_every_choice(tmp_path, base_run):
    """The README's recipe shape on a GGUF-imported base (no tokenizer.json in RUN: its vocabulary lives in base/):
    experts with attention copies over two sync rounds, then `eval`. Every choice-making stage runs with the test
    split gone, so none of them can have opened it; eval then scores the test split it is given back."""
    import shutil

    from tests.base.test_import_base import converted

    tok = base_run.parent / "tokenizer.json"
    gguf = converted(save_hf_llama(tmp_path / "hf", tok, tied=True), tmp_path / "base.gguf", "f32")
    run = tmp_path / "run"
    assert cli("import-base", gguf, "--out", run).exit_code == 0
    r = cli("prepare", "builtin", "--out", run, "--experts", "2", "--max-chars-per-domain", "150000", "--no-progress")
    assert r.exit_code == 0, r.output
    rd = RunDir(run)
    assert not rd.tokenizer.is_file() and rd.valid_dir.is_dir() and rd.validation_dir == rd.valid_dir
    assert set(rd.info()["valid"]) == set(rd.info()["test"])  # every domain has both splits
    test = tmp_path / "test-split"
    shutil.move(rd.test_dir, test)  # from here until eval's scoring, nothing may read the test split:
    rd.test_dir.mkdir()  # a decoy in its place fails whatever opens it
    for d in rd.info()["test"]:
        rd.test(d).write_bytes(b"not the test split")
    for k in range(2):
        for i in (1, 2):
            r = cli("train-expert", run, "--expert", i, "--tokens", 8192, "--eval-tokens", 512, "--shared", "attn",
                    "--rounds", 2, "--no-progress")
            assert r.exit_code == 0, r.output
        r = cli("sync", run, *(("--stats-from", "pass") if k else ()))  # the final one with its passes
        assert r.exit_code == 0, r.output
    from mfgguf.eval.baselines.imported import critical_path_s, plan_and_train

    metas = {i: read_module(rd, i) for i in range(3)}
    plans, grid = plan_and_train(rd, metas, tmp_path / "baselines", ("flop", "wallclock"))
    assert set(grid) == {"full"} and len(grid["full"]["validation_loss_trained_domains"]) == 3
    # every baseline starts from the imported base, not from the trunk the syncs merged the experts' attention into
    first = json.loads((rd.rounds / "sync_01" / "before" / "trunk.json").read_text())["sha256"]
    assert first != metas[0].sha256 and rd.first_trunk[0].parent.name == "before"
    for p in plans:
        assert read_module_meta(RunDir(p.run), 0)["continued"]["from_trunk_sha256"] == first, p.key
    from mfgguf.eval.baselines.imported import first_trunk_view

    served = first_trunk_view(rd, tmp_path / "views")  # where the per-domain LoRAs are served: the base they trained on
    assert read_module_meta(served, 0)["sha256"] == first
    flop = next(p for p in plans if p.key == "flop")
    assert flop.run.name == f"grid-full-lr{grid['full']['chosen_lr']:g}"  # the grid ran at the budget it is used with
    wall = next(p for p in plans if p.key == "wallclock")
    syncs = [json.loads(f.read_text()) for f in sorted(rd.rounds.glob("sync_*/sync.json"))]
    assert len(syncs) == 2 and all(s["wall_s"] > 0 for s in syncs)
    assert wall.budget == critical_path_s(rd, {i: metas[i] for i in (1, 2)}) > sum(s["wall_s"] for s in syncs)
    # its tokens: the critical path at the grid's fastest point's speed (they all run one step), whole steps
    import math

    speed = max(read_module_meta(RunDir(tmp_path / "baselines" / f"grid-full-lr{lr}"), 0)["tokens_per_s"]
                for lr in grid["full"]["validation_loss_trained_domains"])
    step = metas[1].train["batch_size"] * metas[0].config["ctx_len"]
    assert wall.tokens == max(step, math.floor(speed * wall.budget / step) * step)
    assert all(metas[i].restat_tokens > 0 for i in (1, 2))  # the final sync's passes, counted in module_flops
    # a later seed spends its training on the LR chosen before: a one-point grid, that very run reused here
    chosen = grid["full"]["chosen_lr"]
    again, one = plan_and_train(rd, metas, tmp_path / "baselines", ("flop",), lrs={"full": (chosen,)})
    assert list(one["full"]["validation_loss_trained_domains"]) == [f"{chosen:g}"] and one["full"]["chosen_lr"] == chosen
    assert again[0].run == flop.run and again[0].tokens == flop.tokens

    shutil.rmtree(rd.test_dir)
    shutil.move(test, rd.test_dir)
    r = cli("eval", run, "--routers", "ridge,uniform", "--top-k", "1", "--quants", "", "--baselines", "flop",
            "--max-tokens", 1024, "--ctx", 64, "--out", tmp_path / "baselines", "--full-lrs", f"{chosen:g}")
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "baselines" / "report.json").read_text())
    assert rep["splits"]["validation"] == "valid" and rep["splits"]["test"] == "test"
    assert list(rep["base_baselines"]["grid"]["full"]["validation_loss_trained_domains"]) == [f"{chosen:g}"]
    assert "trunk as trained (before sync)" in rep["results"]
    assert rep["best"] == min(rep["validation"], key=lambda k: rep["validation"][k]["ppl"])
    assert "(validation)" in (tmp_path / "baselines" / "report.md").read_text()
