"""Checkpoint readers (HF safetensors, OpenAI `original/`) and the writer of real-format test checkpoints."""
