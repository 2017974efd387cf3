"""The offload planner and the memory governor (shared/DESIGN.md sections 4 and 7).

Modules, each one job, importing one way (shape -> slices -> cost -> predict -> plan -> recommend, report):
`shape` (a model config, its shape, weight storage, state sizes), `slices` (requested fraction -> aligned ANE
shares with their caps, per-layer slices, programs), `cost` (FLOPs per piece and chunk, context buckets),
`predict` (lane rates, the wavefront's prefill time, decode rates), `governor` (the memory budget and context
window), `hosts` (`split_layers`: layers across pipeline ranks; `--hosts N`), `plan` (`PlanRequest` -> `make_plan`
-> the `Plan` object), `recommend` (`--recommend`), `report` (`hetero plan`'s text), `ranges` (measured activation
ranges: the channels a split's share may hold and its programs' power-of-two output scales, `within_range`).
"""

from hetero.planner.cost import chunk_spans, context_bucket, context_buckets, piece_flops
from hetero.planner.governor import (
    SPLIT_IN_FLIGHT,
    Budget,
    check_prompt_fits,
    govern,
    loaded_budget,
    physical_memory_bytes,
    prefill_buffer_bytes,
)
from hetero.planner.hosts import split_layers
from hetero.planner.plan import Plan, PlanRequest, make_plan
from hetero.planner.predict import Lanes, decode_bytes_per_token, predict_decode, predict_prefill, verify_cost
from hetero.planner.recommend import recommend
from hetero.planner.report import plan_lines
from hetero.planner.shape import MoE, Storage, model_shape, moe_of, read_model_config, storage_for
from hetero.planner.slices import (
    ALIGN,
    OFFLOADABLE,
    PROGRAM_WEIGHT_BUDGET,
    Parameters,
    Piece,
    PieceSlice,
    ane_slices,
    ane_weight_bytes,
    parameter_counts,
    pieces,
    program_spans,
)

__all__ = [
    "ALIGN", "OFFLOADABLE", "PROGRAM_WEIGHT_BUDGET", "SPLIT_IN_FLIGHT", "Budget", "Lanes", "MoE", "Parameters", "Piece",
    "PieceSlice", "Plan", "PlanRequest", "Storage", "ane_slices", "ane_weight_bytes", "check_prompt_fits",
    "chunk_spans",
    "context_bucket", "context_buckets", "decode_bytes_per_token", "govern", "loaded_budget",
    "make_plan", "model_shape", "moe_of", "parameter_counts", "physical_memory_bytes", "piece_flops", "pieces", "plan_lines", "predict_decode",
    "prefill_buffer_bytes",
    "predict_prefill", "program_spans", "read_model_config", "recommend", "split_layers", "storage_for", "verify_cost",
]
