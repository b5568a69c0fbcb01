"""Atomic writes: a full disk is one line naming the file, and the file that was there stays."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from mfgguf.errors import MfggufError
from mfgguf.run.files import atomic_path
from mfgguf.run.safetensors_f32 import save_f32


@pytest.mark.parametrize("err", [OSError(errno.ENOSPC, "No space left on device"),
                                 RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")])
def test_a_full_disk_keeps_the_old_file_and_says_so_in_one_line(tmp_path, err):
    dest = tmp_path / "trunk.safetensors"
    save_f32(dest, {"w": np.ones(3)}, "pt")
    before = dest.read_bytes()
    with pytest.raises(MfggufError) as e:
        with atomic_path(dest) as tmp:
            tmp.write_bytes(b"half")
            raise err
    assert "disk is full" in str(e.value) and str(dest) in str(e.value) and "\n" not in str(e.value)
    assert dest.read_bytes() == before and list(tmp_path.iterdir()) == [dest]


def test_other_errors_pass_through(tmp_path):
    with pytest.raises(ValueError):
        with atomic_path(tmp_path / "x") as tmp:
            raise ValueError("not a disk")
    assert list(tmp_path.iterdir()) == []
