"""The quantizer: ggml's bytes (== gguf-py's where gguf-py can quantize), known errors, threads, fallback."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from mfgguf.converters import quant as Q
from mfgguf.gguf import schema
from mfgguf.errors import MfggufError


def _fixed() -> np.ndarray:  # (64, 256) deterministic, varied magnitudes
    i = np.arange(64 * 256, dtype=np.float32)
    return (np.sin(i * 0.37) * np.linspace(0.1, 3, i.size, dtype=np.float32)).reshape(64, 256)


def _weights(rows=128, cols=512, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32) * 0.05


def test_uses_ggml_quantizer():
    assert Q.backend() == "ggml", "libggml-base from llama-cpp-python should load"


def test_q8_0_golden_bytes():
    # one block of 0..31: scale d = 31/127 as f16 (0x33d0, little-endian), then round(i / d) as int8
    b = Q.quantize(np.arange(32, dtype=np.float32).reshape(1, 32), "q8_0").tobytes()
    assert b.hex() == "d0330004080c1014191d2125292d3135393d42464a4e52565a5e62666b6f73777b7f"
    golden = {
        "q8_0": "74f07e5879ac40467e57a9ca932c1b28bfb686ff759aa1acb7139cd01c712fcd",
        "q4_0": "479f58ca49a88ac6313660995674618ea68fe20ce81026238260b70749a4c0c9",
        "q4_k": "cd819b7fa60ad3acf6046de01aa69b61d3f7b12084c273f07e8607c9815f70dc",
        "q6_k": "95a2b14b66b09eb1926a803c47009fde701263b28067e7f8fdbb1bbb90c27afb",
    }
    for t, h in golden.items():
        assert hashlib.sha256(Q.quantize(_fixed(), t).tobytes()).hexdigest() == h, t


@pytest.mark.parametrize("t", ["q8_0", "q4_0", "q5_0", "q5_1", "bf16"])
def test_bytes_equal_gguf_py(t):
    x = _weights()
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType[t.upper()]).reshape(-1).view(np.uint8)
    assert np.array_equal(Q.quantize(x, t), ref)


# mean |error| / mean |x| for Gaussian weights; bounds ~1.5x what these block formats achieve
MAX_REL_ERR = {"f32": 0.0, "f16": 5e-4, "bf16": 3e-3, "q8_0": 1e-2, "q6_k": 3e-2, "q5_k": 6e-2, "q5_0": 7e-2,
               "q5_1": 6e-2, "q4_k": 0.12, "q4_0": 0.14}


@pytest.mark.parametrize("t", list(MAX_REL_ERR))
def test_every_type_dequantizes_within_known_error(t):
    x = _weights()
    b = Q.quantize(x, t)
    assert b.nbytes == schema.tensor_nbytes(x.shape, t)
    y = Q.dequantize(b, t, x.shape)
    err = np.abs(y - x).mean() / np.abs(x).mean()
    assert err <= MAX_REL_ERR[t], (t, err)
    if t != "f32":
        assert err > 0  # really quantized


def test_threads_give_identical_bytes():
    x = _weights(rows=512, cols=256)
    for t in ("q8_0", "q4_k", "q6_k"):
        assert np.array_equal(Q.quantize(x, t, threads=1), Q.quantize(x, t, threads=4))


def test_row_chunks_concatenate():
    x = _weights(rows=100, cols=256)
    for t in ("q4_0", "q5_k"):
        assert np.array_equal(Q.quantize(x, t), np.concatenate([Q.quantize(x[:37], t), Q.quantize(x[37:], t)]))


def test_bad_row_length_raises():
    with pytest.raises(MfggufError, match="not a multiple"):
        Q.quantize(np.zeros((2, 64), np.float32), "q4_k")


def test_schema_table_matches_gguf_py():
    for name, qt in schema.QTYPES.items():
        g = gguf.GGMLQuantizationType[name.upper()]
        assert qt.ggml == int(g)
        assert (qt.block, qt.type_size) == gguf.GGML_QUANT_SIZES[g]


def test_numpy_fallback_same_bytes(tmp_path):
    x = _weights()
    np.save(tmp_path / "x.npy", x)
    code = (
        "import numpy as np, sys; from mfgguf.converters import quant as Q;"
        f"x = np.load({str(tmp_path / 'x.npy')!r});"
        "assert Q.backend() == 'gguf-py';"
        f"np.save({str(tmp_path / 'q.npy')!r}, Q.quantize(x, 'q8_0'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "MFGGUF_NO_GGML": "1"})
    assert np.array_equal(np.load(tmp_path / "q.npy"), Q.quantize(x, "q8_0"))


def test_type_rules():
    assert schema.tensor_type("blk.0.ffn_norm.weight", (256,), "q4_k")[0] == "f32"
    assert schema.tensor_type("blk.0.ffn_gate_inp.weight", (8, 256), "q4_0")[0] == "f32"
    assert schema.tensor_type("output.weight", (512, 256), "q4_k")[0] == "q6_k"
    assert schema.tensor_type("output.weight", (512, 256), "q8_0")[0] == "q8_0"
    assert schema.tensor_type("blk.0.attn_q.weight", (256, 256), "q5_k") == ("q5_k", None)
    t, why = schema.tensor_type("blk.0.attn_q.weight", (64, 64), "q4_k")
    assert t == "q5_0" and "64" in why
    assert schema.tensor_type("blk.0.attn_q.weight", (64, 48), "q6_k")[0] == "f16"  # 48 % 32 != 0


@pytest.mark.skipif(not __import__("mfgguf.converters.fastquant", fromlist=["x"]).available(),
                    reason="libggml-cpu not loadable")
def test_fast_q8_0_is_the_same_format_within_one_step():
    """ggml-cpu's vectorised q8_0: same block scales as the reference, a quant differs by at most one step, rarely."""
    x = np.random.default_rng(1).standard_normal((512, 1024), dtype=np.float32) * 0.02
    ref, fast = Q.quantize(x, "q8_0"), Q.quantize(x, "q8_0", fast=True)
    assert fast.shape == ref.shape
    blocks_r, blocks_f = ref.reshape(-1, 34), fast.reshape(-1, 34)
    assert np.array_equal(blocks_r[:, :2], blocks_f[:, :2])  # fp16 scales
    dq = blocks_r[:, 2:].view(np.int8).astype(int) - blocks_f[:, 2:].view(np.int8).astype(int)
    assert np.abs(dq).max() <= 1 and np.count_nonzero(dq) <= 1e-4 * dq.size
    np.testing.assert_allclose(Q.dequantize(fast, "q8_0", x.shape), x, atol=float(np.abs(x).max()) / 127)
    y = np.random.default_rng(2).standard_normal((64, 256), dtype=np.float32)
    assert np.array_equal(Q.quantize(y, "q4_k", fast=True), Q.quantize(y, "q4_k"))  # other types: unaffected
