"""Checkpoint files and their formats: safetensors and .pt reading, GGUF, fp8 and quantised linears, key matching."""
