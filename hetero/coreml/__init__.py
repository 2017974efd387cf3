"""The Neural Engine's lane on disk: the Plan's pieces as Core ML programs (graphs/), their export and manifest, and the backends that run them (Core ML on macOS, the reference executor)."""
