"""A RUN's module files as every reader takes them: headers and shapes, the trunk merge, the tokenizer's GGUF keys."""
