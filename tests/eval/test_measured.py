"""Stored measurements: reused for the same bytes under the same settings, measured again otherwise."""

from __future__ import annotations

import os

from mfgguf.eval.measured import kept


def test_a_model_rebuilt_to_the_same_bytes_is_not_scored_again(tmp_path):
    model = tmp_path / "moe-f16.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    calls = []

    def measure():
        calls.append(1)
        return {"ppl": 3.0 + len(calls)}

    settings = {"split": "validation", "max_tokens": 16384}
    assert kept(tmp_path, model, settings, measure) == {"ppl": 4.0}
    assert kept(tmp_path, model, settings, measure) == {"ppl": 4.0} and len(calls) == 1
    # assembled again from the same modules: a new mtime, the same bytes
    st = model.stat()
    model.write_bytes(model.read_bytes())
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert kept(tmp_path, model, settings, measure) == {"ppl": 4.0} and len(calls) == 1
    # another setting, or other bytes of the same size: measured again
    assert kept(tmp_path, model, {**settings, "max_tokens": 8192}, measure) == {"ppl": 5.0}
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    model.write_bytes(bytes(data))
    assert kept(tmp_path, model, {**settings, "max_tokens": 8192}, measure) == {"ppl": 6.0} and len(calls) == 3
    assert kept(tmp_path, model, settings, measure, force=True) == {"ppl": 7.0}
