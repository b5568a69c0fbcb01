"""`prepare`: sources -> a RUN directory with a tokenizer, token shards, a validation and a test split.

Order matters: the test split is drawn first (per domain, whole documents; the same documents a RUN
without validation held out), then the validation split from the rest; the tokenizer is trained on
the training documents only, then everything is tokenized and the training documents
are partitioned into expert shards. The RUN is built in a temporary sibling directory and renamed
into place at the end, so a failure leaves no half-written RUN (and `force` replaces an old one
only once the new one is complete).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from mfgguf.base.runbase import base_info, base_only, base_tokenizer, carry_into, imported
from mfgguf.errors import MfggufError
from mfgguf.run import RUN_FORMAT, RUN_VERSION, RunDir, swap_dir_into_place, write_json
from mfgguf.data.chat import encode_conversations, run_template
from mfgguf.data.masks import write_mask
from mfgguf.data.partition import PARTITIONS, partition as _partition_docs, split_three
from mfgguf.data.sources import load_corpus
from mfgguf.data.tokenizer import EOS_ID, EOS_TOKEN, MIN_VOCAB, encode_documents, token_dtype, train_tokenizer


def prepare(sources: list[str], out: Path, *, n_experts: int, partition: str = "label", vocab_size: int = 4096,
            test_frac: float = 0.05, valid_frac: float = 0.05, overlap: float = 0.0, seed: int = 0, max_chars_per_domain: int | None = None,
            text_field: str = "text", force: bool = False, progress: bool = True) -> dict:
    """Read SOURCES, train a byte-level BPE tokenizer, and write a RUN directory: tokens for the
    trunk, one shard per expert, and two splits per domain that no module trains on: validation (every choice
    made on data reads it: training curves, LR grids, schedules, the router) and test (TEST_FRAC of the
    documents, scored once per final model by `eval` and `perplexity --run`). VALID_FRAC is of the documents
    left after the test split.

    Sources: text files, directories, globs, JSONL (`domain` field optional), `hf:NAME[:CONFIG][:SPLIT]`,
    `hf:json:FILES`, `builtin` (Python's own code, English docs and C headers) or `study` (the larger
    experiment corpus: installed packages' code and docstrings, C and C++ headers, man pages); `LABEL=SOURCE`
    names the domain. Partitions: `label` (by domain), `random` (with OVERLAP, a document may join
    a second expert), `cluster` (balanced k-means over tf-idf, c-BTM style). Into a RUN written by
    `mfgguf import-base`, no BPE is trained: the corpus is tokenized with the base's own tokenizer
    (vocab_size is ignored) and the imported trunk is kept. JSONL lines holding a `messages` list are
    conversations, rendered with the base's chat template; the loss is on their assistant turns only (a mask
    beside each token file: data/chat.py, data/masks.py). Returns run.json.

    Example:
        >>> prepare(["builtin"], Path("RUN"), n_experts=3, vocab_size=4096, max_chars_per_domain=2_000_000)
    """
    out = Path(out)
    _validate(sources, out, n_experts, partition, vocab_size, test_frac, valid_frac, overlap, max_chars_per_domain,
              force)
    t0 = time.time()
    docs, source_stats = load_corpus(sources, text_field=text_field, max_chars_per_domain=max_chars_per_domain,
                                     progress=progress)
    domains = [d.domain for d in docs]
    train_idx, valid_idx, test_idx = _split(domains, test_frac, valid_frac, seed)

    base = imported(out)  # `mfgguf import-base` wrote RUN: the base's own tokenizer, EOS and vocabulary
    template = run_template(base) if any(d.conversation for d in docs) else None  # conversations need one: ask first
    tok, vocab, eos, eos_token = _tokenizer(base, [docs[i].text for i in train_idx], vocab_size, progress)
    dtype = token_dtype(vocab)
    tokens, masks = _encode(tok, template, docs, dtype, progress)

    part, shard_docs = _shards(partition, tokens, domains, train_idx, n_experts, overlap, seed, progress)

    tmp = _temp_dir(out)
    try:
        run = RunDir(tmp)
        _write_tokenizer(run, base, tok)
        train_tokens, shards, test, valid = _write_data(run, docs, tokens, masks, (train_idx, valid_idx, test_idx),
                                                           shard_docs, seed, dtype, eos)
        if partition == "cluster":
            _save_clusters(run.clusters, part)
        info = {
            "format": RUN_FORMAT,
            "version": RUN_VERSION,
            "n_experts": n_experts,
            "partition": partition,
            "overlap": overlap,
            "vocab_size": vocab,
            "eos_id": eos,
            "eos_token": eos_token,
            "token_dtype": dtype.name,
            "domains": sorted(set(domains)),
            "shards": shards,
            "train_tokens": train_tokens,
            "train_docs": len(train_idx),
            "conversations": sum(m is not None for m in masks),  # documents with a loss mask (chat.py)
            "test": test,
            "valid": valid,
            "sources": list(sources),
            "source_stats": source_stats,
            "seed": seed,
            "test_frac": test_frac,
            "valid_frac": valid_frac,
            "max_chars_per_domain": max_chars_per_domain,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "prepare_seconds": round(time.time() - t0, 2),
        }
        write_json(run.run_json, info)
        _fsync_tree(tmp)
        swap_dir_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def _split(domains: list[str], test_frac: float, valid_frac: float, seed: int):
    """The documents' indices for training, validation and test; some must be left to train on."""
    train_idx, valid_idx, test_idx = split_three(domains, test_frac, valid_frac, seed)
    if len(train_idx) == 0:
        raise MfggufError("no training documents left after the test and validation splits; add data or lower"
                          " --test-frac and --valid-frac")
    return train_idx, valid_idx, test_idx


def _shards(partition: str, tokens, domains, train_idx, n_experts: int, overlap: float, seed: int, progress: bool):
    """The partition of the training documents, and each shard's documents as indices into the corpus."""
    with _status(progress, f"partitioning {len(train_idx)} documents into {n_experts} shards ({partition})"):
        part = _partition(partition, tokens, domains, train_idx, n_experts, overlap, seed)
    shard_docs = [train_idx[s] for s in part.shards]  # indices into `docs`
    _check_shards(shard_docs, partition, n_experts, len(train_idx))
    return part, shard_docs


def _tokenizer(base, train_texts: list[str], vocab_size: int, progress: bool):
    """(tokenizer, vocabulary size, EOS id, EOS token): an imported base's own, else a BPE trained on `train_texts`."""
    if base is not None:
        binfo = base_info(base)
        return base_tokenizer(base), int(binfo["shape"]["vocab_size"]), int(binfo["eos_id"]), binfo["eos_token"]
    with _status(progress, f"training a {vocab_size}-token BPE on {len(train_texts)} documents"):
        tok = train_tokenizer(iter(train_texts), vocab_size)
    return tok, tok.get_vocab_size(), EOS_ID, EOS_TOKEN


def _temp_dir(out: Path) -> Path:
    """The RUN's directory while it is written, beside OUT (moved into place when complete)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the RUN should be an ordinary directory
    return tmp


def _write_tokenizer(run: RunDir, base, tok) -> None:
    """The split directories, and the tokenizer: an imported base's files carried over, or the trained BPE."""
    run.test_dir.mkdir(parents=True)
    run.valid_dir.mkdir(parents=True)
    if base is not None:
        carry_into(base, run.root)
        if base.tokenizer_json.is_file():
            shutil.copyfile(base.tokenizer_json, run.tokenizer)
    else:
        tok.save(str(run.tokenizer))


def _write_data(run: RunDir, docs, tokens, masks, splits, shard_docs, seed: int, dtype, eos):
    """The token files (and loss masks) of the training tokens, the shards and both splits; run.json's records."""
    train_idx, valid_idx, test_idx = splits
    rng = np.random.default_rng([seed, 5])
    # training order is shuffled once, so a reader that streams the file sees mixed domains
    order = rng.permutation(train_idx)
    train_tokens = write_tokens(run.train_tokens, tokens, order, dtype, eos)
    write_mask(run.train_tokens, masks, tokens, order)
    shards = _write_shards(run, shard_docs, tokens, masks, [d.domain for d in docs], rng, dtype, eos)
    test = _write_split(test_idx, run.test, run.test_text, docs, tokens, masks, dtype, eos)
    valid = _write_split(valid_idx, run.valid, run.valid_text, docs, tokens, masks, dtype, eos)
    return train_tokens, shards, test, valid


def _write_shards(run: RunDir, shard_docs, tokens, masks, domains, rng, dtype, eos) -> list[dict]:
    """Each expert's shard, its documents in a shuffled order; run.json's record of each (`counted`: the tokens
    its loss mask counts, where it has one)."""
    shards = []
    for i, idx in enumerate(shard_docs, 1):
        order = rng.permutation(idx)
        n = write_tokens(run.shard(i), tokens, order, dtype, eos)
        counted = write_mask(run.shard(i), masks, tokens, order)
        comp = {}
        for j in idx:
            comp[domains[j]] = comp.get(domains[j], 0) + len(tokens[j]) + 1
        shards.append({"id": i, "docs": len(idx), "tokens": n, "domains": dict(sorted(comp.items())),
                       **({"counted": counted} if counted is not None else {})})
    return shards


def _write_split(idx, npy, txt, docs, tokens, masks, dtype, eos) -> dict:
    """One split's tokens and text per domain ({domain: {docs, tokens[, counted]}}); `npy`/`txt` name a domain's
    files."""
    out = {}
    domains = [d.domain for d in docs]
    for d in sorted(set(domains[i] for i in idx)):
        mine = [i for i in idx if domains[i] == d]
        n = write_tokens(npy(d), tokens, mine, dtype, eos)
        counted = write_mask(npy(d), masks, tokens, mine)
        txt(d).write_text("\n\n".join(docs[i].text for i in mine), encoding="utf-8")
        out[d] = {"docs": len(mine), "tokens": n, **({"counted": counted} if counted is not None else {})}
    return out


# ---- checks ------------------------------------------------------------------------------------------


def _validate(sources, out: Path, n_experts, partition, vocab_size, test_frac, valid_frac, overlap, max_chars,
              force) -> None:
    if not sources:
        raise MfggufError("no sources given; pass files, directories, globs, JSONL, hf:NAME, `builtin` or `study`")
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1:
        raise MfggufError(f"number of experts must be at least 1, got {n_experts}; pass --experts N")
    if partition not in PARTITIONS:
        raise MfggufError(f"unknown partition {partition!r}; use one of: {', '.join(PARTITIONS)}")
    if vocab_size < MIN_VOCAB:
        raise MfggufError(f"vocab size {vocab_size} is too small; byte-level BPE needs at least {MIN_VOCAB}")
    if not 0.0 <= test_frac < 1.0:
        raise MfggufError(f"held-out fraction must be in [0, 1), got {test_frac}")
    if not 0.0 <= valid_frac < 1.0:
        raise MfggufError(f"--valid-frac must be in [0, 1), got {valid_frac}")
    if not 0.0 <= overlap < 1.0:
        raise MfggufError(f"overlap must be in [0, 1), got {overlap}")
    if max_chars is not None and max_chars < 1:
        raise MfggufError(f"max chars per domain must be positive, got {max_chars}")
    if out.exists() and not out.is_dir():
        raise MfggufError(f"{out} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force and not base_only(out):  # import-base's RUN: fill it
        raise MfggufError(f"{out} already exists and is not empty; choose another --out or pass --force to replace it")


def _check_shards(shards, partition: str, n_experts: int, n_train: int) -> None:
    empty = [i for i, s in enumerate(shards, 1) if len(s) == 0]
    if not empty:
        return
    which = ", ".join(map(str, empty[:8])) + ("..." if len(empty) > 8 else "")
    if n_train < n_experts:
        raise MfggufError(f"only {n_train} training documents for {n_experts} experts (shards {which} are empty);"
                          " use fewer experts or more data")
    hint = "use fewer experts, more data, or --partition label" if partition == "random" else "use fewer experts or more data"
    raise MfggufError(f"expert shards {which} of {n_experts} got no documents with --partition {partition}; {hint}")


# ---- steps -------------------------------------------------------------------------------------------


def _partition(name, tokens, domains, train_idx, n, overlap, seed):
    return _partition_docs(name, [tokens[i] for i in train_idx], [domains[i] for i in train_idx], n,
                     overlap=overlap, seed=seed)


def _encode(tok, template, docs, dtype, progress: bool) -> tuple[list[np.ndarray], list]:
    """Every document's token ids, and its loss mask: None (all ones) for text, a conversation's from chat.py."""
    plain = [i for i, d in enumerate(docs) if d.conversation is None]
    chat = [i for i, d in enumerate(docs) if d.conversation is not None]
    tokens: list = [None] * len(docs)
    masks: list = [None] * len(docs)
    for i, t in zip(plain, _tokenize(tok, [docs[i].text for i in plain], dtype, progress) if plain else []):
        tokens[i] = t
    if chat:
        with _status(progress, f"rendering and tokenizing {len(chat)} conversations"):
            encoded = encode_conversations(tok, template, [docs[i].conversation for i in chat], dtype)
        for i, (ids, mask) in zip(chat, encoded):
            tokens[i], masks[i] = ids, mask
    return tokens, masks


def _tokenize(tok, texts: list[str], dtype, progress: bool) -> list[np.ndarray]:
    if not progress:
        return list(encode_documents(tok, texts, dtype=dtype))
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task("tokenizing", total=len(texts), rate="")
        state = {"tokens": 0, "t0": time.time()}

        def on_batch(n_texts, n_tokens):
            state["tokens"] += n_tokens
            rate = state["tokens"] / max(time.time() - state["t0"], 1e-9)
            bar.update(task, advance=n_texts, rate=f"{state['tokens']:,} tokens, {rate:,.0f} tok/s")

        return list(encode_documents(tok, texts, dtype=dtype, on_batch=on_batch))


def write_tokens(path: Path, tokens: list[np.ndarray], order, dtype, eos: int = EOS_ID) -> int:
    """Docs in `order`, each followed by EOS, into one .npy (written in place via a memmap)."""
    order = list(order)
    total = sum(len(tokens[i]) + 1 for i in order)
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(total,))
    pos = 0
    for i in order:
        t = tokens[i]
        arr[pos: pos + len(t)] = t
        arr[pos + len(t)] = eos
        pos += len(t) + 1
    arr.flush()
    del arr
    return total


def _save_clusters(path: Path, part) -> None:
    from safetensors.numpy import save_file

    save_file({"centres": np.ascontiguousarray(part.centres, dtype=np.float32),   # (k, n_terms)
               "terms": np.ascontiguousarray(part.terms, dtype=np.int64),          # (n_terms,) token ids
               "idf": np.ascontiguousarray(part.idf, dtype=np.float32)},           # (n_terms,)
              str(path), metadata={"format": "mfgguf-clusters", "features": "l2-normalised tf-idf of token ids"})


def _fsync_tree(root: Path) -> None:
    for dirpath, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(dirpath, n), "rb") as f:
                os.fsync(f.fileno())


@contextmanager
def _status(progress: bool, text: str):
    if not progress:
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield
