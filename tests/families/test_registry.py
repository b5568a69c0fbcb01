"""The families' registry: a family is one file in mfgguf/families/, found without being listed anywhere, and
every architecture a family writes is declared once, with what gguf/schema.py derives from it."""

from __future__ import annotations

import sys

import pytest

import mfgguf.families as families
from mfgguf.errors import MfggufError
from mfgguf.families import archs, by_gguf_arch, family, moe_arch, written_archs
from mfgguf.gguf import schema


def test_every_written_architecture_is_declared_once():
    declared = archs()
    assert set(written_archs()) == set(declared)
    for name in ("llama", "qwen2", "qwen3"):
        f = family(name)
        assert f.gguf_arch in declared
        assert all(a in declared for a in f.moe_layouts.values())
    # the schema's tables are the declarations, read back
    assert schema.ARCH_ROPE == {"llama": "normal", "granitemoe": "normal", "qwen2": "neox", "qwen2moe": "neox",
                                "qwen3": "neox", "qwen3moe": "neox"}
    assert schema.SHEXP_GATED == ("qwen2moe",) and schema.UNNORMALISED_TOPK == ("qwen2moe",)
    assert set(schema.SHARED_EXPERT_ARCHS) == {"granitemoe", "qwen2moe"}
    assert schema.MOE_KEYS["qwen3moe"] == (("expert_feed_forward_length", "UINT32", "ff"),)


TOY = '''
from mfgguf.families.family import Arch, Family

FAMILY = Family(name="toy", gguf_arch="toy", hf_archs=("ToyForCausalLM",), rope="neox",
                moe_layouts={"shared-expert": "toymoe"},
                archs=(Arch("toy", rope="neox"), Arch("toymoe", rope="neox", shared_expert=True)),
                extras={"attn_q.bias": "q"})
'''


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    (tmp_path / "toy.py").write_text(TOY)
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    families._registry.cache_clear()
    families.archs.cache_clear()
    yield
    sys.modules.pop("mfgguf.families.toy", None)
    families._registry.cache_clear()
    families.archs.cache_clear()


def test_a_new_family_is_one_file(toy_family):
    f = family("toy")
    assert by_gguf_arch("toy") is f and families.by_hf_arch(["ToyForCausalLM"]) is f
    assert moe_arch(f, "shared-expert") == "toymoe" and archs()["toymoe"].shared_expert
    assert moe_arch(f, "granitemoe") == "toymoe"  # the layout's earlier name is still accepted
    assert "toymoe" in written_archs()
    assert families.block_extras(f, n_heads=4, n_kv_heads=2, head_dim=8) == {"attn_q.bias": (32,)}
    assert next(iter(families._registry())) == "llama"  # still the default family, whatever the file names


def test_an_architecture_declared_twice_is_caught(tmp_path, monkeypatch, toy_family):
    (tmp_path / "toy.py").write_text(TOY.replace('Arch("toy", rope="neox")', 'Arch("qwen2", rope="neox")'))
    sys.modules.pop("mfgguf.families.toy", None)
    families._registry.cache_clear()
    families.archs.cache_clear()
    with pytest.raises(AssertionError, match="qwen2 is declared twice"):
        archs()


def test_unknown_family_is_one_line():
    with pytest.raises(MfggufError, match="unknown model family 'gpt2'; mfgguf knows llama, qwen2, qwen3"):
        family("gpt2")
