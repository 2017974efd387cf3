"""`hetero` command line: run, check, tune, serve, convert."""

from __future__ import annotations

import argparse
import json
import os
import sys

from hetero import __version__, distributed
from hetero.errors import HeteroError, internal_error
from hetero.settings import DEFAULT_DRAFT_DEPTH
from hetero.decode.depth import DEPTH
from hetero.validate import (
    GPU_ONLY, MIN_P, NONNEG, PORT, POSITIVE, POSITIVE_INT, SEED, TEMPERATURE, TOP_K, TOP_P, AneSplit, Bound,
    ane_split_arg, check_config, decode_utf8, read_prompt,
)

HALF = AneSplit(0.5)  # the split `hetero plan` and `hetero doctor` take when none is given


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 1, like every other user error) and defaults shown in help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """Print what is wrong on one line and where to look, then exit 1 (argparse's own way is usage + exit 2)."""
        self.exit(1, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends '(default: X)' to each option's help unless the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
            return text  # flags are off unless given; None defaults are explained in the help itself
        return f"{text} (default: %(default)s)"


def token_counts(text: str) -> str:
    """argparse type for --context lists: comma-separated integers >= 1 (kept as given; the exporter splits it)."""
    parts = [c.strip() for c in text.split(",") if c.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("give one or more token counts separated by commas")
    for c in parts:
        POSITIVE_INT(c)
    return text


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory or hub id (default: the bundled model)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")


def dtype_arg(text: str):
    """argparse type for --dtype: a dtype name -> mx.Dtype (a bad name: one line naming the choices)."""
    from hetero.loader import parse_dtype

    try:
        return parse_dtype(text)
    except HeteroError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_dtype(p: argparse.ArgumentParser) -> None:
    """--dtype, the one parser of it for every command that loads a model to compute with."""
    from hetero.loader import DTYPES, dtype_name, platform_dtype

    p.add_argument("--dtype", type=dtype_arg, default=dtype_name(platform_dtype()), metavar="{" + ",".join(DTYPES) + "}",
                   help="compute dtype the model loads in (the platform's: float32 on a CPU, bfloat16 on a GPU; "
                   "the ANE lane computes fp16 whatever it is)")


def build_parser() -> argparse.ArgumentParser:
    from hetero.verify_tolerance import tolerance_table

    parser = Parser(prog="hetero", description="Fast hybrid-LLM inference on Apple Silicon.")
    parser.add_argument("--version", action="version", version=f"hetero {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="generate text for a prompt")
    run.set_defaults(func=cmd_run)
    _add_model(run)
    _add_dtype(run)
    run.add_argument("--prompt", required=True, help="prompt text, or - to read it from stdin")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--max-tokens", type=POSITIVE_INT, default=256, help="most tokens to generate")
    run.add_argument("--temp", type=TEMPERATURE, default=0.0, help="sampling temperature (0 = greedy)")
    run.add_argument("--top-p", type=TOP_P, default=1.0, help="nucleus sampling: keep the most likely tokens up to this mass")
    run.add_argument("--top-k", type=TOP_K, default=0, help="keep the k most likely tokens; 0 disables top-k")
    run.add_argument("--min-p", type=MIN_P, default=0.0, help="drop tokens below this share of the most likely one's probability")
    run.add_argument("--seed", type=SEED, default=None, help="random seed for sampling (default: a fresh random seed)")
    run.add_argument("--prefill-chunk", type=POSITIVE_INT, default=512, help="prompt tokens per prefill step")
    run.add_argument("--no-mtp", action="store_true", help="plain decoding (no speculative MTP drafts)")
    run.add_argument("--draft-depth", type=DEPTH, default=None,
                     help=f"MTP draft tokens per step (default: tuned, else calibrated, else {DEFAULT_DRAFT_DEPTH})")
    run.add_argument("--no-copy", action="store_true", help="no copy-lane drafts from n-grams of the context")
    run.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead of streaming")
    run.add_argument("--memory-gb", type=POSITIVE, help="RAM the memory governor budgets (default: this machine's)")
    run.add_argument("--ane-fraction", type=ane_split_arg, default=GPU_ONLY,
                     help="split prefill: share F of each offloadable piece for the ANE lane, "
                     "or 'auto' (this machine's measured profile, verified on a calibration prompt); 0 or default: GPU-only")
    run.add_argument("--verify", action="store_true", help="with --ane-fraction: rerun GPU-only and compare; under "
                     "mlx.launch: rerun in one process on rank 0 and compare; exit 3 on mismatch")
    run.add_argument("--verify-tol", type=NONNEG, default=None,
                     help="largest max|split - GPU-only| / max|GPU-only| over the last logits and every cache array "
                     "that still matches (default: the dtype's, measured against float64: "
                     + ", ".join(f"{k} {v:g}" for k, v in tolerance_table().items()) + ")")
    run.add_argument("--verify-tokens", type=POSITIVE_INT, default=32, help="greedy tokens that must be identical")
    run.add_argument("--trace", metavar="FILE",
                     help="with --ane-fraction: write a Chrome trace (one track per device; default: no trace)")
    run.add_argument("--dist-timeout", type=POSITIVE, default=60.0, metavar="S",
                     help="under mlx.launch (layers split across ranks): seconds without progress from the other "
                     "ranks (or to connect) before a rank stops with an error")

    check = sub.add_parser("check", help="pre-flight check of a checkpoint without loading weights")
    check.set_defaults(func=cmd_check)
    _add_model(check)
    check.add_argument("--context", type=POSITIVE_INT, default=4096, help="context length for the peak-memory estimate")
    check.add_argument("--json", action="store_true", help="print the report as JSON")

    tune = sub.add_parser("tune", help="measure plain decoding and MTP draft depths here; save the fastest")
    tune.set_defaults(func=cmd_tune)
    _add_model(tune)
    _add_dtype(tune)
    tune.add_argument("--tokens", type=POSITIVE_INT, default=256, help="tokens decoded per prompt and setting")
    tune.add_argument("--devices", action="store_true",
                      help="measure the GPU lane (MLX) and the ANE lane (with --model: at its shapes); save them as "
                           "the this-machine profile")

    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server with a prefix cache")
    serve.set_defaults(func=cmd_serve)
    _add_model(serve)
    _add_dtype(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=PORT, default=8080, help="TCP port to listen on")
    serve.add_argument("--api-key", default=os.environ.get("HETERO_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $HETERO_API_KEY, else no key)")
    serve.add_argument("--served-model-name", help="another name clients may use in 'model' (default: only the model's own name)")
    serve.add_argument("--prefix-cache-max-gb", type=NONNEG, default=2.0, help="RAM for prefix-cache checkpoints")
    serve.add_argument("--session-cache", metavar="DIR", help="on-disk session cache (default: ~/.cache/hetero/sessions)")
    serve.add_argument("--session-cache-max-gb", type=NONNEG, default=16.0, help="disk for the session cache")
    serve.add_argument("--no-session-cache", action="store_true", help="keep checkpoints in RAM only")
    serve.add_argument("--ane-fraction", type=ane_split_arg, default=GPU_ONLY,
                       help="split each prompt's prefill: share F for the ANE lane, or 'auto' (0 or default: GPU-only)")
    serve.add_argument("--draft-depth", type=DEPTH, default=None,
                       help="every MTP request's draft tokens per step (default: tuned, else calibrated at start-up)")
    serve.add_argument("--prefill-chunk", type=POSITIVE_INT, default=512, help="prompt tokens per prefill step (and per turn)")
    serve.add_argument("--max-concurrent", type=POSITIVE_INT, default=4,
                       help="requests generating at once, taking turns on the model (more wait in line)")
    serve.add_argument("--default-max-tokens", type=POSITIVE_INT, default=4096,
                       help="max_tokens of an OpenAI request that leaves it out (capped by the context window)")
    serve.add_argument("--max-body-mb", type=POSITIVE, default=32.0,
                       help="largest request body in MB; a larger one gets a 413")
    serve.add_argument("--decode-share", type=Bound(0, 1, hi_open=True), default=0.8,
                       help="share of the model's time that decoding requests keep while another prompt prefills "
                            "(0: chunk for chunk, round-robin)")
    serve.add_argument("--max-batch", type=POSITIVE_INT, default=1,
                       help="decoding requests that share each decode pass (1: each decodes in its own turns)")
    serve.add_argument("--dist-timeout", type=POSITIVE, default=60.0, metavar="S",
                       help="under mlx.launch (layers split across ranks, rank 0 serving HTTP): seconds without "
                       "progress from the other ranks during a request (or to connect) before a rank stops with an error")
    serve.add_argument("--model-alias", action="append", metavar="PATTERN=NAME",
                       help="serve requests whose 'model' matches PATTERN (shell wildcards, e.g. 'claude-*') with the "
                            "model NAME; replies report the name asked (repeatable)")
    serve.add_argument("--reject-images", action="store_true",
                       help="refuse an image in a text-only model's conversation with a 400 (default: a text "
                            "placeholder stands in for it, with an x-hetero-warning header)")

    plan = sub.add_parser("plan", help="plan the ANE/GPU split of prefill, predict its time, resolve the context window")
    plan.set_defaults(func=cmd_plan)
    _add_model(plan)
    plan.add_argument("--profile", help="hardware profile (m4-pro, m3-ultra, m5-max, ..., this-machine; "
                      "default: this-machine when `hetero tune --devices` has measured it, else m4-pro)")
    plan.add_argument("--ane-fraction", type=ane_split_arg, default=HALF,
                      help="requested ANE share of each offloadable piece (0: GPU-only)")
    plan.add_argument("--recommend", action="store_true", help="pick the fraction that balances both devices")
    plan.add_argument("--pieces", metavar="KINDS",
                      help="comma-separated piece kinds that take the ANE share (attention, mlp, gdn_in_proj or z, "
                           "shared_expert; all: every kind; default: those whose share shortens the predicted prefill); "
                           "the others stay whole on the GPU")
    plan.add_argument("--context", type=POSITIVE_INT, help="context length in tokens (default: min(32768, model maximum))")
    plan.add_argument("--chunk", type=POSITIVE_INT, default=512, help="prefill chunk in tokens (multiple of 64)")
    plan.add_argument("--prompt-tokens", type=POSITIVE_INT, help="prompt length for the TTFT prediction (default: the context)")
    plan.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8, 16],
                      help="weight bits when the config has no quantization (default 16)")
    plan.add_argument("--group-size", type=int, choices=[32, 64, 128], help="quantization group size (default 64)")
    plan.add_argument("--memory-gb", type=POSITIVE,
                      help="RAM to budget: prints the budget and the largest context window (default: no budget)")
    plan.add_argument("--accepted-length", type=Bound(1), default=2.5, help="MTP tokens per verify pass for the decode estimate")
    plan.add_argument("--draft-depth", type=DEPTH, default=DEFAULT_DRAFT_DEPTH, help="MTP draft depth for the decode estimate")
    plan.add_argument("--hosts", type=POSITIVE_INT,
                      help="also plan a pipeline over N hosts: the layer split, memory per host, pipelined prefill and "
                      "decode (default: one host, no pipeline section)")
    plan.add_argument("--link-gbps", type=POSITIVE, help="with --hosts: the link's usable bandwidth in Gb/s "
                      "(default: the profile's; unknown when it has none)")
    plan.add_argument("--link-latency-ms", type=NONNEG, help="with --hosts: a message's fixed cost over the link in ms "
                      "(default: the profile's; unknown when it has none)")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")

    convert = sub.add_parser("convert", help="write a converted copy of a checkpoint")
    convert.set_defaults(func=cmd_convert)
    _add_model(convert)
    mode = convert.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quantize", type=int, choices=[2, 3, 4, 5, 6, 8], help="bits per weight (default: no quantization)")
    mode.add_argument("--coreml", action="store_true", help="export the ANE's share of prefill as Core ML packages")
    mode.add_argument("--lint", metavar="DIR",
                      help="check exported Core ML packages against the ANE rules (exit 1 on errors; default: no lint)")
    convert.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="with --quantize: group size")
    convert.add_argument("--ane-fraction", type=ane_split_arg, default=GPU_ONLY,
                         help="with --coreml: share of each offloadable piece for the ANE (required there; default: none)")
    convert.add_argument("--chunk-size", type=POSITIVE_INT, default=256, help="with --coreml: prefill chunk (multiple of 64)")
    convert.add_argument("--context", type=token_counts, default="4096", help="with --coreml: context bucket(s) in tokens, comma separated")
    convert.add_argument("--out",
                         help="output directory (--quantize: must not exist or be empty; --coreml: reused; default: none, required)")

    doc = sub.add_parser("doctor", help="check the split prefill end to end here: backend, placement, lane rates, "
                                        "overlap, verify, memory")
    doc.set_defaults(func=cmd_doctor)
    _add_model(doc)
    _add_dtype(doc)
    doc.add_argument("--tokens", type=POSITIVE_INT, default=1024, help="prompt tokens of the split prefill measured")
    doc.add_argument("--ane-fraction", type=ane_split_arg, default=HALF, help="the split's ANE share (0 < F <= 1)")
    doc.add_argument("--json", action="store_true", help="print the findings as one JSON object")

    pre = sub.add_parser("prefill", help="prefill a prompt and write mlx-lm's prompt-cache file (mlx_lm.generate --prompt-cache-file)")
    pre.set_defaults(func=cmd_prefill)
    _add_model(pre)
    _add_dtype(pre)
    pre.add_argument("--prompt-file", required=True, help="the prompt: a UTF-8 text file, or - for stdin")
    pre.add_argument("--out", required=True, help="the .safetensors prompt-cache file to write")
    pre.add_argument("--prefill-chunk", type=POSITIVE_INT, default=None, help="prompt tokens per prefill step (default: 512; 256 split)")
    pre.add_argument("--ane-fraction", type=ane_split_arg, default=GPU_ONLY,
                     help="split prefill as in `hetero run` (0 or default: GPU-only)")
    pre.add_argument("--verify", action="store_true", help="with --ane-fraction: check the split against GPU-only; exit 1 on mismatch")
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    import hetero
    from hetero.progress import ProgressBar

    if distributed.launched():  # started by mlx.launch: the layers split across the ranks
        from hetero.distributed.command import run_pipelined

        status = run_pipelined(args)
        if status is not None:
            return status
    prompt = read_prompt(args.prompt)
    if args.ane_fraction.gpu_only:  # before the model loads
        for flag in ("verify", "trace"):
            if getattr(args, flag):
                raise HeteroError(f"--{flag} needs --ane-fraction F (the split to check or trace)")
    engine = hetero.load(args.model, args.dtype)
    engine.memory_gb = args.memory_gb
    split = None if args.ane_fraction.gpu_only else _split_run(engine, args)
    if split is not None:
        split.prepare(engine.encode_prompt(prompt, args.chat))  # export on first use, before the clock starts

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = engine.generate(
        prompt,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        chat=args.chat,
        prefill_chunk=args.prefill_chunk,
        mtp=False if args.no_mtp else None,
        draft_depth=args.draft_depth,
        copy=not args.no_copy,
        on_text=None if args.json else write,
        progress=ProgressBar("prefill"),
        split=split,
    )
    extra, status = {"blas": hetero.blas.describe()}, 0  # the BLAS under MLX: what CPU speed depends on
    if split is not None:
        extra["ane"] = split.ane_block()
        if split.last is not None:
            extra["pipeline"] = split.last.to_dict()
        if split.trace is not None:
            split.trace.write(args.trace)
        if args.verify:
            from hetero.pipeline import verify

            extra["verify"] = verify(split, engine.encode_prompt(prompt, args.chat), args.verify_tol, args.verify_tokens)
            status = 0 if extra["verify"]["match"] else 3
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens, **result.stats, **extra}))
    else:
        s = result.stats
        sys.stdout.write("\n")
        mtp = s.get("mtp")
        spec = f"; MTP depth {mtp['depth']}, {mtp['mean_accepted_length']} tokens/pass" if mtp and mtp["rounds"] else ""
        print(
            f"[{s['prompt_tokens']} prompt tokens, {s['generated_tokens']} generated; TTFT {s['ttft_s']:.3f}s, "
            f"prefill {s['prefill_tps']:.1f} tok/s, decode {s['decode_tps']:.1f} tok/s{spec}]",
            file=sys.stderr,
        )
        if "pipeline" in extra:
            p = extra["pipeline"]
            print(f"[split prefill ({extra['ane']['backend']}, ANE fraction {extra['ane']['effective_fraction']:.2f}): "
                  f"GPU busy {p['gpu_busy_s']:.3f}s, ANE busy {p['ane_busy_s']:.3f}s, wall {p['wall_s']:.3f}s, "
                  f"overlap {p['overlap']:.2f}; ANE lane in a {p['lane']}, IPC {p['ipc_s']:.3f}s]", file=sys.stderr)
        if "verify" in extra:
            v = extra["verify"]
            print(f"[verify: {'MATCH' if v['match'] else 'MISMATCH'}; max |logit diff| {v['max_abs_logit_diff']}, cosine "
                  f"{v['cosine']}, greedy {v['greedy_match_tokens']}/{v['greedy_compared_tokens']} tokens identical]",
                  file=sys.stderr)
    return status


def _split_run(engine, args: argparse.Namespace):
    """The configured ANE + GPU split of `--ane-fraction` (not GPU-only)."""
    from hetero.pipeline import Trace, split_for

    split = split_for(engine, args.ane_fraction, args.prefill_chunk)
    if args.trace:
        split.trace = Trace()
    if args.verify and not 1 <= args.verify_tokens:
        raise HeteroError(f"--verify-tokens {args.verify_tokens}: must be at least 1")
    return split


def cmd_doctor(args: argparse.Namespace) -> int:
    """`hetero doctor`: exit 0 when every check that could run here passed, 3 when one failed."""
    import hetero
    from hetero.doctor import doctor, print_report

    fraction = args.ane_fraction.fixed("hetero doctor")  # before the model loads
    engine = hetero.load(args.model, args.dtype)
    found = doctor(engine, args.tokens, fraction, report=print_report)
    if args.json:
        print(json.dumps(found))
    return 0 if found["ok"] else 3


def cmd_check(args: argparse.Namespace) -> int:
    from hetero.loader import preflight

    report = preflight(args.model, context=args.context)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1


def cmd_tune(args: argparse.Namespace) -> int:
    import hetero

    if args.devices:
        from hetero.planner import read_model_config
        from hetero.measure import Sizes, measure
        from hetero.settings import save_device_profile

        # with --model, at that model's shapes (rates depend on the sizes they are measured at)
        profile = measure(sizes=Sizes.for_model(read_model_config(args.model)[0])) if args.model else measure()
        path = save_device_profile(profile)
        print(f"saved the this-machine profile to {path} (hetero plan --profile this-machine, --ane-fraction auto)")
        return 0
    from hetero.tune import tune

    engine = hetero.load(args.model, args.dtype)
    if not engine.model.has_mtp:
        raise HeteroError(f"{engine.name} has no MTP head: there is no draft depth to tune")
    tune(engine, tokens=args.tokens)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from hetero.server import ServerSettings, serve

    settings = ServerSettings.from_args(args)  # the one place the flags become the server's settings
    if distributed.launched():  # started by mlx.launch: rank 0 serves HTTP, the other ranks serve rank 0
        from hetero.distributed.serve_command import serve_pipelined

        status = serve_pipelined(settings)
        if status is not None:
            return status

    # the server loads its model itself: in args.dtype, which main's `using_dtype` makes the default
    serve(settings)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from hetero.planner import model_shape, plan_lines, read_model_config, recommend
    from hetero.planner.plan import parse_pieces
    from hetero.planner.recommend import split_plan
    from hetero.profiles import default_profile_name, load_profile

    config, name = read_model_config(args.model)
    check_config(config, name)  # a bare config.json given to --model is read by the planner as is
    profile_name = args.profile or default_profile_name()
    profile = load_profile(profile_name)
    context = args.context or min(32768, model_shape(config)[0].max_position_embeddings)
    kw = dict(prompt_tokens=args.prompt_tokens, bits=args.bits, group_size=args.group_size, memory_gb=args.memory_gb,
              accepted_length=args.accepted_length, draft_depth=args.draft_depth, name=name, hosts=args.hosts,
              link_gbps=args.link_gbps, link_latency_ms=args.link_latency_ms)
    if args.pieces is not None:
        if args.recommend:
            raise HeteroError("--pieces with --recommend: --recommend chooses the piece kinds itself; pass one of them")
        kw["offload"] = parse_pieces(args.pieces)
    if args.recommend:
        fraction, plan = recommend(config, profile, context, args.chunk, **kw)
    else:
        if args.ane_fraction.auto:
            raise HeteroError("hetero plan --ane-fraction auto: plan a given F in [0, 1], or pass --recommend for the "
                              "fraction the profile recommends")
        plan = split_plan(config, profile, args.ane_fraction.fraction, context, args.chunk, **kw)
    if args.json:
        out = plan.to_dict()
        if args.recommend:
            out["recommended_fraction"] = fraction
        print(json.dumps(out, indent=1))
        return 0
    if args.recommend:
        print(f"recommended ANE fraction: {fraction:.2f} (shortest predicted split prefill on {profile.name})")
    if args.profile is None:
        print(f"(profile {profile_name}: default; pass --profile, or run `hetero tune --devices` to measure this machine)")
    print("\n".join(plan_lines(plan)))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    if args.lint:
        if not os.path.exists(args.lint):  # before the Core ML tooling loads (seconds)
            raise HeteroError(f"--lint {args.lint}: no such file or directory; pass the --out DIR of `hetero convert --coreml`")
        from hetero.export import lint_export

        return 1 if print_lint(lint_export(args.lint)) else 0
    if args.out is None:
        raise HeteroError("hetero convert --quantize/--coreml needs --out DIR")
    if args.coreml:
        return convert_coreml(args.model, args.out, args.ane_fraction, args.chunk_size, args.context)
    from hetero.quantize import quantize_checkpoint

    out = quantize_checkpoint(args.model, args.out, bits=args.quantize, group_size=args.group_size)
    print(f"wrote {args.quantize}-bit copy to {out}")
    return 0


def cmd_prefill(args: argparse.Namespace) -> int:
    """`hetero prefill`: the cache file records the model as given, the name `mlx_lm.generate` then loads."""
    import time

    import hetero
    from hetero.library import prefill_to_file
    from hetero.loader import BUNDLED_MODEL

    if args.verify and args.ane_fraction.gpu_only:
        raise HeteroError("--verify needs --ane-fraction F (the split to check)")
    if not args.out.endswith(".safetensors"):  # before the prefill, not after it
        raise HeteroError(f"--out {args.out}: the name must end in .safetensors (mlx-lm reads prompt caches by that)")
    if args.prompt_file == "-":
        text = decode_utf8(sys.stdin.buffer.read(), "the prompt on stdin")
    else:
        try:
            with open(args.prompt_file, "rb") as f:
                text = decode_utf8(f.read(), args.prompt_file)
        except OSError as e:
            raise HeteroError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
    start = time.perf_counter()
    engine = hetero.load(args.model, args.dtype)
    meta = {"model": str(args.model or BUNDLED_MODEL), "tokenizer_config": "{}"}
    n = prefill_to_file(engine, text, args.out, ane_fraction=args.ane_fraction, chunk=args.prefill_chunk,
                        verify=args.verify, metadata=meta)
    print(f"[wrote a {n}-token prompt cache to {args.out} in {time.perf_counter() - start:.2f}s; continue with "
          f"mlx_lm.generate --prompt-cache-file {args.out} --prompt ...]", file=sys.stderr)
    return 0


def convert_coreml(model: str | None, out: str, ane: AneSplit, chunk: int, context: str) -> int:
    """`hetero convert --coreml`: export, then lint; exit status 1 when the lint finds errors."""
    fraction = ane.fixed("hetero convert --coreml")  # before the Core ML tooling loads
    from hetero.export import export_coreml, lint_export
    from hetero.progress import ProgressBar

    try:
        contexts = [int(c) for c in context.split(",") if c.strip()]
    except ValueError:
        raise HeteroError(f"--context {context!r}: give one or more token counts separated by commas") from None
    manifest = export_coreml(model, out, fraction, chunk, contexts, progress=ProgressBar("export"))
    progs = manifest["programs"]
    total = sum(p["weight_bytes"] for p in progs)
    reused = sum(p["reused"] for p in progs)
    print(f"wrote {len(progs)} Core ML programs ({reused} reused, {total / 2**20:.1f} MiB of fp16 weights) to {out}")
    return 1 if print_lint(lint_export(out, manifest["weight_budget_bytes"])) else 0


def print_lint(reports: list) -> int:
    """Print the lint's findings and a summary; returns the number of errors."""
    for r in reports:
        for line in r.lines():
            print(line)
    errors = sum(len(r.errors) for r in reports)
    warnings = sum(len(r.warnings) for r in reports)
    print(f"lint: {len(reports)} programs, {errors} errors, {warnings} warnings")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `hetero` alone: what can it do?
        parser.print_help()
        return 0
    try:
        from hetero.loader import using_dtype

        with using_dtype(getattr(args, "dtype", None)):  # also the loads that take no dtype (server, ranks)
            return args.func(args)
    except HeteroError as e:
        if args.debug:
            raise
        print(f"hetero: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nhetero: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`hetero run ... | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # keep the exit-time flush quiet
        return 141
    except Exception as e:  # a bug, not the user's mistake: still one line, the traceback on request
        if args.debug:
            raise
        print(f"hetero: error: {internal_error(e)} (an internal error: rerun with --debug for the traceback, "
              "and please report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
