"""Training options declared once: TrainOptions written out in step with the config dataclasses, each option's
scope (which verbs take it) beside it, the train verbs' CLI options from TrainOptions, one `--experts` parser."""

from __future__ import annotations

import typing
from dataclasses import fields

import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import ModelConfig, TrainConfig
from mfgguf.errors import MfggufError
from mfgguf.options import (MODEL_OPTIONS, NOT_OPTIONS, TAKES, JobOptions, TrainOptions, flag, option_help,
                            option_names, parse_experts, scope)


def test_options_are_the_config_fields():
    """The hand-written class keeps in step: every TrainConfig field and every ModelConfig field but NOT_OPTIONS has
    exactly one option, in the configs' order, typed as the field or None, default None, with a scope and a help."""
    config = [f.name for f in fields(TrainConfig)]
    model = [f.name for f in fields(ModelConfig) if f.name not in NOT_OPTIONS]
    assert [f.name for f in fields(TrainOptions)] == config + model
    assert set(NOT_OPTIONS) <= {f.name for f in fields(ModelConfig)} and list(MODEL_OPTIONS) == model
    hints = typing.get_type_hints(TrainOptions)
    wanted = typing.get_type_hints(TrainConfig) | typing.get_type_hints(ModelConfig)
    for f in fields(TrainOptions):
        assert hints[f.name] == wanted[f.name] | None, f.name
        assert f.default is None and f.metadata["help"], f.name
        assert scope(f.name) in (("model",) if f.name in model else ("both", "trunk", "expert")), f.name


def test_overrides_are_checked():
    o = TrainOptions(lr=1e-3, anchor_ff=64)
    assert o.set_fields() == {"lr": 1e-3, "anchor_ff": 64} and o.model_changes() == {"anchor_ff": 64}
    assert o.train_config(TrainConfig()) == TrainConfig(lr=1e-3)
    with pytest.raises(TypeError, match="learning_rate"):
        TrainOptions(learning_rate=1)
    with pytest.raises(TypeError, match="vocab_size"):  # it comes from the RUN
        TrainOptions(vocab_size=9)


def test_job_options_round_trip_as_flags_and_json():
    job = JobOptions(TrainOptions(tokens=2048, expert_init="seed", seed_expert=False), precision="fp32")
    assert job.argv() == ["--tokens", "2048", "--init", "seed", "--no-seed-expert", "--precision", "fp32"]
    assert JobOptions.from_dict(job.to_dict()) == job


def test_every_option_has_its_help():
    assert option_help("lr") == "Peak learning rate (AdamW) (default: the preset's)."
    assert option_help("rounds").startswith("Experts: sync rounds R (with shared); ")  # an expert option says so
    assert option_help("compile").startswith("Torch.compile the training step")


def test_each_kind_takes_the_options_of_its_scopes():
    assert TAKES == {"trunk": ("both", "trunk", "model"), "expert": ("both", "expert")}
    assert set(MODEL_OPTIONS) & set(option_names("expert")) == set()
    assert {"expert_init", "shared", "shared_lr_scale", "rounds", "stats_tokens", "stats_from"} & set(
        option_names("trunk")) == set()
    for old in ("--tokens", "--lr", "--batch-size", "--ckpt-every", "--seed", "--eval-tokens", "--eval-every",
                "--curve-tokens", "--anchor-ff", "--seed-expert", "--schedule", "--cooldown"):
        assert old in [flag(n) for n in option_names("trunk")]
    for old in ("--tokens", "--init", "--shared", "--shared-lr-scale", "--rounds", "--schedule"):
        assert old in [flag(n) for n in option_names("expert")]


def test_verbs_show_the_options_they_take():
    for verb, kind in (("train-trunk", "trunk"), ("train-expert", "expert"), ("train-experts", "expert")):
        r = CliRunner().invoke(app, [verb, "--help"], terminal_width=200)
        assert r.exit_code == 0
        for name in (f.name for f in fields(TrainOptions)):
            assert (f" {flag(name)} " in r.output) == (name in option_names(kind)), (verb, name)


def test_an_option_a_kind_does_not_take_is_refused_in_one_line():
    with pytest.raises(MfggufError, match="^--rounds is an expert option; train-trunk does not take it$"):
        TrainOptions(tokens=1, rounds=4).check("trunk", "train-trunk")
    with pytest.raises(MfggufError, match=r"^--no-seed-expert is a model shape option \(experts use the trunk's\);"
                                          " train-expert does not take it$"):
        TrainOptions(seed_expert=False).check("expert", "train-expert")
    o = TrainOptions(tokens=1, schedule="wsd", anchor_ff=64)
    assert o.check("trunk", "train-trunk") is o


@pytest.mark.parametrize("args,line", [
    (["train-trunk", "RUN", "--rounds", "4"], "--rounds is an expert option; train-trunk does not take it"),
    (["train-trunk", "RUN", "--init", "seed"], "--init is an expert option; train-trunk does not take it"),
    (["train-expert", "RUN", "--expert", "1", "--anchor-ff", "64"],
     "--anchor-ff is a model shape option (experts use the trunk's); train-expert does not take it"),
    (["train-experts", "RUN", "--seed-expert"],
     "--seed-expert is a model shape option (experts use the trunk's); train-experts does not take it"),
])
def test_train_verbs_refuse_an_option_they_do_not_take(tmp_path, args, line):
    """Exit 1 and one line, before the RUN is read (here there is none)."""
    r = CliRunner().invoke(app, [str(tmp_path / "none") if a == "RUN" else a for a in args])
    assert r.exit_code == 1, (r.exit_code, r.output)
    assert r.stderr.strip().splitlines() == [f"error: {line}"]


def test_library_calls_refuse_an_option_they_do_not_take(tmp_path):
    from mfgguf.train.experts.expert import train_expert
    from mfgguf.train.fanout.schedule import train_experts
    from mfgguf.train.whole.trunk import train_trunk

    with pytest.raises(MfggufError, match="^--rounds is an expert option; train-trunk does not take it$"):
        train_trunk(tmp_path, options=TrainOptions(rounds=4))
    with pytest.raises(MfggufError, match="^--dim is a model shape option .*; train-expert does not take it$"):
        train_expert(tmp_path, 1, options=TrainOptions(dim=64))
    with pytest.raises(MfggufError, match="^--ctx-len is a model shape option .*; train-experts does not take it$"):
        train_experts(tmp_path, job=JobOptions(TrainOptions(ctx_len=64)))


def test_parse_experts():
    assert parse_experts("1-3,5", 8) == [1, 2, 3, 5]
    assert parse_experts("3,1") == [3, 1] and parse_experts("1,2,1") == [1, 2, 1]  # the caller judges duplicates
    assert parse_experts(None) is None and parse_experts("all") is None and parse_experts("all", 2) == [1, 2]
    assert parse_experts("none") == [] == parse_experts("", 4)
    with pytest.raises(MfggufError, match="out of range"):
        parse_experts("2-9", 4)
    for bad in ("a-b", "3-1", "1,x"):
        with pytest.raises(MfggufError, match="ranges such as"):
            parse_experts(bad)


def test_no_help_text_is_eaten_as_rich_markup():
    # typer renders help through rich, which drops "[lower-case ...]" as a style tag: the user sees a hole
    import re

    import typer.main

    tag = re.compile(r"(?<!\\)\[[a-z#/@][^[]*?]")

    def texts(cmd, path):
        yield path, cmd.help or ""
        for p in cmd.params:
            yield f"{path} {p.name}", getattr(p, "help", None) or ""
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from texts(sub, f"{path} {name}")

    eaten = [(where, m.group(0)) for where, t in texts(typer.main.get_command(app), "mfgguf") for m in tag.finditer(t)]
    assert eaten == []


def test_choices_are_checked_once_by_the_flag_the_user_typed():
    from dataclasses import replace

    from mfgguf.config import CHOICES, FLAGS, get_preset
    from mfgguf.errors import MfggufError

    for name in CHOICES:
        with pytest.raises(MfggufError, match=f"unknown {FLAGS.get(name, '--' + name.replace('_', '-'))} 'bogus';"
                                              " choose one of "):
            TrainOptions(**{name: "bogus"}).train_config(get_preset("tiny").expert)
        assert replace(get_preset("tiny").trunk) == get_preset("tiny").trunk  # every preset's values pass
