"""The wired limit on Metal (`hetero.host.wired`): the real calls are injected, since Metal exists only on a Mac. The
stand-ins take the place of `mx.metal.is_available`, `mx.device_info` and `mx.set_wired_limit`."""

from __future__ import annotations

import mlx.core as mx

from hetero.host.wired import wire_working_set


def test_metal_wires_up_to_the_recommended_working_set():
    set_to = []
    limit = wire_working_set(metal_available=lambda: True,  # mx.metal.is_available on an Apple GPU
                             device_info=lambda: {"max_recommended_working_set_size": 40 << 30},  # mx.device_info
                             set_wired_limit=lambda n: set_to.append(n) or 0)  # mx.set_wired_limit
    assert limit == 40 << 30 and set_to == [40 << 30]


def test_without_metal_nothing_is_wired():
    set_to = []
    assert wire_working_set(set_wired_limit=set_to.append) is None and set_to == []
    assert not mx.metal.is_available()  # this machine: the real check says no Metal
