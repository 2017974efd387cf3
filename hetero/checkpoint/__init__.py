"""Checkpoints on disk: finding, checking and loading them, their tokenizer and chat contract, the weights' fingerprint, and mlx-lm's loaded models."""
