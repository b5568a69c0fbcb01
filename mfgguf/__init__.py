"""mfgguf: train a Mixture-of-Experts LLM as independent small modules, assemble one GGUF, run it with llama.cpp.

Pipeline (each stage one module of this package):
    data/        corpus sources, tokenizer, partition into expert shards, held-out split
    model.py     the llama-style decoder with anchor + routed experts (granitemoe graph)
    head_loss.py the output head's cross-entropy a chunk at a time (the logits never whole in training)
    train/       trunk and expert training, router statistics, checkpoints
    converters/  GGUF layout, quantization, router, streaming assembly, inspect
    runtime/     llama-cpp-python: chat, generate, serve, perplexity
    config.py    model and training configs, presets; options.py: the training options built from them
    eval/evaluate.py  the honest comparison report: models built and compared here, measured by eval/measure.py,
                 written by eval/report.py (against its Goals), drawn by plots.py
    cli/         the typer app (thin)
"""

__version__ = "0.2.0"
