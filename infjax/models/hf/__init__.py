"""Hugging Face checkpoints: files.py finds, reads and writes them; names.py maps their tensors by name."""
