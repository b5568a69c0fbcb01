"""`export-hf`: an assembled MoE GGUF as a Hugging Face model directory (export.py), one output architecture a file."""
