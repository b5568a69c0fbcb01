"""`export-hf` on every layout mfgguf writes: transformers loads the directory and computes llama.cpp's logits.

Each layout is assembled at f32 from a tiny MoE with distinct random experts and top-2 routing (so the
router's choice, the top-k weights and each expert's place all count): granitemoe and mixtral from a
synthetic llama RUN, qwen2moe and qwen3moe from a random Qwen2 / Qwen3 (Qwen3 with a head wider than
dim / n_heads) imported and given random experts. `AutoModelForCausalLM.from_pretrained` loads the
export; its logits on real prose are llama.cpp's on the GGUF within TOL of the largest logit, and the
exported tokenizer tokenizes as llama.cpp does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mfgguf.converters.hf.export import export_hf
from tests.base.test_import_base import tokenizer_json  # noqa: F401
from tests.base.test_import_qwen2 import save_hf_qwen2
from tests.base.test_import_qwen3 import save_hf_qwen3
from tests.converters import llama_logits, llama_tokenize, synthetic_run, text_sample
from tests.converters.hf import TOL, assembled, family_run, hf_ids, hf_logits, max_rel

N = 64  # tokens compared: the tiny preset's context
CASES = {  # the file's kind, by architecture (mixtral: llama with experts, the folded layout): (RUN fixture, flags, class)
    "granitemoe": ("llama_run", ("--top-k", "2"), "GraniteMoeSharedForCausalLM"),
    "mixtral": ("llama_run", ("--layout", "folded", "--top-k", "2"), "MixtralForCausalLM"),
    "qwen2moe": ("qwen2_run", ("--router", "random", "--top-k", "2"), "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_run", ("--router", "random", "--top-k", "2"), "Qwen3MoeForCausalLM"),
}
HARD_TEXT = "\n\tdef f(x):\n        return x ** 2  # ünïcödé, 日本語 😀 12345 it's 3.14\n"


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Path:
    return synthetic_run(tmp_path_factory.mktemp("llama") / "run", preset="tiny", n_experts=3, vocab=512)


@pytest.fixture(scope="module")
def qwen2_run(tmp_path_factory, tokenizer_json) -> Path:  # noqa: F811
    return family_run(tmp_path_factory.mktemp("qwen2"), tokenizer_json, save_hf_qwen2)


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory, tokenizer_json) -> Path:  # noqa: F811
    return family_run(tmp_path_factory.mktemp("qwen3"), tokenizer_json, save_hf_qwen3)


@pytest.fixture(scope="module")
def exported(request, tmp_path_factory):
    """{layout: (GGUF, HF directory)}, each assembled and exported once for the module."""
    out = {}

    def get(layout: str) -> tuple[Path, Path]:
        if layout not in out:
            fixture, flags, _ = CASES[layout]
            d = tmp_path_factory.mktemp(layout)
            g = assembled(request.getfixturevalue(fixture), d / "model.gguf", *flags)
            export_hf(g, d / "hf")
            out[layout] = (g, d / "hf")
        return out[layout]

    return get


@pytest.mark.parametrize("layout", list(CASES))
def test_transformers_computes_llama_cpp_logits(exported, layout):
    g, hf = exported(layout)
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == [CASES[layout][2]] and cfg["num_experts_per_tok"] == 2
    ids = hf_ids(hf, N)
    assert len(ids) == N
    got, want = hf_logits(hf, ids), llama_logits(g, ids, N)
    assert got.shape == want.shape
    assert max_rel(got, want) <= TOL, max_rel(got, want)


@pytest.mark.parametrize("layout", ["granitemoe", "qwen2moe"])
def test_exported_tokenizer_is_llama_cpps(exported, layout):
    from transformers import AutoTokenizer

    g, hf = exported(layout)
    tok = AutoTokenizer.from_pretrained(hf)
    text = text_sample(8000) + HARD_TEXT
    assert tok(text, add_special_tokens=False)["input_ids"] == llama_tokenize(g, text)
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_is_the_files(exported):
    """mfgguf's role-prefixed template (schema.CHAT_TEMPLATE) comes with the tokenizer and renders the same."""
    from transformers import AutoTokenizer

    _, hf = exported("granitemoe")
    tok = AutoTokenizer.from_pretrained(hf)
    text = tok.apply_chat_template([{"role": "user", "content": " hello "}], tokenize=False, add_generation_prompt=True)
    assert text == "User: hello\n\nAssistant:"


def test_top_k_weighting_counts(exported, tmp_path):
    """The parity is not blind to routing: qwen2moe's unnormalised top-k weights, renormalised, no longer match."""
    import shutil

    g, hf = exported("qwen2moe")
    wrong = tmp_path / "hf"
    shutil.copytree(hf, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": True}))
    ids = hf_ids(hf, N)
    assert max_rel(hf_logits(wrong, ids), llama_logits(g, ids, N)) > 10 * TOL


def test_shards_and_bf16(exported, tmp_path):
    """Several shards with their index load as one; bf16 rounds the weights (close to, not equal to, f32)."""
    g, hf = exported("granitemoe")
    ids = hf_ids(hf, N)
    ref = hf_logits(hf, ids)
    r = export_hf(g, tmp_path / "sharded", max_shard_gb=0.0003)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert r["shards"] > 2 and len(set(index["weight_map"].values())) == r["shards"]
    assert np.array_equal(hf_logits(tmp_path / "sharded", ids), ref)
    r = export_hf(g, tmp_path / "bf16", dtype="bf16")
    assert r["bytes"] * 2 == export_hf(g, tmp_path / "f32")["bytes"]
    err = max_rel(hf_logits(tmp_path / "bf16", ids), ref)
    assert 0 < err < 0.05, err


def test_qwen2_trunk_in_the_mixtral_layout_is_refused(qwen2_run, tmp_path):
    """llama with Q/K/V biases: no transformers class computes it, and the line says which layout exports."""
    from mfgguf.errors import MfggufError

    g = assembled(qwen2_run, tmp_path / "m.gguf", "--layout", "folded", "--router", "random")
    with pytest.raises(MfggufError, match="assemble it with --layout shared-expert"):
        export_hf(g, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.fixture(scope="module")
def llama3_run(tmp_path_factory, tokenizer_json) -> Path:  # noqa: F811
    """A random Llama-3-shaped base with llama3 rope scaling, imported and made into a one-expert MoE."""
    from tests.base.test_import_llama3 import save_hf_llama3

    return family_run(tmp_path_factory.mktemp("llama3"), tokenizer_json, save_hf_llama3, n_experts=1)


@pytest.mark.parametrize("layout,cls", [("shared-expert", "GraniteMoeSharedForCausalLM"), ("folded", "MixtralForCausalLM")])
def test_a_llama3_based_moe_exports_its_rope_scaling_and_computes_llama_cpps_logits(llama3_run, tmp_path, layout, cls):
    """The file's rope_freqs factors become the config's llama3 rope parameters (those the base was made with), and
    transformers' logits are llama.cpp's within TOL; without the scaling they would not be."""
    from tests.base.test_import_llama3 import ROPE

    g = assembled(llama3_run, tmp_path / "m.gguf", "--layout", layout, "--router", "random")
    export_hf(g, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == [cls]
    rope = cfg["rope_parameters"]
    assert rope["rope_type"] == "llama3" and rope["factor"] == ROPE["factor"]
    assert rope["low_freq_factor"] / rope["high_freq_factor"] == pytest.approx(ROPE["low_freq_factor"] / ROPE["high_freq_factor"])
    ids = hf_ids(tmp_path / "hf", N)
    want = llama_logits(g, ids, N)
    err = max_rel(hf_logits(tmp_path / "hf", ids), want)
    print(f"{layout}: max |transformers - llama.cpp| / max |logit| {err:.2e}")
    assert err <= TOL
    plain = tmp_path / "plain"
    import shutil

    shutil.copytree(tmp_path / "hf", plain)
    (plain / "config.json").write_text(json.dumps({**{k: v for k, v in cfg.items() if k != "rope_scaling"},
                                                   "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"]}}))
    off = max_rel(hf_logits(plain, ids), want)
    print(f"{layout}: without the rope scaling {off:.2e}")
    assert off > 10 * TOL  # the scaling is what makes them agree
