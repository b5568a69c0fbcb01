"""`train-base --mode lora` writes its LoRA unmerged as a llama.cpp adapter: base + adapter == merged model.

The per-domain LoRA a practitioner serves instead of experts (llama-server picks an adapter per
request): a tiny imported llama base, a LoRA trained on one shard, then llama.cpp's logits of the
base GGUF with the adapter applied against those of the merged model's GGUF (f32 both).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mfgguf.gguf.lora import check_pairs
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, read_module_meta
from mfgguf.runtime.llm import loaded
from tests.train.whole.test_continued import base_run, cli  # noqa: F401  (the module-scoped fixture)


def _logits(gguf, tokens, lora=None) -> np.ndarray:
    with loaded(gguf, n_ctx=64, logits_all=True, lora=lora) as llm:
        llm.reset()
        llm.eval(list(map(int, tokens)))
        return np.array(llm.scores[: len(tokens)], dtype=np.float64)  # (T, vocab)


@pytest.fixture(scope="module")
def adapted(base_run, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("adapter")
    out = d / "lora-1"
    r = cli("train-base", base_run, "-o", out, "--mode", "lora", "--shards", "1", "--tokens", 4096, "--lr", 1e-2,
            "--rank", 4, "--no-progress")
    assert r.exit_code == 0, r.output
    for run, name in ((base_run, "base.gguf"), (out, "merged.gguf")):
        r = cli("assemble", run, "-o", d / name, "--experts", "none", "--quant", "f32", "-q")
        assert r.exit_code == 0, r.output
    return d, out


def test_base_plus_adapter_is_the_merged_model(adapted, base_run):  # noqa: F811
    d, out = adapted
    assert read_module_meta(RunDir(out), 0)["continued"]["adapter"] == "lora.gguf"
    tokens = next(iter(RunDir(base_run).test_tokens(48).values()))[:48]
    merged = _logits(d / "merged.gguf", tokens)
    with_adapter = _logits(d / "base.gguf", tokens, lora=out / "lora.gguf")
    base = _logits(d / "base.gguf", tokens)
    moved = np.abs(base - merged).max()
    print(f"max |base + adapter - merged| {np.abs(with_adapter - merged).max():.2e}, max |base - merged| {moved:.3f},"
          f" max |logit| {np.abs(merged).max():.2f}")
    assert moved > 1e-2  # the adapter trained to something llama.cpp can tell apart
    assert np.abs(with_adapter - merged).max() < 1e-3 * max(1.0, np.abs(merged).max()), np.abs(with_adapter - merged).max()


def test_adapter_file_is_what_llama_cpp_expects(adapted):
    from gguf import GGUFReader

    d, out = adapted
    r = GGUFReader(str(out / "lora.gguf"))
    kv = {f.name: f for f in r.fields.values()}
    val = lambda k: bytes(kv[k].parts[-1]).decode() if kv[k].types[0].name == "STRING" else float(kv[k].parts[-1][0])
    assert val("general.type") == "adapter" and val("adapter.type") == "lora" and val("general.architecture") == "llama"
    assert val("adapter.lora.alpha") == 0.0  # peft's alpha / r is in B: scale 1 is the trained adapter
    names = {t.name for t in r.tensors}
    assert "blk.0.attn_q.weight.lora_a" in names and "blk.0.ffn_down.weight.lora_b" in names
    ranks = {t.name: int(t.shape[1]) for t in r.tensors if t.name.endswith(".lora_a")}  # ggml {in, rank}
    assert ranks["blk.0.attn_q.weight.lora_a"] == 4 and ranks["blk.0.ffn_gate.weight.lora_a"] == 8  # anchor + seed


def test_perplexity_takes_an_adapter_and_refuses_a_wrong_one(adapted, base_run):  # noqa: F811
    d, out = adapted
    r = cli("perplexity", d / "base.gguf", "--run", base_run, "--ctx", 32, "--json", "--lora", out / "lora.gguf")
    assert r.exit_code == 0, r.output
    assert np.isfinite(json.loads(r.output)["overall"]["ppl"])
    r = cli("perplexity", d / "base.gguf", "--run", base_run, "--ctx", 32, "--lora", d / "merged.gguf")
    assert r.exit_code == 1 and "not a LoRA adapter" in r.output and "Traceback" not in r.output, r.output
    r = cli("perplexity", d / "base.gguf", "--run", base_run, "--lora", d / "missing.gguf")
    assert r.exit_code == 1 and "not found" in r.output, r.output


def test_unpaired_tensors_are_refused():
    a = np.zeros((4, 8), np.float32)
    with pytest.raises(MfggufError, match="pairs"):
        check_pairs({"blk.0.attn_q.weight.lora_a": a.shape})
    with pytest.raises(MfggufError, match="ranks differ"):
        check_pairs({"blk.0.attn_q.weight.lora_a": a.shape, "blk.0.attn_q.weight.lora_b": (8, 3)})
