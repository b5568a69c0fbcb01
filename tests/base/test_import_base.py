"""`mfgguf import-base`: foreign base models become a RUN's trunk that computes them exactly.

Foreign files no one here wrote by hand: a small random `LlamaForCausalLM` saved by `transformers`
(tied and untied embeddings, GQA; its tokenizer a real byte-level BPE trained on Python's own
docs), the GGUF llama.cpp's convert_hf_to_gguf.py writes from it, and this project's own dense
trunk GGUF. Parity: llama.cpp's logits of the trunk-alone GGUF assembled from the imported base
against transformers' logits and against llama.cpp's logits of the base file itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from tests.converters import llama_logits, llama_tokenize, reference_logits, synthetic_run, text_sample

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "mfgguf"  # where scripts/hf_reference.py unpacks llama.cpp's converter
TOL = 1e-3  # max |difference| / max |logit|
CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def max_rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    from mfgguf.data.tokenizer import train_tokenizer

    p = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer([text_sample(60_000)] * 2, 400).save(str(p))
    return p


def save_hf_llama(out: Path, tokenizer_json: Path, *, tied: bool, seed: int = 0, dtype: str = "float32") -> Path:
    """A random LlamaForCausalLM (GQA 4/2 heads) saved by transformers in `dtype`, with a tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads(tokenizer_json.read_text())
    n = len(vocab["model"]["vocab"]) + 3  # padded past the tokenizer, as many checkpoints are
    cfg = LlamaConfig(vocab_size=n, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, initializer_range=0.2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # norms away from 1, so a misplaced norm shows
    model.to(getattr(torch, dtype)).save_pretrained(out)
    (out / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
        "add_prefix_space": False, "chat_template": CHAT}))
    return out


def hf_logits(hf: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def converted(hf: Path, out: Path, outtype: str) -> Path:
    """llama.cpp's own convert_hf_to_gguf.py on `hf`, in a child process (skip where it cannot be had)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from hf_reference import convert_code, converter_dir
    finally:
        sys.path.pop(0)
    try:
        conv = converter_dir(CACHE)
    except (SystemExit, OSError) as e:
        pytest.skip(f"llama.cpp's convert_hf_to_gguf.py cannot be had here ({e})")
    r = subprocess.run([sys.executable, "-c", convert_code(conv, hf, out, outtype)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def prepared(src: Path, run: Path, *extra: str) -> Path:
    r = cli("import-base", src, "--out", run, *extra)
    assert r.exit_code == 0, r.output
    r = cli("prepare", "builtin", "--out", run, "--experts", "2", "--max-chars-per-domain", "20000", "--no-progress")
    assert r.exit_code == 0, r.output
    return run


def trunk_gguf(run: Path, out: Path, quant: str = "f32") -> Path:
    r = cli("assemble", run, "-o", out, "--experts", "none", "--quant", quant, "-q")
    assert r.exit_code == 0, r.output
    return out


def tokenizer_keys(path: Path) -> dict:
    import gguf

    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}


def ids_of(tokenizer_json: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).encode(text_sample(600)).ids[:96]


@pytest.mark.parametrize("tied,dtype", [(True, "float32"), (False, "float32"), (False, "bfloat16"), (False, "float16")])
def test_hf_import_computes_transformers_logits_in_llama_cpp(tmp_path, tokenizer_json, tied, dtype):
    hf = save_hf_llama(tmp_path / "hf", tokenizer_json, tied=tied, dtype=dtype)  # transformers reads it back as f32
    run = prepared(hf, tmp_path / "run", "--expert-ff", "32")
    g = trunk_gguf(run, tmp_path / "trunk.gguf")
    ids = ids_of(tokenizer_json)
    ref = hf_logits(hf, ids)
    got = llama_logits(g, ids, 128)
    assert max_rel(got, ref) < TOL, max_rel(got, ref)
    # The import is not a no-op on layout: without the rope permutation of Q/K the logits differ.
    meta = json.loads((run / "modules" / "trunk.json").read_text())
    assert meta["config"]["anchor_ff"] == 128 and meta["config"]["expert_ff"] == 32 and meta["config"]["seed_expert"]
    # The corpus is tokenized with the base's tokenizer, EOS included, and the file carries its chat template.
    info = json.loads((run / "run.json").read_text())
    assert info["eos_id"] == 0 and info["vocab_size"] == ref.shape[1]
    text = text_sample(3000)
    from tokenizers import Tokenizer

    assert llama_tokenize(g, text) == Tokenizer.from_file(str(run / "tokenizer.json")).encode(text).ids
    assert tokenizer_keys(g)["tokenizer.chat_template"] == CHAT
    # mfgguf's own PyTorch model of the imported trunk computes the base too.
    torch_logits, _ = reference_logits(run, g, ids)
    assert max_rel(torch_logits, ref) < TOL, max_rel(torch_logits, ref)


@pytest.mark.parametrize("layout", ["shared-expert", "folded"])
def test_moe_whose_experts_equal_the_seed_computes_the_base(tmp_path, tokenizer_json, layout):
    """Experts initialised from the seed complement the anchor: before training, the MoE is the base."""
    from tests.base.family_cases import seeded_run  # it imports this module: here, not at the top

    hf = save_hf_llama(tmp_path / "hf", tokenizer_json, tied=False, seed=2)
    run, t = seeded_run(tmp_path, hf)
    r = cli("assemble", run, "-o", tmp_path / "moe.gguf", "--quant", "f32", "--router", "uniform", "--layout", layout, "-q")
    assert r.exit_code == 0, r.output
    ids = ids_of(tokenizer_json)
    got, ref = llama_logits(tmp_path / "moe.gguf", ids, 128), hf_logits(hf, ids)
    assert max_rel(got, ref) < TOL, max_rel(got, ref)


@pytest.mark.parametrize("outtype,tied", [("f32", False), ("f32", True), ("f16", False), ("bf16", False), ("q8_0", False)])
def test_converter_gguf_import_matches_the_base_file_in_llama_cpp(tmp_path, tokenizer_json, outtype, tied):
    import gguf

    hf = save_hf_llama(tmp_path / "hf", tokenizer_json, tied=tied, seed=1)
    base = converted(hf, tmp_path / f"base-{outtype}.gguf", outtype)
    run = prepared(base, tmp_path / "run")
    g = trunk_gguf(run, tmp_path / "trunk.gguf", outtype)
    # Dequantized on import, written back in the base's type: every tensor is the base's, bit for bit
    # (a tied base has no output.weight: the trunk's is token_embd's copy).
    mine, theirs = {t.name: t for t in gguf.GGUFReader(g).tensors}, {t.name: t for t in gguf.GGUFReader(base).tensors}
    assert ("output.weight" in theirs) != tied
    if tied:
        theirs["output.weight"] = theirs["token_embd.weight"]
    assert sorted(mine) == sorted(theirs)
    for name, t in mine.items():
        assert t.tensor_type == theirs[name].tensor_type and np.array_equal(t.data, theirs[name].data), name
    ids = ids_of(tokenizer_json)
    ref = llama_logits(base, ids, 128)
    got = llama_logits(g, ids, 128)
    assert max_rel(got, ref) < TOL, max_rel(got, ref)
    assert tokenizer_keys(g) == tokenizer_keys(base)  # every tokenizer key, unchanged
    assert not (run / "tokenizer.json").exists()  # a GGUF-only base: llama.cpp tokenized the corpus
    npy = max((run / "data" / "test").glob("*.npy"), key=lambda p: p.stat().st_size)
    held = np.load(npy)
    first = npy.with_suffix(".txt").read_text()[:600].rsplit(" ", 1)[0]  # up to a word's end
    want = llama_tokenize(base, first)
    assert len(want) > 10 and held[: len(want)].tolist() == want


@pytest.mark.parametrize("post", [None, "ByteLevel"])
def test_hf_import_writes_the_converters_tokenizer_keys(tmp_path, tokenizer_json, post):
    hf = save_hf_llama(tmp_path / "hf", tokenizer_json, tied=True)
    if post:  # GPT-2-style tokenizer.json: the converter then writes add_bos/add_eos false
        tj = json.loads((hf / "tokenizer.json").read_text())
        (hf / "tokenizer.json").write_text(json.dumps({**tj, "post_processor": {
            "type": post, "add_prefix_space": False, "trim_offsets": True, "use_regex": True}}))
    base = converted(hf, tmp_path / "base.gguf", "f32")
    run = prepared(hf, tmp_path / "run")
    assert tokenizer_keys(trunk_gguf(run, tmp_path / "trunk.gguf")) == tokenizer_keys(base)


def test_own_trunk_gguf_round_trips(tmp_path):
    import gguf
    from tokenizers import Tokenizer

    src = synthetic_run(tmp_path / "syn", n_experts=2, max_chars=200_000)
    base = trunk_gguf(src, tmp_path / "base.gguf")
    run = prepared(base, tmp_path / "run", "--expert-ff", "64")
    g = trunk_gguf(run, tmp_path / "trunk.gguf")
    # anchor (units 0..63) + seed (64..127) written as one dense FFN: every tensor is the base's, bit for bit
    a, b = gguf.GGUFReader(g).tensors, gguf.GGUFReader(base).tensors
    assert [t.name for t in a] == [t.name for t in b]
    assert all(np.array_equal(x.data, y.data) for x, y in zip(a, b))

    ids = Tokenizer.from_file(str(src / "tokenizer.json")).encode(text_sample(600)).ids[:96]
    assert max_rel(llama_logits(g, ids, 128), llama_logits(base, ids, 128)) < TOL
    # prepare --force again (other experts): the base and its trunk stay, the file is the same
    r = cli("prepare", "builtin", "--out", run, "--experts", "3", "--max-chars-per-domain", "20000", "--no-progress", "--force")
    assert r.exit_code == 0, r.output
    again = trunk_gguf(run, tmp_path / "again.gguf")
    assert all(np.array_equal(x.data, y.data) for x, y in zip(gguf.GGUFReader(again).tensors, a))
    assert json.loads((run / "run.json").read_text())["n_experts"] == 3
    # the imported trunk is the user's base: train-trunk refuses to replace it unless asked with --restart
    before = (run / "modules" / "trunk.safetensors").read_bytes()
    r = cli("train-trunk", run, "--preset", "tiny", "--no-progress")
    assert r.exit_code == 1 and "imported by `mfgguf import-base`" in r.output and "--restart" in r.output
    assert "Traceback" not in r.output and (run / "modules" / "trunk.safetensors").read_bytes() == before


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, tokenizer_json):
    moe = tmp_path / "moe.gguf"
    src = synthetic_run(tmp_path / "syn", n_experts=2, max_chars=200_000)
    r = cli("assemble", src, "-o", moe, "--quant", "f32", "--router", "uniform", "-q")
    assert r.exit_code == 0, r.output
    hf = save_hf_llama(tmp_path / "hf", tokenizer_json, tied=True)
    (hf / "tokenizer.json").unlink()
    f32 = trunk_gguf(src, tmp_path / "f32.gguf")
    f64 = retyped(f32, tmp_path / "f64.gguf", "blk.0.ffn_down.weight", np.float64)  # a type gguf-py cannot dequantize
    no_eos = retyped(f32, tmp_path / "no-eos.gguf", "", None, drop=("tokenizer.ggml.eos_token_id",))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(f32.read_bytes()[:-1000])

    def variant(name: str, **config) -> Path:
        d = save_hf_llama(tmp_path / name, tokenizer_json, tied=True)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **config}))
        return d

    scaled = variant("scaled", rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None)
    biased = variant("biased", attention_bias=True)
    wide = variant("wide", head_dim=32)
    spm = variant("spm")
    tj = json.loads((spm / "tokenizer.json").read_text())
    (spm / "tokenizer.json").write_text(json.dumps({**tj, "decoder": {"type": "ByteFallback"}}))
    cases = [(moe, "architecture 'granitemoe'"), (f64, "is F64, which gguf-py"), (cut, "damaged or truncated"),
             (no_eos, "names no EOS token"),
             (hf, "no tokenizer.json"),
             (scaled, "rope scaling 'yarn'"), (biased, "attention_bias"), (wide, "head_dim 32"),
             (spm, "not byte-level BPE"), (tmp_path / "nothing", "does not exist")]
    for src_, what in cases:
        r = cli("import-base", src_, "--out", tmp_path / "out")
        assert r.exit_code == 1 and what in r.output and len(r.output.strip().splitlines()) == 1, (what, r.output)
        assert not (tmp_path / "out").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left behind
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("user work")
    base = trunk_gguf(src, tmp_path / "base.gguf")
    r = cli("import-base", base, "--out", taken)
    assert r.exit_code == 1 and "--force" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]


def retyped(src: Path, dst: Path, name: str, dtype, drop: tuple[str, ...] = ()) -> Path:
    """A copy of GGUF `src` whose tensor `name` is stored as numpy `dtype`, without the key-values `drop`."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.get_field("general.architecture").contents())
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture" and key not in drop:
            vt = f.types[0]
            w.add_key_value(key, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        data = np.asarray(t.data).reshape([int(x) for x in reversed(t.shape.tolist())])
        w.add_tensor(t.name, data.astype(dtype) if t.name == name else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_quantized_base_imports_as_the_function_its_file_computes(tmp_path):
    """A q4_0 base (any type gguf-py dequantizes) imports; re-quantized as q4_0 its trunk is the same bytes."""
    import gguf

    src = synthetic_run(tmp_path / "syn", n_experts=1, max_chars=200_000)
    q4 = trunk_gguf(src, tmp_path / "q4.gguf", "q4_0")
    run = tmp_path / "run"
    r = cli("import-base", q4, "--out", run, "--preset", "tiny")
    assert r.exit_code == 0, r.output
    r = cli("prepare", "builtin", "--out", run, "--experts", "1", "--max-chars-per-domain", "20000", "--no-progress")
    assert r.exit_code == 0, r.output
    again = trunk_gguf(run, tmp_path / "again.gguf", "q4_0")
    a = {t.name: t for t in gguf.GGUFReader(q4).tensors}
    b = {t.name: t for t in gguf.GGUFReader(again).tensors}
    assert a.keys() == b.keys() and any(t.tensor_type.name == "Q4_0" for t in a.values())
    assert all(a[k].tensor_type == b[k].tensor_type and np.array_equal(a[k].data, b[k].data) for k in a)


def test_llama3_style_tokenizer_tokenizes_the_same_in_llama_cpp(tmp_path):
    """A Llama-3-style pre-tokenizer (Split regex + ByteLevel) maps to llama.cpp's `llama-bpe`: same ids both ways."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from mfgguf.base.hf_vocab import LLAMA3_REGEX

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text_sample(60_000)] * 2, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tj = tmp_path / "tokenizer.json"
    tok.save(str(tj))
    hf = save_hf_llama(tmp_path / "hf", tj, tied=True)
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>", "bos_token": "<|begin_of_text|>"}))
    run = prepared(hf, tmp_path / "run")
    g = trunk_gguf(run, tmp_path / "trunk.gguf")
    keys = tokenizer_keys(g)
    assert keys["tokenizer.ggml.pre"] == "llama-bpe" and keys["tokenizer.ggml.eos_token_id"] == 1
    assert json.loads((run / "run.json").read_text())["eos_id"] == 1
    text = "Don'T stop: 1234567 dogs' TOYS\r\n\n\t  x=1+2;  ünïcödé 日本語 -- " + text_sample(2000)
    assert llama_tokenize(g, text) == tok.encode(text).ids


def test_a_known_base_not_fetched_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MFGGUF_CACHE", str(tmp_path / "cache"))
    r = cli("import-base", "smollm2", "--out", tmp_path / "run")
    assert r.exit_code == 1 and "`make smollm2`" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "run").exists()
