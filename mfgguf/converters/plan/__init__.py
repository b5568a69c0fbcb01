"""Assembly's plan: the modules checked, and the whole GGUF laid out from metadata alone, before any weight is read."""
