"""CLI verb `import-base`: a pretrained Llama / Qwen2 / Qwen3 model (GGUF or Hugging Face directory) -> a RUN's trunk."""

from __future__ import annotations

from pathlib import Path

import typer

from mfgguf.base.importer import import_base
from mfgguf.cli.app import command
from mfgguf.run.records import ModuleMeta
from mfgguf.config import DEFAULT_PRESET


@command("import-base", import_base)
def import_base_cmd(
    src: Path = typer.Argument(..., help="A llama, qwen2 or qwen3 GGUF file, or a Hugging Face LlamaForCausalLM,"
                             " Qwen2ForCausalLM or Qwen3ForCausalLM directory."),
    out: Path = typer.Option(..., "--out", help="The RUN directory to create."),
    expert_ff: int = typer.Option(None, "--expert-ff", help="Width of the seed FFN (and of every expert), in hidden"
                                  " units taken from the base's FFN (default: an eighth of it; all of it leaves no"
                                  " anchor, and every token's FFN is then its routed experts alone)."),
    seed: bool = typer.Option(True, "--seed/--no-seed", help="Split the base's FFN into anchor + seed (experts start"
                              " from the seed); --no-seed keeps the whole FFN as the anchor."),
    preset: str = typer.Option(DEFAULT_PRESET, "--preset", help="Training preset the experts use (tokens, batch, lr)."),
    ctx_len: int = typer.Option(None, "--ctx-len", help="Training context (default: the preset's, at most the base's)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing RUN directory (only once the new one is complete)."),
):
    result = import_base(src, out, expert_ff=expert_ff, seed=seed, preset=preset, ctx_len=ctx_len, force=force)
    m = ModuleMeta.of(result)
    c = m.config
    seed_txt = f" + seed {c['expert_ff']}" if c["seed_expert"] else ""
    typer.echo(f"imported {src} into {out}: {c['n_layers']} layers x {c['dim']}, heads {c['n_heads']}/{c['n_kv_heads']},"
               f" vocab {c['vocab_size']}, FFN anchor {c['anchor_ff']}{seed_txt}, {m.bytes / 1e6:.1f} MB in"
               f" {result['import_seconds']:.1f} s; next: mfgguf prepare CORPUS --out {out} --experts N")
