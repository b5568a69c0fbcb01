"""Where the OS lacks Linux's file calls (os.copy_file_range, os.posix_fadvise, os.posix_fallocate,
os.fdatasync, os.preadv: macOS lacks some), their callers fall back to portable ones with the same bytes.
Each test deletes the calls from `os` for its duration, as on such a system, and checks what was written."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from mfgguf.base.source import pread_exact
from mfgguf.converters.extension.newfile import COPY_BYTES, _copy
from mfgguf.gguf.fileio import allocate, pread_into
from mfgguf.train.engine.offload import ParamStore, Slot, Unit

LINUX_ONLY = ("copy_file_range", "posix_fadvise", "posix_fallocate", "fdatasync", "preadv")


@pytest.fixture
def no_linux_calls(monkeypatch):
    for name in LINUX_ONLY:
        monkeypatch.delattr(os, name, raising=False)
    assert not any(hasattr(os, name) for name in LINUX_ONLY)


def _fd(path, flags=os.O_RDWR | os.O_CREAT):
    return os.open(path, flags, 0o644)


def test_copy_without_copy_file_range(tmp_path, no_linux_calls):
    data = np.random.default_rng(0).integers(0, 256, COPY_BYTES + 12345, dtype=np.uint8).tobytes()
    (tmp_path / "in").write_bytes(data)
    fin, fout = _fd(tmp_path / "in", os.O_RDONLY), _fd(tmp_path / "out")
    try:
        os.pwrite(fout, b"\0" * 7, 0)
        _copy(fin, fout, len(data) - 3, 3, 7)  # more than one chunk, at offsets on both sides
    finally:
        os.close(fin)
        os.close(fout)
    assert (tmp_path / "out").read_bytes() == b"\0" * 7 + data[3:]


def test_allocate_and_read_without_fallocate_or_preadv(tmp_path, no_linux_calls):
    fd = _fd(tmp_path / "f")
    try:
        allocate(fd, 1 << 20)
        assert os.fstat(fd).st_size == 1 << 20
        x = np.arange(1000, dtype=np.float32)
        os.pwrite(fd, x.tobytes(), 4096)
        assert np.array_equal(pread_into(fd, np.empty(1000, np.float32), 4096, "ended"), x)
        assert bytes(pread_exact(fd, 8, 4096, "f")) == x[:2].tobytes()
    finally:
        os.close(fd)


def test_param_store_without_fadvise_or_fdatasync(tmp_path, no_linux_calls):
    slots = (Slot("w", (4, 3), 0), Slot("b", (3,), 12))
    store = ParamStore(tmp_path / "stream", [Unit("blk.0", slots)], drop_cache=True)
    try:
        store.create(lambda s: torch.arange(s.numel, dtype=torch.float32).reshape(s.shape) + s.offset)
        store.write("blk.0", "b", "P", np.full(3, 7, np.float32), slots[1])
        store.commit({"set": "b", "step": 1})
        assert np.array_equal(store.read("blk.0", "a", "P", slots[0]), np.arange(12, dtype=np.float32))
        assert np.array_equal(store.read_rows("blk.0", "a", slots[0], np.array([2])), [[6, 7, 8]])
        assert np.array_equal(store.read("blk.0", "b", "P", slots[1]), [7, 7, 7])
        assert store.state()["step"] == 1
    finally:
        store.close()
