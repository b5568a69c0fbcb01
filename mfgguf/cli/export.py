"""CLI verb `export-hf`: an assembled MoE GGUF -> a Hugging Face model directory (transformers, vLLM, SGLang)."""

from __future__ import annotations

from pathlib import Path

import typer

from mfgguf.cli.app import command
from mfgguf.converters.hf.export import export_hf
from mfgguf.converters.hf.shards import DTYPES


@command("export-hf", export_hf)
def export_hf_cmd(
    model: Path = typer.Argument(..., help="A .gguf written by `mfgguf assemble` (granitemoe, qwen2moe, qwen3moe or"
                                 " the folded layout)."),
    out: Path = typer.Option(..., "-o", "--out", help="The Hugging Face model directory to write."),
    dtype: str = typer.Option("f32", "--dtype", help=f"Weight type written: {'|'.join(DTYPES)} (f32: the file's"
                              " dequantized weights exactly; bf16: half the size, what GPU servers load)."),
    max_shard_gb: float = typer.Option(4.0, "--max-shard-gb", help="Largest safetensors shard, in GB."),
    force: bool = typer.Option(False, "--force", help="Replace an existing non-empty output directory."),
):
    r = export_hf(model, out, dtype=dtype, max_shard_gb=max_shard_gb, force=force)
    typer.echo(f"wrote {r['path']}: {r['hf_class']} (from {r['arch']}), {r['tensors']} tensors, {r['dtype']},"
               f" {r['bytes'] / 1e6:.1f} MB in {r['shards']} shard{'s' * (r['shards'] > 1)}, {r['seconds']:.1f} s")
