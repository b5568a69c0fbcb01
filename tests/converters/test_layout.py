"""Layout from metadata: header bytes as gguf-py writes them, offsets, expert slices, shapes vs the model."""

from __future__ import annotations

import io

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from mfgguf.converters.plan import layout as LY
from mfgguf.modules import module as MF
from mfgguf.converters import quant as Q
from mfgguf.converters.assemble import assemble
from mfgguf.run import RunDir

from . import synthetic_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return synthetic_run(tmp_path_factory.mktemp("syn") / "run", preset="tiny", n_experts=3, vocab=400)


def _writer_bytes(p: LY.Plan) -> bytes:
    """The same key-values and tensor infos written by gguf-py's GGUFWriter."""
    buf = io.BytesIO()
    w = gguf.GGUFWriter(None, p.arch)
    for key, vt, v in p.kv:
        if key == "general.architecture":
            continue  # GGUFWriter adds it itself, first
        if vt == "ARRAY":
            w.add_key_value(key, v[1], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType[v[0]])
        else:
            w.add_key_value(key, v, gguf.GGUFValueType[vt])
    for s in p.slots:
        w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.nbytes, raw_dtype=gguf.GGMLQuantizationType[s.qtype.upper()])
    w.fout = [buf]
    from gguf.gguf_writer import WriterState

    w.state = WriterState.EMPTY
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    return buf.getvalue()


@pytest.mark.parametrize("layout,quant,experts", [("shared-expert", "q8_0", None), ("folded", "q4_k", None),
                                                  ("shared-expert", "f16", [])])
def test_header_bytes_equal_gguf_writer(run, layout, quant, experts):
    p = LY.plan(RunDir(run), quant=quant, top_k=1, router="ridge", layout=layout, experts=experts)
    ref = _writer_bytes(p)
    assert p.header == ref
    assert (p.stats is not None) == (experts is None)  # the router statistics: a block after the tensor data
    assert p.data_offset % 32 == 0 and 0 <= p.data_offset - len(ref) < 32  # tensor data starts aligned


@pytest.mark.parametrize("old,new", [("granitemoe", "shared-expert"), ("mixtral", "folded")])
def test_a_layout_by_its_earlier_name_is_planned_and_recorded_under_its_name(run, old, new):
    p = LY.plan(RunDir(run), quant="q8_0", top_k=1, router="ridge", layout=old, experts=None)
    assert p.layout == new and ("mfgguf.layout", "STRING", new) in p.kv


def test_offsets_aligned_disjoint_and_expert_slices(run):
    p = LY.plan(RunDir(run), quant="q8_0", top_k=2, router="ridge", layout="shared-expert", experts=[3, 1])
    end = 0
    for s in p.slots:
        assert s.offset % 32 == 0 and s.offset >= end
        end = s.offset + s.nbytes
        if s.n_expert:
            assert s.n_expert == 2 and s.expert_bytes * 2 == s.nbytes
            assert s.expert_bytes == s.row_bytes * s.shape[1]
    assert p.stats.offset == p.data_offset + (end + 31) // 32 * 32  # the router statistics follow the tensor data
    assert p.total_size == p.stats.end == p.stats.offset + 4 * 2 * 64 * (2 + 64)  # 2 experts' means, one G (2 layers)
    assert p.experts == [3, 1]


def test_expert_bytes_at_offset_plus_slot_times_expert_bytes(run, tmp_path):
    out = tmp_path / "m.gguf"
    assemble(run, out, quant="q8_0", experts=[3, 1], progress=False)
    p = LY.plan(RunDir(run), quant="q8_0", top_k=1, router="ridge", layout="shared-expert", experts=[3, 1])
    data = out.read_bytes()
    for slot, i in enumerate([3, 1]):
        w = load_file(str(RunDir(run).module_file(i)))
        s = p.slot("blk.1.ffn_down_exps.weight")
        a = p.data_offset + s.offset + slot * s.expert_bytes
        assert data[a:a + s.expert_bytes] == Q.quantize(w["blk.1.ffn_down.weight"], "q8_0").tobytes()
    t = p.slot("token_embd.weight")
    emb = load_file(str(RunDir(run).module_file(0)))["token_embd.weight"]
    assert data[p.data_offset + t.offset:][: t.nbytes] == Q.quantize(emb, "q8_0").tobytes()


def test_trunk_shapes_match_model(run):
    from mfgguf.config import get_preset
    from mfgguf.model import expert_shapes, trunk_shapes

    for name in ("tiny", "small", "1b"):
        cfg = get_preset(name).model
        assert MF.trunk_shapes(cfg) == trunk_shapes(cfg)
        assert {k: v for k, v in MF.expert_shapes(cfg, False).items()} == expert_shapes(cfg)


def test_kq_fallback_recorded_for_tiny_rows(run):
    p = LY.plan(RunDir(run), quant="q4_k", top_k=1, router="ridge", layout="shared-expert", experts=None)
    s = p.slot("blk.0.attn_q.weight")  # rows of 64: not a multiple of 256
    assert s.qtype == "q5_0" and "64" in s.why
    assert p.slot("output.weight").qtype == "q8_0"  # q6_k wanted, 64-long rows -> q8_0


def test_verify_reads_back_with_both_parsers_and_catches_a_mismatch(run, tmp_path, monkeypatch):
    from mfgguf.converters.readback import read_back, verify

    out = tmp_path / "m.gguf"
    assemble(run, out, quant="q4_k", progress=False)
    p = LY.plan(RunDir(run), quant="q4_k", top_k=1, router="ridge", layout="shared-expert", experts=None)
    verify(p, out)
    a = read_back(out)
    monkeypatch.setenv("MFGGUF_VERIFY", "gguf-py")
    assert read_back(out) == a
    p.slots[3].qtype = "q8_0"  # a layout the file does not have
    with pytest.raises(AssertionError, match=p.slots[3].name):
        verify(p, out)
