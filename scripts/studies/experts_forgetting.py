"""Forgetting in the study of how many experts (scripts/studies/experts_count.py): every model on a domain none trained on.

The study's five domains are all clustered and trained, so its test split cannot show what training cost the base
elsewhere. This scores each finished run's MoE (the top-k its validation chose) and the references (the base,
continued pretraining, one LoRA; each seed that trained them) on package documentation: the long descriptions of
the installed packages' metadata (`*.dist-info/METADATA`, Markdown and reStructuredText prose with code), text
the `study` corpus does not read. Every model is an f16 GGUF of its run's `eval/models`, scored by
`mfgguf perplexity --data` (llama.cpp, windows of 1,024, the first --chunks of them); the figure is each model's
perplexity over the base's.

Appends a JSON line a model to OUT/forgetting.jsonl (a scored model is not scored again) and writes
OUT/forgetting.md.

    python scripts/studies/experts_forgetting.py --out experts-count --chunks 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

from experts_count import NAMES, chosen_moe, load_rows  # noqa: E402

REFERENCES = {"base": "trunk-f16.gguf", "flop": "base-flop-f16.gguf", "lora": "base-lora-f16.gguf",
              "wallclock": "base-wallclock-f16.gguf"}


def package_docs(path: Path, max_chars: int) -> Path:
    """OUT's held-out text: the installed packages' long descriptions, in path order, up to max_chars."""
    import sysconfig

    from mfgguf.run.files import atomic_path

    if path.is_file():
        return path
    site = Path(sysconfig.get_paths()["purelib"])
    parts, n = [], 0
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        _, _, body = meta.read_text(encoding="utf-8", errors="replace").partition("\n\n")  # after the headers
        if body.strip():
            parts.append(body.strip())
            n += len(parts[-1])
        if n >= max_chars:
            break
    with atomic_path(path) as tmp:  # a run stopped here leaves no partial text to be read as whole next time
        tmp.write_text("\n\n".join(parts)[:max_chars], encoding="utf-8")
    return path


def models(out: Path, rows: list[dict]) -> list[tuple[str, int, int | None, Path]]:
    """(method, seed, N or None, GGUF) of each model to score: every row's chosen MoE, every run's references."""
    got = []
    for r in rows:
        run = out / f"n{r['n']}-s{r['seed']}" / "run"
        ev = run / "eval"
        got.append(("moe", r["seed"], r["n"], chosen_moe(run)[1]))
        for m, f in REFERENCES.items():
            if m in r["methods"] and (ev / "models" / f).is_file():
                got.append((m, r["seed"], None, ev / "models" / f))
    seen, unique = set(), []
    for g in got:  # the base is in every run: once
        key = (g[0], None if g[0] == "base" else g[1], g[2])
        if key not in seen:
            seen.add(key)
            unique.append(g)
    return unique


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("experts-count"), help="the study's folder (study.jsonl)")
    ap.add_argument("--chunks", type=int, default=8, help="windows of 1,024 scored")
    ap.add_argument("--max-chars", type=int, default=200_000, help="characters of package documentation")
    a = ap.parse_args(argv)

    from mfgguf.runtime.perplexity import perplexity_files

    rows = load_rows(a.out / "study.jsonl")
    if not rows:
        sys.exit(f"experts_forgetting: no finished run in {a.out / 'study.jsonl'}")
    text = package_docs(a.out / "forgetting-text.txt", a.max_chars)
    log = a.out / "forgetting.jsonl"
    done = {(x["method"], x["seed"], x["n"]) for x in load_rows(log)}
    for method, seed, n, gguf in models(a.out, rows):
        if (method, seed, n) in done:
            continue
        r = perplexity_files(gguf, data=[text], ctx=1024, chunks=a.chunks, progress=False)["overall"]
        line = {"method": method, "seed": seed, "n": n, "model": str(gguf), "ppl": r["ppl"], "n_tokens": r["n_tokens"]}
        print(json.dumps(line), flush=True)
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")
    write_table(a.out, load_rows(log))


def write_table(out: Path, scored: list[dict]) -> None:
    base = statistics.mean(x["ppl"] for x in scored if x["method"] == "base")
    groups: dict[tuple, list[float]] = {}
    for x in scored:
        groups.setdefault((x["method"], x["n"]), []).append(x["ppl"])
    L = ["# Forgetting: every model on package documentation (trained by none)", "",
         f"{scored[0]['n_tokens']:,} scored tokens; perplexity (mean, min-max over seeds) and over the base's.", "",
         "| model | seeds | perplexity | / the base |", "|---|---:|---:|---:|"]
    for (method, n), v in sorted(groups.items(), key=lambda kv: (kv[0][0] != "base", kv[0][1] or 0, kv[0][0])):
        name = f"MoE N={n}" if method == "moe" else NAMES[method]
        cell = f"{statistics.mean(v):.3f}" + (f" ({min(v):.3f}-{max(v):.3f})" if min(v) != max(v) else "")
        L.append(f"| {name} | {len(v)} | {cell} | {statistics.mean(v) / base:.3f} |")
    (out / "forgetting.md").write_text("\n".join(L) + "\n")
    print(f"experts_forgetting: {out / 'forgetting.md'}")


if __name__ == "__main__":
    main()
