"""Multiple-choice benchmarks on a GGUF, scored as llama.cpp's `llama-perplexity` scores them: HellaSwag,
WinoGrande and its binary multiple-choice format (ARC, MMLU, TruthfulQA). tasks.py reads the files and picks the
tasks, draw.py replicates llama-perplexity's draw of them, score.py scores them through llama-cpp-python,
tool.py through llama-perplexity itself, benchmark.py chooses between the two and writes the result."""
