"""Hardware profiles for the planner: one JSON file per Apple chip, plus `this-machine` (measured).

The chip files are built from shared/reference/apple_silicon.md; a value the table marks "?" is null here and
named in the profile's `unknown` list, never invented. Derived or assumed figures (the ANE's fp16 rate from
Apple's TOPS figure, the share of peak that MLX and the ANE reach) are listed in `notes`. `this-machine`
is what `hetero tune --devices` measured and saved in the per-machine settings.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from hetero.errors import HeteroError
from hetero.host.settings import device_profile

PROFILE_DIR = Path(__file__).parent
THIS_MACHINE = "this-machine"
DEFAULT_PROFILE = "m4-pro"  # what the planner uses until `hetero tune --devices` has measured this machine


@dataclass(frozen=True)
class Profile:
    """Device figures the cost model reads; None = unknown (predictions that need it are unknown too)."""

    name: str
    chip: str
    source: str
    memory_bandwidth_gbs: float | None  # the GPU lane's bandwidth (unified memory)
    gpu_fp32_tflops: float | None
    ane_fp16_tflops: float | None
    ane_bandwidth_gbs: float | None
    ram_gb: float | None
    gpu_efficiency: float  # share of the peak figures the GPU lane reaches on prefill matmuls
    ane_efficiency: float
    gpu_wired_fraction: float = 0.75
    # ~2 GB of baked weights per ANE program is documented (a larger weights.bin fails to load: coremltools
    # #1807); a larger share is exported as several programs.
    ane_program_weight_limit_gb: float | None = 2.0
    # No per-process limit on the ANE's weights is documented: None unless a profile measured one.
    ane_process_weight_limit_gb: float | None = None
    # The device window one ANE instance maps a program's whole weight blob into (oMLX's private path: about 4 GiB,
    # a larger blob fails to load). Unknown (None) unless measured; when known no exported program exceeds it.
    ane_instance_weight_window_gb: float | None = None
    ane_dispatch_s: float | None = None  # fixed cost per ANE call
    gpu_recurrence_efficiency: float = 1.0  # the GDN recurrence's rate relative to the GPU's matmul rate
    # Attention's rate relative to each lane's matmul rate: its softmax and masks are elementwise work that the
    # FLOP count (matmuls only) leaves out. 1.0 where not measured.
    gpu_attention_efficiency: float = 1.0  # attention's matmuls (QK^T, PV) relative to the GPU's matmul rate
    gpu_attention_score_s: float = 0.0  # seconds per attention score (query, key, head) beyond its matmuls: softmax
    ane_attention_score_s: float = 0.0  # the same on the ANE lane (over its static program's scores)
    ane_attention_efficiency: float = 1.0
    decode_efficiency: float = 1.0  # share of the bandwidth roofline that plain decode reaches
    # One MTP verify pass over `mtp_verify_tokens` tokens, in plain decode steps (None = unknown: no MTP estimate).
    mtp_verify_ratio: float | None = None
    mtp_verify_tokens: int = 4
    # How the lanes run on this machine (`hetero tune --devices` measures them; a Mac's GPU and ANE are devices of
    # their own, the defaults): GPU-only prefill's lanes (the CPU wavefront's two), each lane's BLAS threads, the
    # cores, a CPU lane's rate while another lane computes on another core over its rate alone, and whether the ANE
    # lane computes on the CPU's cores (the reference executor) rather than on a device of its own.
    prefill_lanes: int = 1
    lane_threads: int | None = None
    cpu_cores: int | None = None
    lane_contention: float = 1.0
    ane_on_cpu: bool = False
    # The link between hosts of a pipeline (`hetero plan --hosts N`): a property of the cable and the backend, not of
    # the chip, so the chip profiles leave it unknown; `--link-gbps` / `--link-latency-ms` give it.
    link_gbps: float | None = None  # usable one-way bandwidth, gigabits per second
    link_latency_ms: float | None = None  # one message's fixed cost, milliseconds
    ane_tops: float | None = None
    ane_count: int = 1
    gpu_cores: str | None = None
    ram_gb_options: list | None = None
    measured: bool = False
    measured_with: dict | None = None  # what a measured profile was measured with (`hetero.host.settings.measured_with`)
    confidence: dict = field(default_factory=dict)  # a measured profile: each timing's median, interval and samples
    unknown: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def profile_names() -> list[str]:
    """Every profile `--profile` accepts."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json")) + [THIS_MACHINE]


def load_profile(name: str) -> Profile:
    """A chip profile by name (e.g. `m4-pro`), or `this-machine` as `hetero tune --devices` saved it."""
    if name == THIS_MACHINE:

        saved = device_profile()
        if saved is None:
            raise HeteroError("no profile for this machine yet: run `hetero tune --devices` first")
        _say_if_stale(saved)
        return Profile.from_dict(saved)
    file = PROFILE_DIR / f"{name}.json"
    if not file.is_file():
        raise HeteroError(f"--profile {name}: unknown profile; choose one of {', '.join(profile_names())}")
    return Profile.from_dict(json.loads(file.read_text()))


_said_stale: list[str] = []


def _say_if_stale(saved: dict) -> None:
    """Once per process, on stderr: the saved profile was measured with other code (hetero, MLX, the BLAS), or by
    an earlier hetero that did not record how the lanes run here; it is still used, and `hetero tune --devices`
    measures it again."""
    from hetero.host.settings import changed

    moved = changed(saved.get("measured_with"))
    if moved is not None and not _said_stale:
        _said_stale.append(moved)
        print(f"hetero: the this-machine profile was measured with other code ({moved}); `hetero tune --devices` "
              "measures it again (until then the planner prices with it)", file=sys.stderr, flush=True)


def default_profile_name() -> str:
    """`this-machine` once `hetero tune --devices` has measured it here, else DEFAULT_PROFILE."""

    return THIS_MACHINE if device_profile() is not None else DEFAULT_PROFILE
