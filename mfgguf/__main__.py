"""`python -m mfgguf` is the `mfgguf` command (the demo runs each stage this way)."""

from .cli.app import main

main()
