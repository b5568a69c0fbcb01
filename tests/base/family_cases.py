"""The checks every imported model family passes, written once; each family's file brings its model and quirks.

A family's module-scoped fixture is a `case`: (HF directory, llama.cpp's f32 conversion of it,
transformers' logits, token ids), built by `family_case` from the family's own `save_hf_*`. The
helpers below assert what holds for every family (transformers against the imported PyTorch trunk
and against llama.cpp; the GGUF import is the converter's file bit for bit; an MoE whose experts
equal the seed computes the base; experts synced over rounds assemble as their reference computes; a
refusal is one line that writes nothing) and hand back what they built, so that a family's test adds
only the assertions that are its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from tests.base.test_import_base import CHAT, cli, converted, ids_of, max_rel, prepared, trunk_gguf
from tests.converters import llama_logits, reference_logits

Case = tuple[Path, Path, np.ndarray, list[int]]


def save_random(out: Path, tokenizer_json: Path, model_cls, config_cls, *, seed: int, biases: bool = False,
                bos: str | None = None, tokenizer: dict | None = None, **config) -> Path:
    """A random `model_cls` (GQA 4/2 heads, 64 wide, 2 layers), f32, with a tokenizer and chat template.

    Norms (and, with `biases`, biases) are drawn away from their identity values so that a misplaced
    or dropped one shows in the logits; `config` is what the family sets beyond that shared shape."""
    import torch

    vocab = json.loads(tokenizer_json.read_text())
    cfg = config_cls(vocab_size=len(vocab["model"]["vocab"]) + 3, hidden_size=64, intermediate_size=160,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
                     eos_token_id=0, initializer_range=0.2, **config)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif biases and name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": bos,
        **(tokenizer or {}), "chat_template": CHAT}))
    return out


def with_config(hf: Path, **changes) -> Path:
    """`hf` with its config.json changed after saving (what the model class itself would not build)."""
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, **changes}))
    return hf


def hf_logits(hf: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def family_case(d: Path, tokenizer_json: Path, save: Callable[[Path, Path], Path]) -> Case:
    hf = save(d / "hf", tokenizer_json)
    ids = ids_of(tokenizer_json)
    return hf, converted(hf, d / "base.gguf", "f32"), hf_logits(hf, ids), ids


def arch(path: Path) -> str:
    import gguf

    return gguf.GGUFReader(path).get_field("general.architecture").contents()


def computes(run: Path, g: Path, ref: np.ndarray, ids: list[int]) -> np.ndarray:
    """The PyTorch trunk and llama.cpp on `g` both compute `ref`; llama.cpp's logits back."""
    torch_logits, _ = reference_logits(run, g, ids)
    assert max_rel(torch_logits, ref) <= 1e-4, max_rel(torch_logits, ref)
    got = llama_logits(g, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)
    return got


def hf_import_computes(tmp_path: Path, case: Case, trunk_arch: str | None = None) -> tuple[Path, Path]:
    """Imported from the HF directory, the trunk computes transformers' logits; (run, trunk GGUF) back."""
    hf, _, ref, ids = case
    run = prepared(hf, tmp_path / "run", "--expert-ff", "32")
    g = trunk_gguf(run, tmp_path / "trunk.gguf")
    if trunk_arch is not None:
        assert arch(g) == trunk_arch
    computes(run, g, ref, ids)
    return run, g


def gguf_import_matches(tmp_path: Path, case: Case, marker: str, *, tied: bool) -> tuple[Path, np.ndarray]:
    """Imported from the converter's GGUF, the trunk is that file, tensor for tensor and bit for bit (with
    `marker` among them; a tied base has no head, the trunk writes token_embd's copy), and computes
    transformers' logits; (trunk GGUF, llama.cpp's logits) back."""
    import gguf

    _, base, ref, ids = case
    run = prepared(base, tmp_path / "run")
    g = trunk_gguf(run, tmp_path / "trunk.gguf")
    mine, theirs = {t.name: t for t in gguf.GGUFReader(g).tensors}, {t.name: t for t in gguf.GGUFReader(base).tensors}
    if tied:
        theirs.setdefault("output.weight", theirs["token_embd.weight"])
    assert sorted(mine) == sorted(theirs) and marker in mine
    for name, t in mine.items():
        assert t.tensor_type == theirs[name].tensor_type and np.array_equal(t.data, theirs[name].data), name
    return g, computes(run, g, ref, ids)


def seeded_run(tmp_path: Path, hf: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A run of the imported `hf` whose two experts are the seed, untrained; (run, trunk tensors) back."""
    run = prepared(hf, tmp_path / "run", "--expert-ff", "64")
    return run, seed_as_experts(run)


def seed_as_experts(run: Path) -> dict[str, np.ndarray]:
    """Experts 1 and 2 of `run` written as copies of its trunk's seed, untrained (the MoE is then the base); the
    trunk's tensors back."""
    from safetensors.numpy import load_file

    from mfgguf.run import RunDir, write_module

    rd = RunDir(run)
    trunk = json.loads(rd.module_meta(0).read_text())
    t = load_file(str(rd.module_file(0)))
    seed = {f"blk.{l}.ffn_{f}.weight": t[f"blk.{l}.ffn_{f}_seed.weight"] for l in range(2) for f in ("gate", "up", "down")}
    for i in (1, 2):
        write_module(rd, i, seed, {"kind": "expert", "config": trunk["config"], "trunk_sha256": trunk["sha256"]})
    return t


def untrained_moe_computes(tmp_path: Path, case: Case, *flags: str):
    """Experts equal to the seed, assembled with `flags`: before training, llama.cpp's MoE is the base.

    (run, MoE GGUF, trunk tensors, llama.cpp's logits) back."""
    _, _, ref, ids = case
    run, t = seeded_run(tmp_path, case[0])
    moe = tmp_path / "moe.gguf"
    r = cli("assemble", run, "-o", moe, "--quant", "f32", "--router", "uniform", *flags, "-q")
    assert r.exit_code == 0, r.output
    got = llama_logits(moe, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)
    return run, moe, t, got


def one_line(r, what: str) -> None:
    """The CLI refused with exit 1 in one line that says `what`."""
    assert r.exit_code == 1 and what in r.output and len(r.output.strip().splitlines()) == 1, r.output


def import_refused(src: Path, out: Path, what: str) -> None:
    """import-base refuses `src` in one line saying `what`, and writes nothing."""
    one_line(cli("import-base", src, "--out", out), what)
    assert not out.exists()


def synced_moe_computes(tmp_path: Path, case: Case, layout: str,
                        marker: str) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """Two experts with private attention copies over two sync rounds (`train-expert --shared attn --rounds 2`,
    `sync` after each), assembled at f32 in the family's MoE `layout`: llama.cpp computes the reference forward
    of that file (merged trunk + experts, top-2 so that both experts' FFNs count), and the file holds the synced
    trunk: the merged attention, and the family's tensors `--shared attn` leaves out (Qwen2's Q/K/V biases,
    Qwen3's Q/K norms; `marker` among them) as imported. `eval` then reports the run's MoE in that layout beside
    the trunk before and after the syncs. (run, MoE GGUF, the file's tensors) back."""
    import gguf
    from safetensors.numpy import load_file

    from mfgguf.config import ModelConfig, shared_tensor_names
    from mfgguf.run import RunDir

    _, _, ref, ids = case
    run = tmp_path / "run"
    r = cli("import-base", case[0], "--out", run, "--expert-ff", "32", "--preset", "tiny")
    assert r.exit_code == 0, r.output
    # more text than `prepared`'s: every domain's test split needs one 64-token window for eval
    r = cli("prepare", "builtin", "--out", run, "--experts", "2", "--max-chars-per-domain", "150000", "--no-progress")
    assert r.exit_code == 0, r.output
    rd = RunDir(run)
    imported = load_file(str(rd.module_file(0)))
    for _ in range(2):
        for i in (1, 2):
            r = cli("train-expert", run, "--expert", i, "--tokens", 4096, "--eval-tokens", 256, "--shared", "attn",
                    "--rounds", 2, "--no-progress")
            assert r.exit_code == 0, r.output
        r = cli("sync", run)
        assert r.exit_code == 0, r.output
    synced = load_file(str(rd.module_file(0)))
    moe = tmp_path / "moe.gguf"
    r = cli("assemble", run, "-o", moe, "--quant", "f32", "--top-k", "2", "-q")
    assert r.exit_code == 0, r.output
    assert arch(moe) == layout
    got, (want, _) = llama_logits(moe, ids, 128), reference_logits(run, moe, ids)
    assert max_rel(got, want) <= 1e-3 < max_rel(got, ref), (max_rel(got, want), max_rel(got, ref))
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(moe).tensors}
    shared = set(shared_tensor_names(ModelConfig.from_dict(json.loads(rd.module_meta(0).read_text())["config"]), "attn"))
    for name in ("blk.0.attn_q.weight", "blk.1.attn_output.weight", "output_norm.weight"):
        assert name in shared and not np.array_equal(synced[name], imported[name]), name  # the syncs merged something
        assert np.array_equal(tensors[name], synced[name]), name  # and the file holds that merge, not the imported one
    # the seed routed too (`--seed-gate`) in the family's layout: llama.cpp computes the reference of that file, and
    # slot 0 holds the seed (after the anchor's rows where the layout folds the anchor into every slot)
    gated = tmp_path / "gated.gguf"
    r = cli("assemble", run, "-o", gated, "--quant", "f32", "--seed-gate", "0.5", "-q")
    assert r.exit_code == 0, r.output
    got, (want, _) = llama_logits(gated, ids, 128), reference_logits(run, gated, ids)
    assert arch(gated) == layout and max_rel(got, want) <= 1e-3, max_rel(got, want)
    up = {t.name: np.array(t.data) for t in gguf.GGUFReader(gated).tensors}["blk.1.ffn_up_exps.weight"]  # (3, ff, C)
    seed = synced["blk.1.ffn_up_seed.weight"]  # (expert_ff, C)
    assert len(up) == 3 and np.array_equal(up[0][-len(seed):], seed)
    kept = [n for n in imported if n.startswith("blk.") and n not in shared and ".attn_" in n]
    assert marker in kept, kept
    for name in kept:  # what no expert trained a copy of stays the base's
        assert np.array_equal(synced[name], imported[name]) and np.array_equal(tensors[name], imported[name]), name

    out = tmp_path / "eval"
    r = cli("eval", run, "--baselines", "none", "--routers", "ridge", "--top-k", "1", "--quants", "", "--max-tokens",
            512, "--ctx", 64, "--out", out)
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "report.json").read_text())
    best = rep["best"]
    assert best == "moe ridge top-1" and arch(out / "models" / rep["models"][best]["file"]) == layout
    before, after = (rep["results"][k]["overall"]["ppl"] for k in ("trunk as trained (before sync)", "trunk alone"))
    assert np.isfinite(rep["results"][best]["overall"]["ppl"]) and before != after, rep["results"]
    return run, moe, tensors


def extends_as_assembled(tmp_path: Path, hf: Path, moe_arch: str) -> tuple[Path, Path, Path]:
    """Two experts against the imported `hf`, one pooled G (as for experts trained together); the file of expert 1
    extended with expert 2 is byte for byte the file `assemble` writes for both. Returns (run, the file of 1, of both)."""
    run = prepared(hf, tmp_path / "run", "--expert-ff", "32", "--preset", "tiny")
    for e in ("1", "2"):
        r = cli("train-expert", run, "--expert", e, "--no-progress")
        assert r.exit_code == 0, r.output
    r = cli("router-stats", run, "--no-progress")
    assert r.exit_code == 0, r.output
    one, both, ext = (tmp_path / f"{n}.gguf" for n in ("1", "12", "x"))
    for out, ids in ((one, "1"), (both, "1,2")):
        r = cli("assemble", run, "-o", out, "--experts", ids, "--quant", "q8_0", "-q")
        assert r.exit_code == 0, r.output
    r = cli("extend", one, "--add", run, "--experts", "2", "-o", ext)
    assert r.exit_code == 0, r.output
    assert arch(ext) == moe_arch and ext.read_bytes() == both.read_bytes()
    return run, one, both
