"""Checkpoint converters and the bundled model's training."""
