"""The doctor's probes: one program per kind of the split's plan for the model it is given, at the planned shapes,
with random weights (a bare config.json is enough: no checkpoint is read).

A 256-wide program of the bundled model says nothing about a 27B: Core ML places small fp16 products on the CPU
even under CPU_AND_NE, and what runs on the Neural Engine depends on the shapes. So the doctor builds, from the plan
the split itself would run (`hetero.planner.recommend.split_plan`, every piece kind offloaded at the fraction):

- `attention`: the first attention slice's first program at the largest context bucket of the run (`--tokens`),
  in each layout (`hetero.coreml.graphs.attention.LAYOUTS`: the doctor picks the faster on a Mac);
- `mlp` (or an MoE model's `shared_expert`): the first MLP slice's first program (the planned share of channels);
- `gdn_in_proj`: the first GDN layer's z rows;
- `vision_block`: one ViT block of the tower at the bucket the plan gives the largest image it reports (capped:
  `hetero.planner.vision.MAX_VISION_PATCHES`), for checkpoints with a tower.

Each probe's matrices take the weight form the split would embed on this Mac (`hetero.coreml.target`), quantized at
the checkpoint's bits and group where it is quantized. Packages are cached under the export cache by a key of their
shape, form and seed (random weights are drawn from the seed, so a cached package is the one that would be built).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


PROBE_VERSION = 1  # bump when a probe's weights or inputs change
SEED = 0


@dataclass(frozen=True)
class Probe:
    """One program of the plan, as the doctor builds it: its kind, the layer the plan took it from, its static shape
    and builder, the form of its matrices (`fp16`, `lut`, `blockwise`) and the quantization they are drawn at."""

    kind: str
    layer: int | None
    shape: object
    build: object
    form: str = "fp16"
    quant: tuple[int, int] | None = None  # (bits, group): the checkpoint's, for a compressed form

    @property
    def name(self) -> str:
        """What it is, its form included."""
        return f"{self.title}, {self.form})"

    @property
    def title(self) -> str:
        """What it is, without its weight form."""
        s = self.shape
        dims = {"attention": lambda: f"{s.heads} heads of {s.head_dim}, {s.kv_heads} KV, hidden {s.hidden}, "
                                     f"bucket {s.cache_slots + s.chunk}, {s.layout} layout",
                "mlp": lambda: f"{s.channels} channels, hidden {s.hidden}",
                "shared_expert": lambda: f"{s.channels} channels, hidden {s.hidden}",
                "gdn_in_proj": lambda: f"{s.rows} z rows, hidden {s.hidden}",
                "vision_block": lambda: f"hidden {s.hidden}, {s.heads} heads, {s.patches} patches"}[self.kind]()
        where = f"layer {self.layer} " if self.layer is not None else ""
        return f"{where}{self.kind} ({dims}"

    def key(self) -> str:
        import coremltools as ct

        text = json.dumps([PROBE_VERSION, ct.__version__, self.kind, type(self.shape).__name__, asdict(self.shape),
                           self.form, self.quant, SEED])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def planned_probes(config: dict, fraction: float, chunk: int, tokens: int, form: str, target) -> list[Probe]:
    """The probes of the split of `config` at `fraction` (chunks of `chunk`, a run of `tokens`), matrices in the form
    the split embeds for `form` on `target` (`weight_form_for`); none where the plan gives the ANE no slice (an
    architecture whose pieces all stay on the GPU)."""
    from hetero.coreml.graphs import LAYOUTS
    from hetero.coreml.pieces import piece_shape
    from hetero.coreml.target import weight_form_for
    from hetero.planner import OFFLOADABLE, context_bucket
    from hetero.planner.plan import PlanRequest
    from hetero.planner.recommend import split_plan
    from hetero.planner.slices import split_for_budget
    from hetero.profiles import default_profile_name, load_profile

    request = PlanRequest(config, load_profile(default_profile_name()), fraction, context_bucket(tokens, chunk), chunk)
    plan = split_plan(request, OFFLOADABLE)
    storage = plan.storage
    quant = (storage.bits, storage.group_size) if storage.bits <= 4 else None
    form = weight_form_for(form, target)[0] if quant is not None else "fp16"
    bucket, out = context_bucket(tokens, chunk), []
    for kind in ("attention", "mlp", "shared_expert", "gdn_in_proj"):
        s = next((s for s in plan.slices if s.piece == kind), None)
        if s is None:
            continue
        part = split_for_budget(plan.args, s, plan.program_budget, None if form == "fp16" else storage)[0]
        for layout in (LAYOUTS if kind == "attention" else LAYOUTS[:1]):
            shape, build = piece_shape(plan.args, part, chunk, bucket, layout)
            out.append(Probe(kind, s.layer, shape, build, form, quant))
    vision = vision_probe(config)
    return out + ([vision] if vision is not None else [])


def vision_probe(config: dict) -> Probe | None:
    """A block of the checkpoint's vision tower at the bucket of the largest image `hetero plan` reports, capped
    (`MAX_VISION_PATCHES`); None without a tower."""
    from hetero.coreml.graphs.vision import VisionBlockShape, build_vision_block
    from hetero.models.qwen3_5_vision.args import VisionArgs
    from hetero.models.qwen4_exp.args import MODEL_TYPES as QWEN4_TYPES
    from hetero.planner.vision import PLAN_SIZES, image_grid, lane_bucket

    vision = config.get("vision_config")
    if not isinstance(vision, dict) or config.get("model_type") in QWEN4_TYPES:
        return None
    a = VisionArgs.from_config(vision)
    buckets = [lane_bucket(int(np.prod(image_grid(w, h, a))), a.merge_unit) for w, h in PLAN_SIZES]
    bucket = max((b for b in buckets if b is not None), default=None)
    if bucket is None:
        return None
    shape = VisionBlockShape(a.hidden_size, a.num_heads, a.intermediate_size, bucket, a.hidden_act)
    return Probe("vision_block", None, shape, build_vision_block)


# ----------------------------------------------------------------------------------------------------------
# Random weights and inputs of a probe's shape


def _matrix(rows: int, cols: int, probe: Probe, rng: np.random.Generator):
    """A [rows, cols] weight: N(0, 1/cols) fp16 values for a float checkpoint; for a quantized one, its quantization
    as exact tables (every group with an exact shift-scale form) embedded in the probe's form (fp16: the tables'
    values expanded), the same weights whatever the form."""
    if probe.quant is None:
        return rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
    from hetero.cli.doctor_weights import exact_weights

    w = exact_weights(rows, cols, *probe.quant, rng)
    if probe.form == "fp16":
        return w.dense().astype(np.float32)
    return w if probe.form == "blockwise" else w.without_affine()


def probe_weights(probe: Probe, rng: np.random.Generator):
    """Random weights of the probe's shape (norm weights near 1, biases small)."""
    s = probe.shape
    near_one = lambda n: 1 + 0.1 * rng.standard_normal(n).astype(np.float32)  # noqa: E731
    small = lambda n: 0.02 * rng.standard_normal(n).astype(np.float32)  # noqa: E731
    m = lambda r, c: _matrix(r, c, probe, rng)  # noqa: E731
    if probe.kind == "attention":
        from hetero.coreml.graphs.attention import AttentionWeights

        H, Hkv, D = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.head_dim
        return AttentionWeights(q=m(H, s.hidden), gate=m(H, s.hidden), k=m(Hkv, s.hidden), v=m(Hkv, s.hidden),
                                q_norm=near_one(D), k_norm=near_one(D), o=m(s.hidden, H))
    if probe.kind in ("mlp", "shared_expert"):
        from hetero.coreml.graphs.mlp import MLPWeights

        return MLPWeights(gate=m(s.channels, s.hidden), up=m(s.channels, s.hidden), down=m(s.hidden, s.channels))
    if probe.kind == "gdn_in_proj":
        from hetero.coreml.graphs.gdn import GDNInProjWeights

        return GDNInProjWeights(z=m(s.rows, s.hidden))
    from hetero.coreml.graphs.vision import VisionBlockWeights

    D, I = s.hidden, s.intermediate
    return VisionBlockWeights(norm1=near_one(D), norm1_bias=small(D), q=m(D, D), q_bias=small(D), k=m(D, D),
                              k_bias=small(D), v=m(D, D), v_bias=small(D), proj=m(D, D), proj_bias=small(D),
                              norm2=near_one(D), norm2_bias=small(D), fc1=m(I, D), fc1_bias=small(I), fc2=m(D, I),
                              fc2_bias=small(D))


def probe_inputs(probe: Probe, theta: float, seed: int = 1) -> dict[str, np.ndarray]:
    """One call's inputs (fp16 values): a normed-size input row per token, and for attention the chunk right after a
    full cache of random keys and values with its real rotary tables and masks."""
    from hetero.coreml.fp16 import fp16_values

    rng, s = np.random.default_rng(seed), probe.shape
    shapes = s.inputs()
    x = fp16_values(rng.standard_normal(shapes["x"], dtype=np.float32))
    if probe.kind == "attention":
        from hetero.coreml.graphs.attention import attention_masks, cache_inputs, rope_tables

        start = s.cache_slots
        kv = rng.standard_normal((2, 1, s.kv_heads, start, s.head_dim), dtype=np.float32)
        return {"x": x, **rope_tables(start, s, theta), **attention_masks(start, s), **cache_inputs(kv[0], kv[1], s)}
    if probe.kind == "vision_block":
        angle = rng.uniform(0, 2 * np.pi, shapes["cos"]).astype(np.float32)
        return {"x": x, "cos": fp16_values(np.cos(angle)), "sin": fp16_values(np.sin(angle)),
                "mask": np.zeros(shapes["mask"], np.float32)}  # one image filling the bucket: every patch sees all
    return {"x": x}


def probe_package(probe: Probe, root: Path) -> Path:
    """The probe saved as a package under `root` (reused when its key's package is there; written whole or not at
    all: saved beside it, then renamed)."""
    from hetero.coreml.graphs.package import save_program

    path = root / f"{probe.kind}_{probe.key()}.mlpackage"
    if (path / "Manifest.json").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".probe-") as tmp:
        built = save_program(probe.build(probe.shape, probe_weights(probe, np.random.default_rng(SEED))),
                             Path(tmp) / path.name)
        try:
            built.rename(path)
        except OSError:
            if not (path / "Manifest.json").is_file():
                raise
    return path


def probe_root(target) -> Path:
    """Where the doctor's probe packages for `target` are cached (beside the split's exports; Core ML's compiled
    folders beside them are the target's own)."""
    from hetero.pipeline.programs import export_root

    return export_root() / "doctor" / target.name

