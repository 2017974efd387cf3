"""Keeping the model resident on Metal: MLX may wire (pin) up to the device's recommended working set, as mlx-lm
does around generation, so weights and KV caches are not paged out between requests. Nothing to do elsewhere."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx


def wire_working_set(
    metal_available: Callable[[], bool] = mx.metal.is_available,
    device_info: Callable[[], dict] = mx.device_info,
    set_wired_limit: Callable[[int], int] = mx.set_wired_limit,
) -> int | None:
    """Raise MLX's wired limit to the GPU's `max_recommended_working_set_size`; returns it, or None off Metal.

    The limit is a ceiling, not an allocation: MLX wires buffers as it allocates them, up to it."""
    if not metal_available():
        return None
    limit = int(device_info()["max_recommended_working_set_size"])
    set_wired_limit(limit)
    return limit
