"""`python -m mfgguf` is the `mfgguf` command (the demo runs each stage this way)."""

from mfgguf.cli.app import main

main()
