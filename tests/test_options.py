"""Training options declared once: TrainOptions from the config dataclasses, the train verbs' CLI
options from TrainOptions, one `--experts` parser."""

from __future__ import annotations

from dataclasses import fields

import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.cli.options import scope_fields
from mfgguf.config import ModelConfig, TrainConfig
from mfgguf.errors import MfggufError
from mfgguf.options import (EXPERT_ONLY, MODEL_OPTIONS, JobOptions, TrainOptions, field_help, flag, option_help,
                            parse_experts)


def test_options_are_the_config_fields():
    assert [f.name for f in fields(TrainOptions)] == [f.name for f in fields(TrainConfig)] + list(MODEL_OPTIONS)
    assert "vocab_size" not in MODEL_OPTIONS and "n_experts" not in MODEL_OPTIONS
    assert all(getattr(TrainOptions(), f.name) is None for f in fields(TrainOptions))


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


def test_every_field_has_a_comment_as_help():
    helps = field_help(TrainConfig) | field_help(ModelConfig)
    assert all(helps[f.name] for f in fields(TrainOptions))
    assert field_help(TrainConfig)["eval_every"].endswith("training time: docs/benchmarks.md)")  # continuation lines joined
    assert option_help("lr") == "Peak learning rate (AdamW) (default: the preset's)."


def test_verbs_take_the_fields_of_their_scope():
    for verb, scope in (("train-trunk", "trunk"), ("train-expert", "expert"), ("train-experts", "expert")):
        r = CliRunner().invoke(app, [verb, "--help"], terminal_width=200)
        assert r.exit_code == 0
        for name in scope_fields(scope):
            assert f" {flag(name)} " in r.output, (verb, name)
    assert set(EXPERT_ONLY) & set(scope_fields("trunk")) == set()
    assert set(MODEL_OPTIONS) & set(scope_fields("expert")) == set()
    for old in ("--tokens", "--lr", "--batch-size", "--ckpt-every", "--seed", "--eval-tokens", "--eval-every",
                "--curve-tokens", "--anchor-ff", "--seed-expert"):
        assert old in [flag(n) for n in scope_fields("trunk")]
    for old in ("--tokens", "--init", "--shared", "--shared-lr-scale", "--rounds"):
        assert old in [flag(n) for n in scope_fields("expert")]


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
