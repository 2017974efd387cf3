"""The two-lane prefill runtime: a wavefront of jobs over (chunk, layer, piece) on two device lanes.

Two device lanes, each a single worker thread driven from anyio: the GPU lane runs MLX; the ANE lane runs the
exported Core ML programs (Core ML on macOS, the portable reference executor elsewhere; numpy and MLX release
the GIL while they compute, so the lanes overlap). The prefill is a graph of jobs: a layer's mixer for chunk c
needs the layer's state after chunk c-1 and chunk c's hidden from the layer below, an MLP its own layer's mixer
output. Each lane runs its ready jobs, oldest chunk first, so with several chunks in flight the ANE works on one
chunk's shares while the GPU runs the recurrent and attention work of another. A split piece's shares run as
two jobs whose `merge` (GPU lane) combines them exactly where the math allows (shared/DESIGN.md section 4):

- attention: the ANE's KV-head groups and the GPU's rest each give a partial o_proj sum; their new K/V are
  concatenated by head and written into the GPU cache (the single source of truth);
- MLP: each side's channels give a partial down_proj sum;
- MoE MLP: the ANE takes channels of the shared expert only (the MLP program), merged as the MLP's partial sums;
  the router, the routed experts and the shared expert's sigmoid gate (applied after the merge) stay on the GPU;
- GDN: the ANE computes z rows, the GPU everything that feeds the recurrence (and the rest of z); the gated
  norm and out_proj follow the merge on the GPU.

`--verify` reruns the prompt GPU-only and compares; `--trace` writes one Chrome trace track per lane.

Modules: `lanes` (lanes, the job scheduler, decode interleaving, trace), `programs` (ANE backend, export cache),
`shares` (the GPU's slices), `piece_jobs` (each layer's pieces for a chunk as jobs, reading and writing the residual
stream as the architecture's layer does), `split` (the split prefill), `run` (a configured split: its plan), `auto`
(`--ane-fraction auto`: the recommended split, verified, kept only where its TTFT wins beyond the noise),
`calibrate` (the pieces' activation ranges, measured on the GPU lane), `verification` (`verify`: the split against
GPU-only, judged by the run's own rounding).
"""

from hetero.pipeline.lanes import DecodeQueue, Job, Lane, Trace, run_jobs
from hetero.pipeline.programs import Programs, ane_backend, ensure_export, export_root, load_programs
from hetero.pipeline.auto import auto_fraction, split_for
from hetero.pipeline.run import DEFAULT_CHUNK, DEFAULT_VERIFY_TOKENS, DEFAULT_VERIFY_TOL, PipelineRun, configure
from hetero.pipeline.shares import GpuAttentionRest, GpuGDNRest, GpuMLPRest, GpuMoERest
from hetero.pipeline.split import SplitPrefill, SplitResult
from hetero.pipeline.verification import greedy_continuation, verify
from hetero.planner import context_bucket

__all__ = [
    "DEFAULT_CHUNK", "DEFAULT_VERIFY_TOKENS", "DEFAULT_VERIFY_TOL", "DecodeQueue", "GpuAttentionRest", "GpuGDNRest",
    "GpuMLPRest", "GpuMoERest", "Job", "Lane", "PipelineRun", "Programs", "SplitPrefill", "SplitResult", "Trace",
    "ane_backend", "auto_fraction", "configure", "context_bucket", "ensure_export", "export_root",
    "greedy_continuation", "load_programs", "run_jobs", "split_for", "verify",
]
