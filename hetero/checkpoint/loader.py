"""Finding a checkpoint, checking it before any weight is read, and loading it into a `Model`.

The pre-flight check reads only config.json, the safetensors index and the shards' headers (8 bytes + JSON),
builds the model lazily (MLX allocates nothing until evaluation) to learn every parameter's name and shape,
and maps the checkpoint's tensors onto it. Anything that would fail to load is reported, one line each.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from hetero.checkpoint.config_checks import check_config
from hetero.checkpoint.headers import TensorInfo, norms_zero_centred, read_header
from hetero.errors import HeteroError
from hetero.models.args import SUPPORTED_MODEL_TYPES
from hetero.models.fused import fuse
from hetero.models.qwen3_5 import Model, ModelArgs
from hetero.models.qwen4_exp import model as qwen4
from hetero.models.qwen4_exp.args import MODEL_TYPES as QWEN4_TYPES, Qwen4Args
from hetero.models.weights import ExpertStacker, canonical_name, checkpoint_has_mtp, is_expert_tensor, sanitize, unfused_names

BUNDLED_MODEL = Path(__file__).parents[1] / "bundled"
SMALL_FILES = ["config.json", "generation_config.json", "*.index.json", "tokenizer*", "chat_template.jinja"]
FLOAT_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
ST_DTYPES = {**FLOAT_DTYPES, "U32": mx.uint32}


# ----------------------------------------------------------------------------------------------------------
# Where the files are


def is_hub_id(model: str) -> bool:
    return "/" in model and not Path(model).exists() and not model.startswith((".", "/", "~")) and model.count("/") == 1


def resolve(model: str | os.PathLike | None, weights: bool = True) -> Path:
    """A local directory for `model` (a path, a hub id, or None for the bundled model).

    For a hub id only the small files are fetched when `weights` is False; the hub library honours
    HF_HUB_OFFLINE and answers from its local cache.
    """
    if model is None:
        return BUNDLED_MODEL
    model = str(model)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise HeteroError(f"--model {model} is a file; pass the checkpoint directory that holds config.json")
    if not is_hub_id(model):
        raise HeteroError(f"--model {model}: no such directory, and not a hub id of the form org/name")
    from huggingface_hub import snapshot_download

    patterns = SMALL_FILES + (["*.safetensors"] if weights else [])
    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as e:  # the hub library raises many types; the user needs one line
        offline = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise HeteroError(
            f"could not fetch {model} from the hub{offline}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            f"; pass a local checkpoint directory instead"
        ) from None


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise HeteroError(f"{file} is missing: a checkpoint directory needs config.json")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as e:
        raise HeteroError(f"{file} is not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__}); re-download it") from None
    except OSError as e:
        raise HeteroError(f"cannot read {file}: {e.strerror}") from None
    check_config(config, str(file))
    # a supported architecture's sizes must all be there; other model types are refused by name later
    return check_config(config, str(file), required=config.get("model_type") in SUPPORTED_MODEL_TYPES)


def check_generation_config(path: Path) -> None:
    """generation_config.json, when present and JSON, must be an object with token ids where ids go."""
    file = path / "generation_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    except (ValueError, UnicodeDecodeError, RecursionError):
        return  # unreadable: the engine ignores it (config.json and the tokenizer still name EOS)
    if not isinstance(config, dict):
        raise HeteroError(f"{file} must hold a JSON object, got a JSON {type(config).__name__}; fix or delete it")
    check_config({"eos_token_id": config.get("eos_token_id")}, str(file))


# ----------------------------------------------------------------------------------------------------------
# The pre-flight check


@dataclass
class Preflight:
    """What `hetero check` reports; `errors` empty means the checkpoint will load."""

    path: str
    model_type: str | None = None
    architecture: str | None = None
    supported: bool = False
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    shape_mismatches: list[str] = field(default_factory=list)
    n_tensors: int = 0
    total_bytes: int = 0
    peak_memory_bytes: int = 0
    has_mtp: bool = False
    mtp_folder: str | None = None  # where the MTP head is read from when not the checkpoint (mlx-vlm's drafter)
    quantization: dict | None = None
    shapes_checked: bool = False
    experts: int = 0  # routed experts per MoE layer (0: dense model)
    experts_per_token: int = 0
    shared_experts: int = 0  # per MoE layer (a gated shared expert: 1)
    moe_layers: int = 0  # backbone layers with a mixture-of-experts MLP
    layers: int = 0
    ple_layers: list[int] = field(default_factory=list)  # Qwen4-Exp layers with PLE n-gram tables (0-based)
    ple_table_params: int = 0  # their tables' parameters, all layers together

    @property
    def ok(self) -> bool:
        return not (self.errors or self.unmapped or self.missing or self.shape_mismatches)

    def first_problem(self) -> str:
        """The one line that says why loading would fail."""
        if self.errors:
            return self.errors[0]
        if self.unmapped:
            more = f" (and {len(self.unmapped) - 1} more)" if len(self.unmapped) > 1 else ""
            return (
                f"tensor {self.unmapped[0]!r} does not map onto a {self.model_type} model{more}: the checkpoint "
                f"follows another naming convention; run `hetero check --model {self.path}` for the full list"
            )
        if self.missing:
            more = f" (and {len(self.missing) - 1} more)" if len(self.missing) > 1 else ""
            return f"no tensor for parameter {self.missing[0]}{more}: the checkpoint is incomplete"
        return f"shape mismatch: {self.shape_mismatches[0]}"

    def lines(self) -> list[str]:
        """Human-readable report, one fact per line."""
        gb = lambda b: f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"  # noqa: E731
        status = "supported" if self.supported else "NOT supported"
        out = [f"model: {self.path}", f"architecture: {self.architecture or '?'} (model_type {self.model_type}): {status}"]
        if self.quantization:
            out.append(f"quantization: {self.quantization.get('bits')}-bit, group size {self.quantization.get('group_size')}")
        out.append(f"tensors: {self.n_tensors}, {gb(self.total_bytes)} on disk" + ("" if self.shapes_checked else " (shapes not checked: shards not local)"))
        if self.peak_memory_bytes:
            out.append(f"estimated peak memory: {gb(self.peak_memory_bytes)}")
        mtp = f"present, read from mlx-vlm's drafter folder {self.mtp_folder}" if self.mtp_folder else "present"
        out.append(f"MTP head: {mtp if self.has_mtp else 'absent (speculative decoding unavailable)'}")
        if self.experts:
            shared = f" + {self.shared_experts} shared" if self.shared_experts else ""
            out.append(f"experts: {self.experts} routed{shared}, {self.experts_per_token} active per token, "
                       f"mixture-of-experts MLP in {self.moe_layers} of {self.layers} layers")
        if self.ple_layers:
            out.append(f"PLE n-gram tables: {self.ple_table_params:,} parameters in all, on layers {self.ple_layers}")
        out += [f"error: {e}" for e in self.errors]
        out += [f"unmapped tensor: {n}" for n in self.unmapped]
        out += [f"missing parameter: {n}" for n in self.missing]
        out += [f"shape mismatch: {m}" for m in self.shape_mismatches]
        out += [f"warning: {w}" for w in self.warnings]
        out.append("result: OK, will load" if self.ok else "result: FAIL, will not load")
        return out

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d["ok"] = self.ok
        return d


def checkpoint_tensors(path: Path) -> tuple[dict[str, TensorInfo], list[str]]:
    """Every tensor the checkpoint declares (name -> info) and the shards that are not on disk.

    Reads the index and the headers of local shards; never tensor data. Tensors of absent shards come from
    the index with unknown dtype and shape.
    """
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _weight_map(index_file)
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        weight_map = {}
        if not shards:
            raise HeteroError(f"{path} holds no model.safetensors and no model.safetensors.index.json")
    absent = [s for s in shards if not (path / s).is_file()]
    tensors = {n: TensorInfo(n, "?", (), f, 0) for n, f in weight_map.items() if f in absent}
    for shard in shards:
        if shard in absent:
            continue
        header = read_header(path / shard)
        for name, f in weight_map.items():
            if f == shard and name not in header:
                raise HeteroError(f"tensor {name} is listed for {shard} in the index but that file does not hold it")
        tensors.update(header)
    drafter = mtp_drafter(path)
    if drafter is not None and not checkpoint_has_mtp(tensors):
        for file in sorted(drafter.glob("*.safetensors")):
            tensors.update({f"mtp.{n}": replace(t, name=f"mtp.{n}", file=os.path.relpath(file, path))
                            for n, t in read_header(file).items()})
    return tensors, absent


def mtp_drafter(path: Path) -> Path | None:
    """The MTP head's folder that mlx-vlm writes beside a Qwen4-Exp checkpoint it converts (`mlx_vlm convert --mtp`:
    `<dir>-mtp`, config model_type `qwen4_exp_mtp`, the head's tensors without their `mtp.` prefix), or None. A
    checkpoint without `mtp.*` tensors reads its head from there. (mlx-vlm's drafters of other families are not
    read: their names are untested here.)"""
    folder = drafter_path(path)
    try:
        kind = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return folder if kind == "qwen4_exp_mtp" else None


def drafter_path(path: Path) -> Path:
    """Where mlx-vlm puts the MTP drafter of the checkpoint at `path`: `<path>-mtp`, beside it."""
    return path.with_name(path.name + "-mtp")


def _weight_map(index_file: Path) -> dict[str, str]:
    """The index's tensor name -> shard file map, checked to be exactly that."""
    try:
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError, KeyError, TypeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
        raise HeteroError(f"{index_file} is not a valid safetensors index (no weight_map of tensor -> file); re-download it")
    return weight_map


def parse_args(config: dict) -> ModelArgs | Qwen4Args:
    """config.json -> the arguments of its architecture (Qwen4-Exp or the Qwen3.5 family); HeteroError if neither."""
    return Qwen4Args.from_config(config) if config.get("model_type") in QWEN4_TYPES else ModelArgs.from_config(config)


def sanitize_for(args: ModelArgs | Qwen4Args, weights: dict[str, mx.array], zero_centred: bool = True
                 ) -> dict[str, mx.array]:
    """Checkpoint tensors -> parameters, by the architecture's own `sanitize`; `zero_centred`: the checkpoint's
    norm form where no GDN conv tells it (`norms_zero_centred`)."""
    fix = qwen4.sanitize if isinstance(args, Qwen4Args) else sanitize
    return fix(args, weights, zero_centred)


def build_lazy_model(args: ModelArgs | Qwen4Args, with_mtp: bool, quantized_names: set[str] | None = None) -> Model:
    """The model with lazily initialised parameters (no memory until evaluated)."""
    model = (qwen4.Model if isinstance(args, Qwen4Args) else Model)(args, with_mtp=with_mtp)
    q = args.quantization
    if q:
        names = quantized_names or set()
        layers = {canonical_name(k): v for k, v in q.items() if isinstance(v, dict)}  # per-layer (mlx-lm: 8-bit routers)
        nn.quantize(
            model,
            group_size=q.get("group_size", 64),
            bits=q.get("bits", 4),
            class_predicate=lambda p, m: p in names and layers.get(p, True),
        )
    return model


def preflight(model: str | os.PathLike | None, dtype: mx.Dtype | None = None, context: int = 4096) -> Preflight:
    """Check a checkpoint without reading weights; never raises for problems in the checkpoint itself."""
    report = Preflight(path=str(model) if model is not None else "bundled model")
    try:
        path = resolve(model, weights=False)
        config = read_config(path)
        report.model_type = config.get("model_type")
        report.architecture = ", ".join(config.get("architectures") or []) or None
        args = parse_args(config)
        check_generation_config(path)
        report.quantization = args.quantization
        report.layers = args.num_hidden_layers
        if args.moe_layers:
            report.experts, report.experts_per_token = args.num_experts, args.num_experts_per_tok
            report.shared_experts, report.moe_layers = 1, len(args.moe_layers)
        if isinstance(args, Qwen4Args):
            report.ple_layers = [i - 1 for i in args.ple_layer_ids]
        report.supported = True
        tensors, absent = checkpoint_tensors(path)
    except HeteroError as e:
        report.errors.append(str(e))
        return report
    report.shapes_checked = not absent
    if absent and not is_hub_id(str(model)):
        report.errors += [f"shard {s} is listed in model.safetensors.index.json but missing from {path}" for s in absent]
    report.n_tensors = len(tensors)
    report.total_bytes = sum(t.nbytes for t in tensors.values())
    report.has_mtp = checkpoint_has_mtp(tensors)
    if args.mtp_num_hidden_layers and not report.has_mtp:
        drafter = (f", nor is there an mlx-vlm drafter folder at {drafter_path(path)} (`mlx_vlm convert --mtp` "
                   "writes it)" if isinstance(args, Qwen4Args) else " (converted without it?)")
        report.warnings.append(f"config declares an MTP head but the checkpoint has no mtp.* tensors{drafter}: "
                               "plain decoding only")
    drafter_folder = mtp_drafter(path)
    if drafter_folder is not None and any(os.path.normpath(path / t.file).startswith(str(drafter_folder) + os.sep)
                                          for t in tensors.values()):  # the head's tensors were read from there
        report.mtp_folder = str(drafter_folder)
    bad_dtype = [t for t in tensors.values() if report.shapes_checked and t.dtype not in ST_DTYPES
                 and not qwen4.is_hash_buffer(t.name)]
    for t in bad_dtype:
        report.errors.append(f"tensor {t.name} in {t.file} has dtype {t.dtype}; hetero loads F32, F16, BF16 (and U32 quantized) weights")

    quantized = {u for n in tensors for u in unfused_names(canonical_name(n) or n)}  # per-expert: their switch_mlp
    quantized = {n[: -len(".scales")] for n in quantized if n.endswith(".scales")}
    try:
        expected = dict(tree_flatten(build_lazy_model(args, report.has_mtp, quantized).parameters()))
    except (OverflowError, ValueError) as e:  # sizes each in range whose products are not (MLX dims are 32-bit)
        report.errors.append(f"config.json's sizes give a parameter MLX cannot hold ({e}); fix or re-download config.json")
        return report
    expected_shapes = {k: tuple(v.shape) for k, v in expected.items()}

    if report.shapes_checked:
        placeholders = {n: mx.zeros(t.shape, dtype=ST_DTYPES.get(t.dtype, mx.float32)) for n, t in tensors.items()}
        try:
            mapped = {k: tuple(v.shape) for k, v in sanitize_for(args, placeholders).items()}
        except HeteroError as e:  # experts missing or beyond num_experts
            report.errors.append(str(e))
            return report
        except ValueError as e:  # a fused projection whose shape cannot be split, experts of different shapes
            report.shape_mismatches.append(f"fused GDN projections or stacked experts do not match the config's sizes ({e})")
            return report
    else:
        mapped = {}
        for n in tensors:
            c = canonical_name(n)
            if c is not None and not (args.tie_word_embeddings and c == "lm_head.weight"):
                mapped.update({u: None for u in unfused_names(c)})
    reverse = {}
    for n in tensors:
        c = canonical_name(n)
        for u in unfused_names(c) if c else []:
            reverse[u] = re.sub(r"\.experts\.\d+\.", ".experts.*.", n) if is_expert_tensor(c) else n  # stacked: all experts
    report.unmapped = sorted(reverse.get(k, k) for k in mapped if k not in expected_shapes)
    report.missing = sorted(k for k in expected_shapes if k not in mapped)
    for k, shape in mapped.items():
        if shape is not None and k in expected_shapes and shape != expected_shapes[k]:
            report.shape_mismatches.append(f"{reverse.get(k, k)}: checkpoint {list(shape)}, config expects {list(expected_shapes[k])}")
    report.ple_table_params = sum(v.size for k, v in expected.items() if k.endswith("ngram_embedding.weight"))
    report.peak_memory_bytes = estimate_peak_memory(args, expected, dtype or default_dtype(), context)
    return report


# The compute dtypes a model loads in (`--dtype`), by name.
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_chosen: list[mx.Dtype] = []  # dtypes chosen by `using_dtype`, innermost last


def platform_dtype() -> mx.Dtype:
    """fp32 on the CPU (half-precision matmuls are far slower there), bf16 on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


def default_dtype() -> mx.Dtype:
    """The dtype a model loads in when none is given: the one `using_dtype` chose (a command's `--dtype`), else
    the platform's (`platform_dtype`)."""
    return _chosen[-1] if _chosen else platform_dtype()


@contextmanager
def using_dtype(dtype: mx.Dtype | None) -> Iterator[None]:
    """Load models in `dtype` inside the block (None: no change), also where a caller passes no dtype (the
    server's and the pipelined ranks' loads)."""
    if dtype is None:
        yield
        return
    _chosen.append(dtype)
    try:
        yield
    finally:
        _chosen.pop()


def dtype_name(dtype: mx.Dtype) -> str:
    """"bfloat16" for mx.bfloat16: the name `--dtype` takes."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def parse_dtype(name: str) -> mx.Dtype:
    """A `--dtype` name -> the mx.Dtype; any other name is a HeteroError naming the choices."""
    if name not in DTYPES:
        raise HeteroError(f"dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def estimate_peak_memory(args: ModelArgs, params: dict[str, mx.array], dtype: mx.Dtype, context: int, chunk: int = 512) -> int:
    """Loaded weights + KV cache for `context` tokens + GDN state + one prefill chunk's transient buffers."""
    weights = sum(v.size * (v.dtype.size if v.dtype == mx.uint32 or not mx.issubdtype(v.dtype, mx.floating) else dtype.size) for v in params.values())
    n_attn = len(args.layer_types) - args.layer_types.count("linear_attention") + args.mtp_num_hidden_layers
    kv = n_attn * 2 * args.num_key_value_heads * args.head_dim * context * dtype.size
    gdn = args.layer_types.count("linear_attention") * args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    conv = 2 * args.linear_num_key_heads * args.linear_key_head_dim + args.linear_num_value_heads * args.linear_value_head_dim
    mlp = max(args.intermediate_size, args.num_experts_per_tok * args.moe_intermediate_size + args.shared_expert_intermediate_size)
    transient = chunk * 4 * (6 * args.hidden_size + 3 * mlp + 2 * conv + args.vocab_size)
    return int(weights + kv + gdn + transient)


# ----------------------------------------------------------------------------------------------------------
# Loading


def load_weights(path: Path, args: ModelArgs | None = None) -> dict[str, mx.array]:
    """All tensors of a checkpoint (after the pre-flight check vouched for the files), under canonical names,
    skipped ones (vision) left out.

    `mx.load` maps tensors lazily. Per-expert tensors (`...mlp.experts.{e}.*`, with `args`) are stacked into
    their `switch_mlp` parameter and evaluated as soon as a projection's experts have all been read, shard by
    shard, so the peak holds the stacked experts plus one projection's worth of single ones, never the whole
    model twice.
    """
    index = path / "model.safetensors.index.json"
    shards = sorted(set(_weight_map(index).values())) if index.is_file() else sorted(
        p.name for p in path.glob("*.safetensors")
    )
    stacker = ExpertStacker(args.num_experts) if args is not None and args.num_experts else None
    weights: dict[str, mx.array] = {}

    def read(file: Path, prefix: str) -> None:
        try:
            tensors = mx.load(str(file))
        except (RuntimeError, ValueError) as e:
            raise HeteroError(f"cannot read {file}: {e}; re-download it") from None
        for key in list(tensors):
            value = tensors.pop(key)  # the shard's dict must not keep a stacked expert's single tensors alive
            name = canonical_name(prefix + key)
            if name is None:
                continue
            if stacker is None or not is_expert_tensor(name):
                weights[name] = value
            elif (done := stacker.add(name, value)) is not None:
                mx.eval(done[1])  # reads this projection's experts now; their single tensors are dropped
                weights[done[0]] = done[1]

    for shard in shards:
        read(path / shard, "")
    drafter = mtp_drafter(path)
    if drafter is not None and not checkpoint_has_mtp(weights):  # mlx-vlm's drafter folder: the head, unprefixed
        for file in sorted(drafter.glob("*.safetensors")):
            read(file, "mtp.")
    if stacker is not None:
        stacker.check_complete()
    return weights


def load_model(model: str | os.PathLike | None = None, dtype: mx.Dtype | None = None,
               fuse_projections: bool = True) -> tuple[Model, Path, dict]:
    """Check, then load a checkpoint: returns (model with evaluated weights, local directory, config dict).

    With `fuse_projections` (the default) each layer's input projections become one product (`models.fused`); the
    parameters keep the checkpoint's names either way. Load without it to change parameters afterwards (quantize).
    """
    report = preflight(model, dtype)
    if not report.ok:
        raise HeteroError(report.first_problem())
    path = resolve(model, weights=True)
    config = read_config(path)
    args = parse_args(config)
    weights = sanitize_for(args, load_weights(path, args), norms_zero_centred(path))
    quantized = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    net = build_lazy_model(args, checkpoint_has_mtp(weights), quantized)
    if isinstance(args, Qwen4Args):  # the PLE n-gram tables stay in their files: a chunk gathers its rows
        qwen4.keep_ple_on_disk(net, weights, path, checkpoint_tensors(path)[0])
    net.load_weights(list(weights.items()), strict=True)
    dtype = dtype or default_dtype()
    net.set_dtype(dtype, lambda t: mx.issubdtype(t, mx.floating))
    for i, layer in enumerate(net.layers):  # the decay parameters stay fp32: exp(A_log) feeds the recurrence
        if layer.is_linear:
            layer.linear_attn.A_log = weights[f"model.layers.{i}.linear_attn.A_log"].astype(mx.float32)
    mx.eval(net.parameters())
    net.eval()
    del weights  # the loaded tensors: fusing replaces them with views of the products, one layer at a time
    if fuse_projections:
        fuse(net)
    return net, path, config
