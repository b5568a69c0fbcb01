"""The typed records of a RUN (records.py): read and written back byte for byte, fields typed."""

import json

from mfgguf.run.records import ModuleMeta, RunInfo, Untrained
from mfgguf.run import RunDir, untrained, untrained_reason


def test_module_record_round_trips_byte_for_byte():
    d = {"format": "mfgguf-module", "version": 2, "name": "expert_002", "index": 2, "kind": "expert",
         "trunk_sha256": "ab", "round": 2, "rounds": 3, "future_field": [1, {"x": None}], "file": "expert_002.safetensors",
         "sha256": "cd", "bytes": 10, "tensors": {"blk.0.ffn_up.weight": [4, 2]}}
    m = ModuleMeta.from_json(d)
    assert json.dumps(m.to_json(), indent=2) == json.dumps(d, indent=2)  # key order and unknown keys kept
    assert (m.kind, m.round, m.rounds, m.blake3, m.final) == ("expert", 2, 3, None, False)
    assert not m.finished_against("ab") and ModuleMeta.from_json({**d, "round": 3}).finished_against("ab")
    assert ModuleMeta.from_json({"sync": {"expert_ids": [1, 3]}, "round": 2}).sync_experts == [1, 3]
    assert ModuleMeta.from_json({}).syncs == 0 and ModuleMeta.from_json({}).round == 1


def test_run_info_reads_what_prepare_writes(tmp_path):
    d = {"format": "mfgguf-run", "version": 1, "n_experts": 2, "partition": "domain", "domains": ["a", "b"],
         "shards": [{"id": 1, "domains": {"a": 5}}, {"id": 2, "domains": {"b": 7}}]}
    (tmp_path / "run.json").write_text(json.dumps(d, indent=2) + "\n")
    rd = RunDir(tmp_path)
    info = rd.run_info()
    assert (info.n_experts, info.domains, info.shard_domains(2), info.shard_domains(3)) == (2, ["a", "b"], {"b": 7}, None)
    assert rd.info() == d and list(rd.info()) == list(d) and RunInfo.from_json(d).to_json() == d
    # what prepare writes beyond it, and what a run.json without it reads as
    assert (info.test, info.valid, info.sources, info.seed, info.train_docs) == ({}, {}, [], 0, None)
    assert (info.test_frac, info.valid_frac, info.max_chars_per_domain) == (0.05, 0.0, None)
    more = RunInfo.from_json({**d, "train_tokens": 90, "train_docs": 9, "test": {"a": {"docs": 1, "tokens": 4}},
                              "valid": {"b": {"docs": 2, "tokens": 6}}, "sources": ["builtin"], "seed": 3,
                              "test_frac": 0.1, "valid_frac": 0.2, "max_chars_per_domain": 1000})
    assert (more.train_tokens, more.train_docs, more.test["a"]["tokens"], more.valid["b"]["docs"]) == (90, 9, 4, 2)
    assert (more.sources, more.seed, more.test_frac, more.valid_frac, more.max_chars_per_domain) == \
        (["builtin"], 3, 0.1, 0.2, 1000)


def test_untrained_is_a_reason_not_a_message(tmp_path):
    rd = RunDir(tmp_path)
    assert untrained(rd, "ab", 3) is Untrained.MISSING
    assert untrained_reason(rd, "ab", 3) == "expert_003 is not trained yet"
    assert Untrained.UNFINISHED.says("expert_001") == "expert_001 has not finished training against the current trunk"
