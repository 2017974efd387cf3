"""The config space of every architecture hetero loads, as hypothesis strategies (`STRATEGIES`), for the conformance
harness (`conformance_checks.py`): each draw is a `Draw`, a config transformers accepts plus what the harness
does with it (the prompt's length, the weights' style, an MTP head, massive activations, the split's dtype).

Every field that changes the computation is drawn: attention heads, KV heads and head dims, partial rotary, rope
theta (mrope sections on the nested layouts), tied embeddings, norm eps, the layer-type pattern (all-attention and
all-GDN included), GDN heads, dims and conv kernel, experts / top-k / shared expert / `norm_topk_prob` (and
Qwen3-Next's `decoder_sparse_step` / `mlp_only_layers`), qwen4's `hc_count` / `hc_lowrank`, PLE layers, dims and
n-gram sizes, QSA budget, ratio, indexer heads and dims, MTP, and the vision tower's depth, patch and merge sizes.
Each released config (shared/reference/configs, docs/qwen4_flash_next) also appears scaled down with its ratios kept
(`released`): Qwen3.5-27B's 3 value heads per key head and 6 query heads per KV head, qwen4's indexer dimension
twice its rotary dimension.

Sizes stay tiny (hidden <= 96, <= 6 layers, vocab <= 256) so that a draw runs in about a second.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = Path("/work/shared/reference/configs")  # the lead's copy; the harness also reads the ones in docs/
FLASH_NEXT = ROOT / "docs" / "qwen4_flash_next" / "config.json"

# Prompt lengths around every boundary a path changes at: the token-by-token GDN form (<= 16), the chunked GDN
# form's chunk (64), the MoE forms (64 pairs sorted, 2 pairs per expert grouped), the wavefront's chunks
EDGES = (1, 2, 15, 16, 17, 33, 63, 64, 65, 100, 127, 128, 129, 200, 256, 257)
VOCAB = (64, 96, 128, 200, 256)
EOS = 1
OTHER_ACTIVATION = "unsupported hidden_act"  # hetero's one line for an MLP activation other than SiLU


def expected_refusals(draw: "Draw") -> list[str]:
    """The one-line refusals hetero owes a draw at load, for the fields it does not implement."""
    out = []
    if draw.config.get("hidden_act", "silu") not in ("silu", "swish"):
        out.append(OTHER_ACTIVATION)
    return out
NESTED = ("qwen3_5", "qwen3_5_moe", "qwen4_exp", "vision")  # layouts with a vision tower (text under text_config)


@dataclass(frozen=True)
class Limits:
    """How large a draw may be: `FULL` for bench/conformance.py's sweeps, `SMALL` for the suite's share (two
    minutes for every architecture)."""

    layers: int
    prompt: int  # the longest prompt (QSA prompts: several times the budget, whatever this says)
    blocks: int  # the most QSA blocks a query keeps (budget / ratio)
    experts: int


FULL = Limits(layers=6, prompt=257, blocks=8, experts=16)
SMALL = Limits(layers=4, prompt=48, blocks=4, experts=8)


@dataclass
class Draw:
    """One conformance case: `config` is the text config as transformers takes it (`vision` the tower's, for the
    nested layouts), the rest says what the harness checks on it."""

    arch: str
    config: dict
    prompt: int  # tokens in the prompt
    seed: int  # the weights' seed
    weights: dict = field(default_factory=dict)  # `conformance_weights.randomize`'s style
    mtp: bool = False  # an MTP head is added to the checkpoint
    depth: int = 2  # the MTP draft depth compared with plain decoding
    chunks: tuple[int, ...] = (16, 64)  # prefill chunk sizes compared with one pass
    vision: dict | None = None  # the nested layouts' tower
    outliers: dict | None = None  # massive activations (`conformance_weights.add_outliers`)
    dtype: str = "float32"  # the split's dtype
    source: str = "drawn"  # or "released:<name>"
    form: str = "saved"  # config.json as transformers saves it, or "released": the released Qwen3-Next form

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Draw":
        """A draw as `to_json` wrote it (a failing draw's message, bench/results/conformance*.json)."""
        return cls(**{k: tuple(v) if k == "chunks" else v for k, v in data.items()})


def released_form(config: dict) -> dict:
    """config.json as the released Qwen3-Next configs write it: flat `rope_theta` / `partial_rotary_factor`, no
    `rope_parameters`, and `full_attention_interval` in place of `layer_types` where the pattern is an interval."""
    out = {k: v for k, v in config.items() if k != "rope_parameters"}
    rope = config.get("rope_parameters") or {}
    out.update(rope_theta=rope.get("rope_theta", 10_000.0), partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
               rope_scaling=None if rope.get("rope_type", "default") == "default" else rope)
    types = config["layer_types"]
    for interval in range(1, len(types) + 1):
        if types == ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types))]:
            out.pop("layer_types")
            out["full_attention_interval"] = interval
            break
    return out


def _heads(draw, hidden: int) -> dict:
    kv = draw(st.integers(1, 4))
    groups = draw(st.sampled_from((1, 1, 2, 3, 6)))  # query heads per KV head (Qwen3.5-27B: 6)
    head_dim = draw(st.sampled_from((8, 16, 24, 32)))
    return dict(num_attention_heads=kv * groups, num_key_value_heads=kv, head_dim=head_dim)


def _rotary(draw, head_dim: int, mrope: bool) -> dict:
    """rope_parameters: partial rotary whose dims are even, theta, and on the nested layouts mrope sections that
    sum to the rotary half (as the released [11, 11, 10] sums to 32)."""
    factors = [f for f in (0.25, 0.5, 0.75, 1.0) if int(head_dim * f) % 2 == 0 and int(head_dim * f) >= 2]
    partial = draw(st.sampled_from(factors))
    rope = {"rope_type": "default", "rope_theta": draw(st.sampled_from((10_000.0, 1_000_000.0, 10_000_000.0))),
            "partial_rotary_factor": partial}
    dynamic = ("dynamic",) if int(head_dim * partial) > 2 else ()  # transformers divides by dims - 2 there
    kind = draw(st.sampled_from(("default",) * 5 + ("linear", "yarn") + dynamic))
    if kind != "default":  # scaled RoPE (`hetero.models.rope`)
        rope.update(rope_type=kind, factor=draw(st.sampled_from((2.0, 4.0, 8.0))))
        if kind == "yarn":  # short original contexts put the ramp inside a tiny head's few frequencies
            rope["original_max_position_embeddings"] = draw(st.sampled_from((64, 256, 4096)))
    if mrope:
        half = int(head_dim * partial) // 2
        t = draw(st.integers(0, half))
        h = draw(st.integers(0, half - t))
        rope.update(mrope_section=[t, h, half - t - h], mrope_interleaved=True)
    return rope


def _gdn(draw) -> dict:
    nk = draw(st.sampled_from((1, 2, 4)))
    ratio = draw(st.sampled_from((1, 2, 3)))  # value heads per key head (Qwen3.5-27B: 3)
    return dict(linear_num_key_heads=nk, linear_num_value_heads=nk * ratio,
                linear_key_head_dim=draw(st.sampled_from((8, 16, 32))),
                linear_value_head_dim=draw(st.sampled_from((8, 16, 24))),
                linear_conv_kernel_dim=draw(st.sampled_from((2, 3, 4, 4, 5))))


def _layer_types(draw, attention: str, limits: Limits) -> list[str]:
    """An interval pattern (the released form), or any mix: all attention and all GDN included."""
    n = draw(st.integers(1, limits.layers))
    if draw(st.booleans()):
        interval = draw(st.integers(1, 4))
        return [attention if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    return draw(st.lists(st.sampled_from(("linear_attention", attention)), min_size=n, max_size=n))


def _experts(draw, limits: Limits) -> dict:
    experts = draw(st.integers(1, limits.experts))
    return dict(num_experts=experts, num_experts_per_tok=draw(st.integers(1, min(experts, 4))),
                moe_intermediate_size=draw(st.sampled_from((8, 16, 32))),
                shared_expert_intermediate_size=draw(st.sampled_from((16, 32, 64, 96))))


def _text(draw, limits: Limits, attention: str = "full_attention", mrope: bool = False) -> dict:
    hidden = draw(st.sampled_from((32, 48, 64, 96)))
    heads = _heads(draw, hidden)
    layer_types = _layer_types(draw, attention, limits)
    return dict(vocab_size=draw(st.sampled_from(VOCAB)), hidden_size=hidden, **heads, **_gdn(draw),
                num_hidden_layers=len(layer_types), layer_types=layer_types, rope_parameters=_rotary(draw, heads["head_dim"], mrope),
                rms_norm_eps=draw(st.sampled_from((1e-6, 1e-5))), tie_word_embeddings=draw(st.booleans()),
                attention_bias=draw(st.sampled_from((False,) * 7 + (True,))),
                hidden_act=draw(st.sampled_from(("silu",) * 15 + ("gelu",))),
                eos_token_id=EOS, pad_token_id=None, bos_token_id=None)


def _weights(draw) -> dict:
    """Trained-like weights: zero-centred norms' spread, the blocks' gain, the embeddings' and routers' scale.

    Trained-like means the residual stream dominates each block's update, as in a trained LLM, whose bf16 run lies
    1-2% from its fp32 run (the bundled model 1.6%, a real-shape one 0.8%): embeddings at 0.5-1 and blocks at gain
    0.5-0.75 keep random checkpoints there (a released-shape MoE: 1.2-2.8%). Embeddings at 0.2 under blocks at gain
    1 make a chaotic network instead, whose own bf16 rounding moves it 10-37% and which amplifies an fp16 share's
    rounding past what any trained model shows (an honest fp32 split of one read 0.017)."""
    return dict(norm_std=draw(st.sampled_from((0.1, 0.3))), gain=draw(st.sampled_from((0.5, 0.75))),
                embed_std=draw(st.sampled_from((0.5, 1.0))), router_gain=draw(st.sampled_from((1.0, 2.0, 4.0))))


def _case(draw, arch: str, config: dict, limits: Limits, lengths=EDGES, mtp: bool = True, **extra) -> Draw:
    if "indexer_budget" not in config:
        lengths = tuple(n for n in lengths if n <= limits.prompt)
    prompt = draw(st.sampled_from(lengths) | st.integers(min(lengths), max(lengths)))
    return Draw(arch=arch, config=config, prompt=prompt, seed=draw(st.integers(0, 2**16)), weights=_weights(draw),
                mtp=mtp and draw(st.booleans()), depth=draw(st.integers(1, 3)),
                chunks=tuple(draw(st.lists(st.sampled_from((5, 16, 17, 64, 100)), min_size=2, max_size=2,
                                           unique=True))), **extra)


def _vision(draw, out_hidden: int) -> dict:
    patch = draw(st.sampled_from((2, 4, 8)))
    heads = draw(st.sampled_from((1, 2, 4)))
    return dict(depth=draw(st.integers(1, 3)), hidden_size=heads * draw(st.sampled_from((8, 16))),
                intermediate_size=draw(st.sampled_from((32, 64))), num_heads=heads, patch_size=patch,
                temporal_patch_size=draw(st.sampled_from((1, 2))), spatial_merge_size=draw(st.sampled_from((1, 2))),
                num_position_embeddings=draw(st.sampled_from((16, 36, 64))), out_hidden_size=out_hidden,
                hidden_act=draw(st.sampled_from(("gelu_pytorch_tanh", "gelu"))))


@st.composite
def qwen3_5_flat(draw, limits: Limits = FULL) -> Draw:
    config = dict(_text(draw, limits), intermediate_size=draw(st.sampled_from((32, 64, 128, 192))))
    return _case(draw, "qwen3_5_text", config, limits)


@st.composite
def qwen3_5_nested(draw, limits: Limits = FULL) -> Draw:
    config = dict(_text(draw, limits, mrope=True), intermediate_size=draw(st.sampled_from((32, 64, 128))))
    return _case(draw, "qwen3_5", config, limits, vision=_vision(draw, config["hidden_size"]))


@st.composite
def qwen3_5_moe(draw, limits: Limits = FULL) -> Draw:
    nested = draw(st.booleans())
    config = dict(_text(draw, limits, mrope=nested), **_experts(draw, limits))
    return _case(draw, "qwen3_5_moe" if nested else "qwen3_5_moe_text", config, limits,
                 vision=_vision(draw, config["hidden_size"]) if nested else None)


@st.composite
def qwen3_next_dense(draw, limits: Limits = FULL) -> Draw:
    config = dict(_text(draw, limits), intermediate_size=draw(st.sampled_from((32, 64, 128))), num_experts=0,
                  mlp_only_layers=[])
    return _case(draw, "qwen3_next", config, limits, form=draw(st.sampled_from(("saved", "released"))))


@st.composite
def qwen3_next_moe(draw, limits: Limits = FULL) -> Draw:
    config = dict(_text(draw, limits), **_experts(draw, limits), norm_topk_prob=draw(st.booleans()),
                  decoder_sparse_step=draw(st.sampled_from((1, 1, 2))),
                  intermediate_size=draw(st.sampled_from((32, 64))))
    n = len(config["layer_types"])
    config["mlp_only_layers"] = draw(st.lists(st.integers(0, n - 1), max_size=n // 2, unique=True))
    return _case(draw, "qwen3_next_moe", config, limits, form=draw(st.sampled_from(("saved", "released"))))


def _qsa(draw, rotary: int, limits: Limits) -> dict:
    ratio = draw(st.sampled_from((1, 2, 4, 8) if limits.blocks > 4 else (1, 2, 4)))
    return dict(indexer_n_heads=draw(st.integers(1, 8)), indexer_kv_heads=1,
                indexer_head_dim=rotary * draw(st.sampled_from((1, 1, 2))) + draw(st.sampled_from((0, 0, 4))),
                indexer_compress_ratio=ratio, indexer_budget=ratio * draw(st.integers(1, limits.blocks)))


def _qwen4_text(draw, nested: bool, limits: Limits) -> dict:
    text = _text(draw, limits, attention="indexed_attention", mrope=nested)
    rotary = int(text["head_dim"] * text["rope_parameters"]["partial_rotary_factor"])
    linear = [i + 1 for i, t in enumerate(text["layer_types"]) if t == "linear_attention"]
    ngram = draw(st.integers(2, 4))
    per = draw(st.sampled_from((1, 2, 4)))
    heads = (ngram - 1) * per
    text.update(**_experts(draw, limits), **_qsa(draw, rotary, limits), hc_count=draw(st.integers(2, 4)),
                hc_lowrank=draw(st.sampled_from((2, 4, 8, 16))), norm_topk_prob=draw(st.booleans()),
                output_gate_type=draw(st.sampled_from(("sigmoid", "silu"))),
                ple_layer_ids=draw(st.lists(st.sampled_from(linear), unique=True, max_size=2)) if linear else [],
                ple_embed_dim=heads * draw(st.sampled_from((2, 4, 8))), ngram_size=ngram, heads_per_ngram=per,
                ngram_vocab_size_base=draw(st.sampled_from((50, 97, 300))),
                make_ngram_vocab_size_divisible_by=draw(st.sampled_from((1, 8))),
                split_ngram_parts=draw(st.sampled_from((1, 2, 4))),
                ple_conv_kernel_size=draw(st.sampled_from((2, 3, 4))), seed=draw(st.integers(0, 9999)))
    return text


def _qsa_lengths(config: dict) -> tuple[int, ...]:
    """Prompts several times the QSA budget (so that keys are really dropped), and a short one."""
    budget = config.get("indexer_budget") or 8
    return (3 * budget, 3 * budget + 1, 4 * budget + config.get("indexer_compress_ratio", 1) - 1, 5 * budget)


@st.composite
def qwen4_flat(draw, limits: Limits = FULL) -> Draw:
    config = _qwen4_text(draw, False, limits)
    return _case(draw, "qwen4_exp_text", config, limits, lengths=_qsa_lengths(config))


@st.composite
def qwen4_nested(draw, limits: Limits = FULL) -> Draw:
    config = _qwen4_text(draw, True, limits)
    vision = dict(_vision(draw, config["hidden_size"]), temporal_patch_size=2)
    return _case(draw, "qwen4_exp", config, limits, lengths=_qsa_lengths(config), vision=vision)


@st.composite
def vision_tower(draw, limits: Limits = FULL) -> Draw:
    """A nested qwen3_5 checkpoint whose tower and mrope sections are drawn; the prompt holds one image."""
    config = dict(_text(draw, limits, mrope=True), intermediate_size=64, vocab_size=256)
    vision = _vision(draw, config["hidden_size"])
    image = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))  # merged patches across and down
    return _case(draw, "vision", config, limits, lengths=(24,), mtp=False, vision=dict(vision, image=list(image)))


# ---------------------------------------------------------------------------------------------------------------
# The split's draws: a dtype, and real LLMs' massive activations (`conformance_weights.add_outliers`)

DTYPE_NAMES = ("float32", "bfloat16", "float16")
# gate x up of an outlier channel ~ gain^2 t^2 (t = x . v, half the tokens t > 0): strong ones pass 1e5 on a share of
# the tokens (fp32 and bf16 hold them; fp16's GPU-only path itself overflows there), mild ones stay inside fp16
GAINS = {"strong": (300.0, 1000.0, 2000.0), "mild": (40.0, 56.0)}
RESIDUALS = {"strong": (1e3, 1e4, 3e4), "mild": (1e3, 3e3, 1e4)}  # the massive residual channel where t ~ 1
WIDTHS = (512, 1024)  # an MLP with outliers: 8 or 16 channel units of 64, so that a share of them stays clean


def outliers(draw, config: dict, level: str) -> dict:
    """Massive activations of `level` in one or two drawn layers' MLPs (dense or shared expert), writing a drawn
    residual channel."""
    n = config["num_hidden_layers"]
    layers = sorted(set(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2))))
    return dict(level=level, layers=layers, channel=draw(st.integers(0, config["hidden_size"] - 1)),
                gain=draw(st.sampled_from(GAINS[level])), residual=draw(st.sampled_from(RESIDUALS[level])))


def milder(draw_: Draw) -> Draw:
    """The same draw with its strong outliers made mild (fp16's GPU-only path overflows on strong ones)."""
    spec = draw_.outliers
    if not spec or spec["level"] != "strong":
        return draw_
    mild = dict(spec, level="mild", gain=max(GAINS["mild"]), residual=min(spec["residual"], max(RESIDUALS["mild"])))
    return Draw(**{**draw_.__dict__, "outliers": mild})


@st.composite
def split_draw(draw, arch: str, limits: Limits = FULL) -> Draw:
    """A draw of `arch` for the split: its MLPs (or shared experts) widened to channel units of 64 the ANE can
    take, outliers none, strong or mild (then wider still, to hold clean units beside them), and the split's dtype
    (fp16 takes the mild form of strong ones)."""
    base = draw(strategy(arch, limits))
    config = dict(base.config)
    level = draw(st.sampled_from(("none", "strong", "mild")))
    for key in ("intermediate_size", "shared_expert_intermediate_size"):  # channel units of 64 for the ANE to take
        if config.get(key):
            config[key] = draw(st.sampled_from(WIDTHS if level != "none" else (128, 256, 512)))
    spec = outliers(draw, config, level) if level != "none" else None
    out = Draw(**{**base.__dict__, "config": config, "outliers": spec, "dtype": draw(st.sampled_from(DTYPE_NAMES))})
    return milder(out) if out.dtype == "float16" else out


# ---------------------------------------------------------------------------------------------------------------
# The released configs, scaled down with their ratios kept


def _released_text(config: dict) -> dict:
    return config.get("text_config") or config


def scale_down(config: dict) -> dict:
    """A released text config at tiny sizes with its ratios kept: query heads per KV head, value heads per key head,
    the attention's and the MLPs' widths against the hidden size, the rotary share of a head, the indexer's dimension against the
    rotary one, the layer pattern (two periods), the experts' top-k share (at least 2 of at least 8), the budget in
    blocks."""
    t = _released_text(config)
    kv = t["num_key_value_heads"]
    head_dim = 32
    heads = t["num_attention_heads"] // kv * min(kv, 2)
    width = t["num_attention_heads"] * t["head_dim"] / t["hidden_size"]  # 2 for Qwen3.5-35B-A3B, 1.2 for 27B
    hidden = 32 * max(2, round(heads * head_dim / width / 32))
    rope = dict(t.get("rope_parameters") or {"rope_type": "default", "rope_theta": t.get("rope_theta", 1e7),
                                              "partial_rotary_factor": t.get("partial_rotary_factor", 0.25)})
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if "mrope_section" in rope:
        half, full = rotary // 2, sum(rope["mrope_section"])
        t_, h_ = (s * half // full for s in rope["mrope_section"][:2])
        rope["mrope_section"] = [t_, h_, half - t_ - h_]
    interval = t.get("full_attention_interval", 4)
    attention = "indexed_attention" if t.get("model_type", "").startswith("qwen4") else "full_attention"
    out = dict(vocab_size=128, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=min(kv, 2),
               head_dim=head_dim,
               linear_num_key_heads=2, linear_num_value_heads=2 * t["linear_num_value_heads"] // t["linear_num_key_heads"],
               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
               num_hidden_layers=2 * interval,
               layer_types=[attention if (i + 1) % interval == 0 else "linear_attention" for i in range(2 * interval)],
               rope_parameters=rope, rms_norm_eps=t.get("rms_norm_eps", 1e-6),
               tie_word_embeddings=t.get("tie_word_embeddings", False), eos_token_id=EOS, pad_token_id=None,
               bos_token_id=None)
    scaled = lambda width: 32 * max(1, round(width * hidden / t["hidden_size"] / 32))  # noqa: E731  its share kept
    if t.get("intermediate_size"):
        out["intermediate_size"] = scaled(t["intermediate_size"])
    if t.get("num_experts"):
        experts = 8 if t["num_experts"] <= 256 else 16
        out.update(num_experts=experts, num_experts_per_tok=max(2, t["num_experts_per_tok"] * experts // t["num_experts"]),
                   moe_intermediate_size=scaled(t["moe_intermediate_size"]),
                   shared_expert_intermediate_size=scaled(t["shared_expert_intermediate_size"]))
        if "norm_topk_prob" in t:
            out["norm_topk_prob"] = t["norm_topk_prob"]
    if attention == "indexed_attention":
        ratio = t["indexer_compress_ratio"]
        out.update(hc_count=t["hc_count"], hc_lowrank=8, ple_layer_ids=t.get("ple_layer_ids", []),
                   ple_embed_dim=2 * (t["ngram_size"] - 1) * 2, ngram_size=t["ngram_size"], heads_per_ngram=2,
                   ngram_vocab_size_base=97, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2,
                   ple_conv_kernel_size=t.get("ple_conv_kernel_size", 4), indexer_n_heads=t["indexer_n_heads"],
                   indexer_kv_heads=1, indexer_head_dim=rotary * t["indexer_head_dim"] // int(
                       t["head_dim"] * rope.get("partial_rotary_factor", 1.0)),
                   indexer_compress_ratio=ratio, indexer_budget=4 * ratio, output_gate_type=t.get("output_gate_type",
                                                                                                   "sigmoid"),
                   norm_topk_prob=t.get("norm_topk_prob", True))
    return out


def released_configs() -> dict[str, tuple[str, dict]]:
    """{name: (arch, the released config scaled down)} for each released config this machine holds."""
    files = sorted(REFERENCE.glob("*.json")) + ([FLASH_NEXT] if FLASH_NEXT.is_file() else [])
    out = {}
    for file in files:
        config = json.loads(file.read_text())
        t = _released_text(config)
        arch = {"qwen3_next": "qwen3_next_moe" if t.get("num_experts") else "qwen3_next"}.get(config["model_type"],
                                                                                           config["model_type"])
        out[file.stem if file != FLASH_NEXT else "qwen4-flash-next"] = (arch, scale_down(config))
    return out


RELEASED = released_configs()


@st.composite
def released(draw, arch: str, limits: Limits = FULL) -> Draw:
    """A released config of `arch` scaled down (its name in `source`), with a drawn prompt, seed and weights."""
    names = sorted(n for n, (a, _) in RELEASED.items() if a == ALIASES.get(arch, arch))
    name = draw(st.sampled_from(names))
    config = dict(RELEASED[name][1])
    lengths = _qsa_lengths(config) if "indexer_budget" in config else EDGES
    vision = None
    if arch in NESTED:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                      spatial_merge_size=2, num_position_embeddings=16, out_hidden_size=config["hidden_size"])
    return _case(draw, arch, config, limits, lengths=lengths, vision=vision, source=f"released:{name}")


# flat layouts of a released nested architecture take its released configs
ALIASES = {"qwen3_5_text": "qwen3_5", "qwen4_exp_text": "qwen4_exp"}


def with_released(arch: str, drawn: st.SearchStrategy, limits: Limits) -> st.SearchStrategy:
    """`drawn`, and one draw in four a released config of `arch` (where one exists)."""
    if not any(a == ALIASES.get(arch, arch) for a, _ in RELEASED.values()):
        return drawn
    return st.one_of(drawn, drawn, drawn, released(arch, limits))


DRAWN = {"qwen3_5_text": qwen3_5_flat, "qwen3_5": qwen3_5_nested, "qwen3_5_moe": qwen3_5_moe,
         "qwen3_next": qwen3_next_dense, "qwen3_next_moe": qwen3_next_moe, "qwen4_exp_text": qwen4_flat,
         "qwen4_exp": qwen4_nested, "vision": vision_tower}
ARCHITECTURES = tuple(DRAWN)


def strategy(arch: str, limits: Limits = FULL) -> st.SearchStrategy:
    """The draws of `arch`: its config space within `limits`, and its released configs scaled down."""
    return with_released(arch, DRAWN[arch](limits), limits)
