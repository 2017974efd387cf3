"""Benchmarks: each script measures a figure against a baseline in the same run and writes JSON (and PNG)."""
