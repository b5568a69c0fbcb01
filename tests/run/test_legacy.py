"""A RUN made before the splits, the losses and a trunk's syncs had names of their own (data/heldout/, "heldout_loss",
a trunk's "round") is read as it is, under the current names: hand-made records of that time."""

from __future__ import annotations

import json

import numpy as np

from mfgguf.run import RunDir, RunInfo, read_module, write_json
from mfgguf.run.files import file_digests

OLD_RUN = {"format": "mfgguf-run", "version": 1, "n_experts": 1, "partition": "label", "domains": ["c"],
           "shards": [{"id": 1, "docs": 3, "tokens": 30, "domains": {"c": 30}}],
           "heldout": {"c": {"docs": 1, "tokens": 8}}, "heldout_frac": 0.05, "seed": 0}


def _old_module(rd: RunDir, index: int, extra: dict) -> dict:
    f = rd.module_file(index)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(b"weights")
    meta = {"format": "mfgguf-module", "version": 2, "name": f.stem, "index": index, "kind": extra.pop("kind"),
            **extra, "file": f.name, **file_digests(f), "bytes": f.stat().st_size, "tensors": {}}
    write_json(rd.module_meta(index), meta)
    return meta


def old_run(tmp_path) -> RunDir:
    rd = RunDir(tmp_path / "run")
    (rd.data / "heldout").mkdir(parents=True)
    np.save(rd.data / "heldout" / "c.npy", np.arange(8, dtype=np.uint16))
    write_json(rd.run_json, OLD_RUN)
    _old_module(rd, 0, {"kind": "trunk", "heldout_loss": {"c": 2.5}, "heldout_loss_mean": 2.5,
                        "heldout_history": [[0, 0, {"c": 3.0}]], "trained_heldout_loss": {"c": 2.6}, "round": 2, "rounds": 3})
    _old_module(rd, 1, {"kind": "expert", "trunk_sha256": "ab", "heldout_loss": {"c": 2.0},
                        "trunk_heldout_loss": {"c": 2.5}, "heldout_on": "own trunk copy",
                        "premerge": {"heldout_loss_mean": 2.1}, "round": 1, "rounds": 1})
    return rd


def test_an_old_runs_test_split_and_run_json_are_read_under_their_new_names(tmp_path):
    rd = old_run(tmp_path)
    assert rd.test_dir == rd.data / "heldout" and rd.test("c").is_file()
    assert rd.validation_dir == rd.test_dir  # no data/valid/: the one split serves both
    assert list(rd.test_tokens()) == ["c"]
    info = rd.info()
    assert info["test"] == OLD_RUN["heldout"] and info["test_frac"] == 0.05 and "heldout" not in info
    assert list(info)[-3:] == ["test", "test_frac", "seed"]  # renamed in place: the key order kept
    typed = rd.run_info()
    assert (typed.test, typed.test_frac, typed.valid, typed.valid_frac) == (OLD_RUN["heldout"], 0.05, {}, 0.0)
    assert RunInfo.from_json({**OLD_RUN, "heldout_frac": 0.2}).test_frac == 0.2  # not the default's 0.05


def test_an_old_runs_module_records_are_read_under_their_new_names(tmp_path):
    rd = old_run(tmp_path)
    trunk, expert = read_module(rd, 0), read_module(rd, 1)
    assert trunk.validation_loss == {"c": 2.5} and expert.trunk_validation_loss == {"c": 2.5}
    assert (trunk.syncs, trunk.round, expert.round) == (2, 1, 1)  # a trunk's "round" counted its syncs
    j = trunk.to_json()
    assert j["validation_loss_mean"] == 2.5 and j["validation_history"] == [[0, 0, {"c": 3.0}]]
    assert j["trained_validation_loss"] == {"c": 2.6} and not any("heldout" in k for k in j)
    e = expert.to_json()
    assert e["validation_on"] == "own trunk copy" and e["premerge"] == {"validation_loss_mean": 2.1}


def test_a_new_record_is_read_byte_for_byte(tmp_path):
    rd = old_run(tmp_path)
    new = read_module(rd, 1).to_json()
    write_json(rd.module_meta(1), new)
    assert read_module(rd, 1).to_json() == new and json.loads(rd.module_meta(1).read_text()) == new


def test_an_old_sync_plan_and_manifest_are_read_typed(tmp_path):
    from mfgguf.run import Manifest, SyncPlan

    plan = SyncPlan.from_json({"format": "mfgguf-sync", "state": "staged", "round": 2, "rounds": 2, "final": True,
                               "experts": 2, "before_heldout_loss": {"c": 2.4},
                               "modules": {"trunk": {"kind": "trunk", "index": 0, "round": 2, "heldout_loss": {}}}})
    assert plan.before_validation_loss == {"c": 2.4} and plan.ids == [1, 2] and not plan.published
    assert plan.modules["trunk"].syncs == 2 and "round" not in plan.modules["trunk"].to_json()
    m = Manifest.from_json({"format": "mfgguf-manifest", "modules": {"trunk": {"index": 0, "sha256": "ab"}}})
    assert (m.sha256("trunk"), m.sha256("expert_001")) == ("ab", None)
