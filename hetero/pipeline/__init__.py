"""The two-lane prefill runtime: per chunk and layer, the ANE's slice and the GPU's rest run at the same time.

Two device lanes, each a single worker thread driven from anyio: the GPU lane runs MLX; the ANE lane runs the
exported Core ML programs (Core ML on macOS, the portable reference executor elsewhere; numpy and MLX release
the GIL while they compute, so the lanes overlap). A layer is a sequence of stages; each stage is
`prep` (GPU lane: the ANE's inputs), then the GPU's share and the ANE's share concurrently, then `merge`
(GPU lane) which combines them exactly where the math allows (shared/DESIGN.md section 4):

- attention: the ANE's KV-head groups and the GPU's rest each give a partial o_proj sum; their new K/V are
  concatenated by head and written into the GPU cache (the single source of truth);
- MLP: each side's channels give a partial down_proj sum;
- GDN: the ANE computes z rows, the GPU everything that feeds the recurrence (and the rest of z); the gated
  norm and out_proj follow the merge on the GPU.

`--verify` reruns the prompt GPU-only and compares; `--trace` writes one Chrome trace track per lane.

Modules: `lanes` (lanes, stages, decode interleaving, trace), `programs` (ANE backend, export cache), `shares`
(the GPU's slices), `split` (the split prefill), `run` (a configured split, verification, `auto`).
"""

from hetero.pipeline.lanes import DecodeQueue, Lane, Stage, Trace, run_stages
from hetero.pipeline.programs import Programs, ane_backend, context_bucket, ensure_export, export_root, load_programs
from hetero.pipeline.run import (
    DEFAULT_CHUNK,
    DEFAULT_VERIFY_TOKENS,
    DEFAULT_VERIFY_TOL,
    PipelineRun,
    auto_fraction,
    configure,
    greedy_continuation,
    verify,
)
from hetero.pipeline.shares import GpuAttentionRest, GpuGDNRest, GpuMLPRest
from hetero.pipeline.split import SplitPrefill, SplitResult

__all__ = [
    "DEFAULT_CHUNK", "DEFAULT_VERIFY_TOKENS", "DEFAULT_VERIFY_TOL", "DecodeQueue", "GpuAttentionRest", "GpuGDNRest",
    "GpuMLPRest", "Lane", "PipelineRun", "Programs", "SplitPrefill", "SplitResult", "Stage", "Trace", "ane_backend",
    "auto_fraction", "configure", "context_bucket", "ensure_export", "export_root", "greedy_continuation",
    "load_programs", "run_stages", "verify",
]
