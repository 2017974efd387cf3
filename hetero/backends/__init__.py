"""Execution backends for exported prefill pieces.

- `reference_executor`  runs a saved Core ML program with numpy, on any OS (the reference, not the ANE)
- `reference_prefill`   a serial prefill in which exported attention programs replace MLX's attention layers
- `coreml_macos`        runs the same packages through Core ML on macOS (CPU + Neural Engine), with placement report
"""
