"""mfgguf's files in llama.cpp's own programs: llama-cli, llama-server, llama-perplexity, llama-quantize, llama-imatrix.

Every layout mfgguf writes, on the tiny MoEs the export tests build (granitemoe and mixtral from a synthetic
llama RUN, qwen2moe and qwen3moe from a random Qwen2 / Qwen3 imported and given experts; top-2, f32): llama-cli
answers one turn; llama-server renders the file's own chat template and its greedy chat reply is
llama-cpp-python's on that prompt; llama-perplexity scores the windows `mfgguf perplexity` scores to the same
figure; llama-quantize's Q4_K_M of the file runs in mfgguf's runtime with logits near the original's (with
the K-quants themselves on a MoE whose rows are 256 wide); llama-imatrix collects the experts' activations
and llama-quantize uses them. And an adapter from `train-base --mode lora` in
llama-server: its per-request `lora` scale gives the next-token log-probabilities llama-cpp-python gives at that
scale. The programs come from `make llama-tools`; without them every test here skips saying so.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.base.test_import_base import tokenizer_json  # noqa: F401  (a fixture)
from tests.converters import synthetic_run, text_sample
from tests.converters.hf import assembled
from tests.converters.hf.test_export import CASES, llama_run, qwen2_run, qwen3_run  # noqa: F401  (fixtures)
from tests.runtime.llama_tools import repack_flags, run, server, tool
from tests.train.whole.test_lora_adapter import adapted, base_run  # noqa: F401  (fixtures)

LAYOUTS = list(CASES)
CTX = 64  # the tiny preset's trained context: perplexity's window, imatrix's chunk
CHAT = [{"role": "user", "content": "What is a list?"}]
REPLY = 8  # tokens generated where a reply is compared


@pytest.fixture(scope="module", autouse=True)
def programs():
    """Skip the module, before any model is built, when the programs are not there."""
    for name in ("llama-cli", "llama-server", "llama-perplexity", "llama-quantize", "llama-imatrix"):
        tool(name)


@pytest.fixture(scope="module")
def moe(request, tmp_path_factory):
    """{layout: its f32 GGUF}, each assembled once for the module."""
    out = {}

    def get(layout: str) -> Path:
        if layout not in out:
            fixture, flags, _ = CASES[layout]
            out[layout] = assembled(request.getfixturevalue(fixture), tmp_path_factory.mktemp(layout) / "moe.gguf",
                                    *flags)
        return out[layout]

    return get


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """Real prose, long enough for several windows of CTX tokens in every tokenizer here."""
    p = tmp_path_factory.mktemp("text") / "prose.txt"
    p.write_text(text_sample(6000))
    return p


def _llm(gguf: Path, **kw):
    from llama_cpp import Llama

    from mfgguf.runtime import repack

    repack.apply()  # the policy llama-server gets through repack_flags
    return Llama(str(gguf), n_ctx=kw.pop("n_ctx", CTX), n_threads=1, n_threads_batch=1, verbose=False, seed=0, **kw)


def _rendered(gguf: Path) -> str:
    """The file's own chat template rendered for CHAT, by jinja2 (as transformers renders it)."""
    import jinja2

    from mfgguf.runtime.llm import read_header

    tpl = read_header(gguf)["chat_template"]
    assert tpl, f"{gguf} carries no chat template"
    return jinja2.Environment().from_string(tpl).render(messages=CHAT, add_generation_prompt=True)


def _greedy(gguf: Path, prompt: str) -> tuple[bytes, int]:
    """llama-cpp-python's greedy continuation of PROMPT (at most REPLY tokens, up to end-of-text) as bytes (a
    random tiny model emits pieces of UTF-8 characters too), and the prompt's token count."""
    import llama_cpp

    llm = _llm(gguf)
    try:
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        out = []
        for t in llm.generate(ids, temp=0.0):
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t) or len(out) == REPLY:
                break
            out.append(t)
        return llm.detokenize(out), len(ids)
    finally:
        llm.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_cli_answers_one_turn(moe, layout):
    g = moe(layout)
    p = run("llama-cli", "-m", g, "-p", CHAT[0]["content"], "-st", "-n", REPLY, "--temp", 0, "-c", CTX, "-t", 1,
            "--simple-io", "--no-warmup", *repack_flags(), timeout=60)
    reply = _greedy(g, _rendered(g))[0].decode("utf-8", "replace").strip()
    assert reply and f"> {CHAT[0]['content']}\n{reply}" in p.stdout, (reply, p.stdout[-2000:])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_server_chats_with_the_files_template(moe, layout):
    g = moe(layout)
    prompt = _rendered(g)
    reply, n_prompt = _greedy(g, prompt)
    body = {"messages": CHAT, "max_tokens": REPLY, "temperature": 0, "logprobs": True}
    with server(g, "-c", CTX, "-np", 1) as base, httpx.Client(base_url=base, timeout=60) as http:
        assert http.post("/apply-template", json={"messages": CHAT}).json()["prompt"] == prompt
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    c = r.json()
    assert c["choices"][0]["message"]["role"] == "assistant"
    assert c["usage"]["prompt_tokens"] == n_prompt  # the prompt is the template's rendering, tokenized
    assert bytes(b for t in c["choices"][0]["logprobs"]["content"] for b in t["bytes"]) == reply


def _llama_perplexity(g: Path, text: Path) -> tuple[float, int]:
    """llama-perplexity's final figure and its number of chunks (windows).

    This llama.cpp writes its log from a thread that nothing waits for at exit, so on a busy machine the last
    lines are lost at times (exit status 0): a run that lost them is run again."""
    for _ in range(5):
        p = run("llama-perplexity", "-m", g, "-f", text, "-c", CTX, "-t", 1, *repack_flags())
        ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", p.stdout + p.stderr)
        chunks = re.search(r"perplexity over (\d+) chunks", p.stdout + p.stderr)
        if ppl and chunks:
            return float(ppl.group(1)), int(chunks.group(1))
    pytest.fail(f"llama-perplexity printed no final estimate in 5 runs:\n{p.stderr[-2000:]}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mfgguf_perplexity_is_llama_perplexitys(moe, text, layout):
    from mfgguf.runtime.perplexity import perplexity_files

    g = moe(layout)
    theirs, chunks = _llama_perplexity(g, text)
    ours = perplexity_files(g, data=[text], ctx=CTX, threads=1, progress=False)["overall"]  # `mfgguf perplexity`
    assert ours["n_windows"] == chunks and chunks >= 4
    assert abs(ours["ppl"] / theirs - 1) <= 1e-3, (ours["ppl"], theirs)


def _file_type(gguf: Path) -> int:
    from gguf import GGUFReader

    f = GGUFReader(str(gguf)).fields["general.file_type"]
    return int(f.parts[f.data[0]][0])


def _quantized_runs(g: Path, q: Path) -> dict[str, str]:
    """llama-quantize G to Q4_K_M as Q; check mfgguf's runtime generates with it and its logits stay near G's.
    Returns {tensor name: type} of Q."""
    from gguf import GGUFReader

    from mfgguf.runtime.generate import generate
    from mfgguf.runtime.llm import loaded
    from tests.converters import llama_logits, llama_tokenize

    run("llama-quantize", g, q, "q4_k_m", 1)
    assert _file_type(q) == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    with loaded(q, threads=1) as llm:  # mfgguf's own runtime: its header checks, then llama-cpp-python
        assert generate(llm, "The", max_tokens=REPLY, temperature=0.0)
    ids = llama_tokenize(g, text_sample(2000))[:CTX]
    want, got = llama_logits(g, ids, CTX), llama_logits(q, ids, CTX)  # (T, V) each
    # 4-bit noise on these random weights moves the logits by a quarter of their mean size at most, and leaves
    # most top tokens in place; a misread tensor moves them by more than their whole size
    assert np.abs(got - want).mean() / np.abs(want).mean() < 0.5
    assert (got.argmax(1) == want.argmax(1)).mean() > 0.4
    return {t.name: t.tensor_type.name for t in GGUFReader(str(q)).tensors}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_quantize_output_runs(moe, layout, tmp_path):
    types = _quantized_runs(moe(layout), tmp_path / "q4_k_m.gguf")
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"  # the router is never quantized
    experts = [t for n, t in types.items() if "_exps." in n]
    assert len(experts) == 6 and "F32" not in experts, types  # rows of 64: the K-quants fall back to Q5_0 / Q8_0


def test_llama_quantize_k_quants_of_experts(tmp_path):
    """Rows of 256, so Q4_K_M's own K-quants (Q4_K, Q6_K) are what the experts get."""
    run_dir = synthetic_run(tmp_path / "run", preset="tiny", n_experts=3, vocab=512, dim=256, anchor_ff=256,
                            expert_ff=256)
    g = assembled(run_dir, tmp_path / "moe.gguf", "--top-k", "2")
    types = _quantized_runs(g, tmp_path / "q4_k_m.gguf")
    assert {t for n, t in types.items() if "_exps." in n} <= {"Q4_K", "Q6_K"}
    assert types["blk.0.ffn_up_exps.weight"] == "Q4_K"


@pytest.mark.parametrize("layout", ["granitemoe", "qwen2moe"])
def test_llama_imatrix_on_a_moe(moe, text, layout, tmp_path):
    from gguf import GGUFReader

    g, im = moe(layout), tmp_path / "imatrix.gguf"
    run("llama-imatrix", "-m", g, "-f", text, "-c", CTX, "-t", 1, "-o", im, "--no-ppl", *repack_flags())
    names = {t.name for t in GGUFReader(str(im)).tensors}
    assert {"blk.0.ffn_up_exps.weight.in_sum2", "blk.0.ffn_down_exps.weight.counts"} <= names, sorted(names)[:20]
    q = tmp_path / "q4_k_m.gguf"
    run("llama-quantize", "--imatrix", im, g, q, "q4_k_m", 1)
    fields = GGUFReader(str(q)).fields
    assert _file_type(q) == 15 and int(fields["quantize.imatrix.entries_count"].parts[-1][0]) > 0


def _next_logprobs(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    x = np.array(llm.scores[len(ids) - 1], dtype=np.float64)  # (V,) the last position's logits
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_llama_server_lora_scale_is_llama_cpp_pythons(adapted, base_run):  # noqa: F811
    from mfgguf.run import RunDir

    d, out = adapted
    base, lora = d / "base.gguf", out / "lora.gguf"
    ids = [int(t) for t in next(iter(RunDir(base_run).test_tokens(48).values()))[:24]]
    scales, got, want = (0.0, 0.5, 1.0), {}, {}
    # -fa off: llama-cpp-python's default; llama-server's "auto" turns flash attention on, whose f16 arithmetic
    # moves log-probabilities by more than the tolerance here
    with server(base, "-c", CTX, "-np", 1, "-fa", "off", "--lora", lora) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        assert [a["id"] for a in http.get("/lora-adapters").json()] == [0]
        for s in scales:
            r = http.post("/completion", json={"prompt": ids, "n_predict": 1, "n_probs": 10, "temperature": 0,
                                               "cache_prompt": False, "lora": [{"id": 0, "scale": s}]})
            assert r.status_code == 200, r.text
            got[s] = {t["id"]: t["logprob"] for t in r.json()["completion_probabilities"][0]["top_logprobs"]}
    for s in scales:
        llm = _llm(base, lora_path=str(lora), lora_scale=s, logits_all=True)
        try:
            want[s] = _next_logprobs(llm, ids)  # (V,)
        finally:
            llm.close()
        top = np.argsort(-want[s])[:10]
        assert list(got[s]) == top.tolist(), (s, list(got[s]), top)
        err = max(abs(lp - want[s][i]) for i, lp in got[s].items())
        assert err < 1e-3, (s, err)
    # the request's scale is what counts: at 1 the server's distribution is far from the adapter-free one
    assert max(abs(lp - want[0.0][i]) for i, lp in got[1.0].items()) > 0.05
