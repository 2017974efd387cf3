"""The vision tower of `qwen3_5` checkpoints (transformers' `Qwen3_5VisionModel`, the Qwen3-VL tower) in MLX.

`args` (the config), `preprocess` (image -> flattened patches, as transformers' `Qwen2VLImageProcessor`),
`patch_embed`, `positions` (learned position table resampled to the grid, 2-D rotary angles), `blocks`,
`merger`, and `model` (the tower with its weight loading).
"""
