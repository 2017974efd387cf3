"""`hetero` command line: run, check, tune, serve, plan, convert, doctor, prefill (the flags: `cli_parser`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import hetero
from hetero import distributed
from hetero.checkpoint.config_checks import check_config
from hetero.checkpoint.dtypes import using_dtype
from hetero.checkpoint.preflight import preflight
from hetero.checkpoint.source import BUNDLED_MODEL, resolve
from hetero.cli.doctor import doctor, print_report
from hetero.cli.measure import Sizes, measure
from hetero.cli.parser import build_parser
from hetero.cli.quantize import quantize_checkpoint
from hetero.cli.tune import show as show_settings
from hetero.cli.tune import tune
from hetero.coreml.export import export_coreml, lint_export
from hetero.decode.options import DecodeOptions
from hetero.decode.penalties import Penalties
from hetero.decode.sampling import SamplingParams
from hetero.distributed.command import run_pipelined
from hetero.distributed.serve_command import serve_pipelined
from hetero.errors import HeteroError, internal_error
from hetero.host import kernels
from hetero.host.progress import ProgressBar
from hetero.host.settings import save_device_profile
from hetero.library import prefill_to_file
from hetero.models.architectures import architecture
from hetero.models.qwen3_5_vision.args import VisionArgs
from hetero.pipeline import Trace, split_for, verify
from hetero.pipeline.run import measured_ranges
from hetero.planner import model_shape, plan_lines, read_model_config, recommend
from hetero.planner.plan import PlanRequest, parse_pieces
from hetero.planner.predict import Lanes
from hetero.planner.ranges import within_range
from hetero.planner.recommend import split_plan
from hetero.planner.vision import PLAN_SIZES, predict_tower, tower_lines
from hetero.profiles import default_profile_name, load_profile
from hetero.server import ServerSettings, serve
from hetero.validate import AneSplit, decode_utf8, read_prompt
from hetero.vision.input import read_images



def cmd_run(args: argparse.Namespace) -> int:

    if distributed.launched():  # started by mlx.launch: the layers split across the ranks
        if args.image:
            raise HeteroError("--image under mlx.launch: the ranks prefill text only; run the same hetero run "
                              "command without mlx.launch (one process, the vision tower included)")
        if args.kv_bits is not None:
            raise HeteroError("--kv-bits under mlx.launch: the ranks keep full-precision KV only; leave --kv-bits out")
        status = run_pipelined(args, run_options(args))
        if status is not None:
            return status
    prompt, images = read_prompt(args.prompt), read_images(args.image)
    chat = args.chat or bool(images)  # the images go before the prompt in one user turn
    if args.ane_fraction.gpu_only:  # before the model loads
        for flag in ("verify", "trace"):
            if getattr(args, flag):
                raise HeteroError(f"--{flag} needs --ane-fraction F (the split to check or trace)")
    if args.kv_bits is not None and not args.ane_fraction.gpu_only:
        raise HeteroError("--kv-bits with --ane-fraction: the split prefill reads full-precision KV only; "
                          "leave one of them out")
    engine = hetero.load(args.model, args.dtype, kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)
    engine.memory_gb = args.memory_gb
    split = None if args.ane_fraction.gpu_only else _split_run(engine, args)
    vision = None  # the split's prompt with its images (planned here: its length picks the programs to export)
    if images and split is not None:
        vision = engine.image_prompt(engine.encode_prompt(prompt, chat, images=len(images)), images)
    if split is not None:  # export on first use, before the clock starts (for the prompt with its images' tokens)
        split.prepare(vision.tokens if vision is not None else engine.encode_prompt(prompt, chat), images=vision)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = engine.generate(prompt, options=run_options(args), chat=chat, images=images, split=split,
                             on_text=None if args.json else write, progress=ProgressBar("prefill"))
    # the BLAS under MLX and hetero's own CPU kernels: what CPU speed depends on
    extra, status = {"blas": hetero.host.blas.describe(), **kernels.status()}, 0
    if split is not None:
        extra["ane"] = split.ane_block()
        if split.last is not None:
            extra["pipeline"] = split.last.to_dict()
        if split.trace is not None:
            split.trace.write(args.trace)
        if args.verify:
            if vision is not None:  # against GPU-only with the same images
                engine.vision.encode(vision)
            ids = vision.tokens if vision is not None else engine.encode_prompt(prompt, chat)
            extra["verify"] = verify(split, ids, args.verify_tol, args.verify_tokens, images=vision)
            status = 0 if extra["verify"]["match"] else 3
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens, **result.stats, **extra}))
    else:
        sys.stdout.write("\n")
        print_run_stats(result.stats, extra)
    return status


def print_run_stats(s: dict, extra: dict) -> None:
    """`hetero run`'s closing lines on stderr: tokens and rates, the split's lanes and images, the verification."""
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
        for v in p.get("vision", []):
            where = "the ANE lane" if v["lane"] == "ane" else "the GPU"
            print(f"[image {v['image']}: {v['tokens']} tokens encoded on {where} in {v['seconds']:.3f}s]",
                  file=sys.stderr)
    if "verify" in extra and "lane_lost" in extra["verify"]:
        print("[verify: not judged: the ANE lane's worker was lost during the check]", file=sys.stderr)
    elif "verify" in extra:
        v = extra["verify"]
        print(f"[verify: {'MATCH' if v['match'] else 'MISMATCH'}; distance {v['distance']:.3g} (tolerance "
              f"{v['tolerance']:.3g}, at {v['worst'] or '-'}), greedy {v['greedy_match_tokens']}/"
              f"{v['greedy_compared_tokens']} tokens identical]",
              file=sys.stderr)


def run_options(args: argparse.Namespace) -> DecodeOptions:
    """`hetero run`'s decode options from its flags (sampling, seed, penalties, logit bias, MTP, prefill chunk)."""
    return DecodeOptions(
        args.max_tokens, SamplingParams(args.temp, args.top_k, args.top_p, args.min_p), args.seed,
        Penalties(args.presence_penalty, args.frequency_penalty, args.repetition_penalty, dict(args.logit_bias or [])),
        prefill_chunk=args.prefill_chunk, mtp=False if args.no_mtp else None, draft_depth=args.draft_depth,
        copy=not args.no_copy)


def _split_run(engine, args: argparse.Namespace):
    """The configured ANE + GPU split of `--ane-fraction` (not GPU-only)."""

    split = split_for(engine, args.ane_fraction, args.prefill_chunk, args.ane_weights)
    if args.trace:
        split.trace = Trace()
    if args.verify and not 1 <= args.verify_tokens:
        raise HeteroError(f"--verify-tokens {args.verify_tokens}: must be at least 1")
    return split


def cmd_doctor(args: argparse.Namespace) -> int:
    """`hetero doctor`: exit 0 when every check that could run here passed, else the failed checks' bits
    (`hetero.cli.doctor.EXIT_BITS`); the JSON report (`--json`) is printed whole in every case."""

    fraction = args.ane_fraction.fixed("hetero doctor")  # a bad flag: one line, before anything runs
    try:
        found = doctor(args.model, args.tokens, fraction, report=print_report, weights=args.ane_weights,
                       dtype=args.dtype)
    except Exception as e:  # noqa: BLE001  (the doctor guards its steps; this is the last line of defence)
        if args.debug:
            raise
        found = {"ok": False, "exit_code": 1, "error": internal_error(e)}
        print_report(f"hetero doctor: error: {found['error']}")
    if args.json:
        print(json.dumps(found, default=str))
    return found["exit_code"]


def cmd_check(args: argparse.Namespace) -> int:

    report = preflight(args.model, context=args.context)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1


def cmd_tune(args: argparse.Namespace) -> int:

    if args.show:
        show_settings()
        return 0
    if args.devices:

        # with --model, at that model's shapes (rates depend on the sizes they are measured at)
        profile = measure(sizes=Sizes.for_model(read_model_config(args.model)[0])) if args.model else measure()
        path = save_device_profile(profile)
        print(f"saved the this-machine profile to {path} (hetero plan --profile this-machine, --ane-fraction auto)")
        return 0

    engine = hetero.load(args.model, args.dtype)
    if not engine.model.has_mtp:
        raise HeteroError(f"{engine.name} has no MTP head: there is no draft depth to tune")
    tune(engine, tokens=args.tokens, cap_s=args.seconds)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:

    settings = ServerSettings.from_args(args, distributed.launched())  # the one place flags become settings
    if distributed.launched():  # started by mlx.launch: rank 0 serves HTTP, the other ranks serve rank 0

        status = serve_pipelined(settings)
        if status is not None:
            return status

    # the server loads its model itself: in args.dtype, which main's `using_dtype` makes the default
    serve(settings)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:

    config, name = read_model_config(args.model)
    check_config(config, name)  # a bare config.json given to --model is read by the planner as is
    profile_name = args.profile or default_profile_name()
    profile = load_profile(profile_name)
    context = args.context or min(32768, model_shape(config)[0].max_position_embeddings)
    flag = "--recommend" if args.recommend else "--ane-fraction auto"
    args.recommend = args.recommend or args.ane_fraction.auto  # the fraction `--ane-fraction auto` starts from
    request = PlanRequest(
        config, profile, 0.0 if args.recommend else args.ane_fraction.fraction, context, args.chunk,
        prompt_tokens=args.prompt_tokens, bits=args.bits, group_size=args.group_size, memory_gb=args.memory_gb,
        accepted_length=args.accepted_length, draft_depth=args.draft_depth, name=name, hosts=args.hosts,
        link_gbps=args.link_gbps, link_latency_ms=args.link_latency_ms, kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size)
    offload = None
    if args.pieces is not None:
        if args.recommend:
            raise HeteroError(f"--pieces with {flag}: {flag} chooses the piece kinds itself; pass --pieces with a "
                              f"fraction in [0, 1], or {flag} alone")
        offload = parse_pieces(args.pieces)
    if args.recommend:
        fraction, plan = recommend(request)
    else:
        plan = split_plan(request, offload)
    plan = with_measured_ranges(plan, args.model, name, config)
    vision = config.get("vision_config")  # the tower's shape (a checkpoint's own, or transformers' defaults)
    takes_images = architecture(config.get("model_type")).reads_images  # a tower not read: no image lines
    tower = VisionArgs.from_config(vision) if isinstance(vision, dict) and takes_images else None
    if args.json:
        out = plan.to_dict()
        if args.recommend:
            out["recommended_fraction"] = fraction
        if tower is not None:  # the tower's seconds per image size on either lane
            out["vision"] = [predict_tower(tower, Lanes.of(profile), w, h).to_dict() for w, h in PLAN_SIZES]
        print(json.dumps(out, indent=1))
        return 0
    if args.recommend:
        print(f"recommended ANE fraction: {fraction:.2f} (shortest predicted split prefill on {profile.name})")
    if args.profile is None:
        print(f"(profile {profile_name}: default; pass --profile, or run `hetero tune --devices` to measure this machine)")
    print("\n".join(plan_lines(plan) + (tower_lines(tower, Lanes.of(profile)) if tower is not None else [])))
    return 0


def with_measured_ranges(plan, model: str | None, name: str, config: dict):
    """The plan cut to the activation ranges a split run of this checkpoint measured, where one did (the planner
    then counts what stays on the GPU lane for range); a bare config.json or unrun checkpoint plans as is."""
    if not plan.slices or (model is not None and os.path.isfile(model)):
        return plan
    path = resolve(model, weights=False)
    if not any(path.glob("*.safetensors")):
        return plan
    ranges = measured_ranges(name, config, path, plan)
    return plan if ranges is None else within_range(plan, ranges)


def cmd_convert(args: argparse.Namespace) -> int:
    if args.lint:
        if not os.path.exists(args.lint):  # before the Core ML tooling loads (seconds)
            raise HeteroError(f"--lint {args.lint}: no such file or directory; pass the --out DIR of `hetero convert --coreml`")

        return 1 if print_lint(lint_export(args.lint)) else 0
    if args.out is None:
        raise HeteroError("hetero convert --quantize/--coreml needs --out DIR")
    if args.coreml:
        return convert_coreml(args.model, args.out, args.ane_fraction, args.chunk_size, args.context, args.ane_weights,
                              args.target)

    out = quantize_checkpoint(args.model, args.out, bits=args.quantize, group_size=args.group_size)
    print(f"wrote {args.quantize}-bit copy to {out}")
    return 0


def cmd_prefill(args: argparse.Namespace) -> int:
    """`hetero prefill`: the cache file records the model as given, the name `mlx_lm.generate` then loads."""
    import time


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
                        verify=args.verify, metadata=meta, ane_weights=args.ane_weights)
    print(f"[wrote a {n}-token prompt cache to {args.out} in {time.perf_counter() - start:.2f}s; continue with "
          f"mlx_lm.generate --prompt-cache-file {args.out} --prompt ...]", file=sys.stderr)
    return 0


def convert_coreml(model: str | None, out: str, ane: AneSplit, chunk: int, context: str, form: str = "lut",
                   target: str | None = None) -> int:
    """`hetero convert --coreml`: export for `target` (a `hetero.coreml.target.TARGETS` name's OS, default this
    machine's; quantized weights in the form `form` as it allows), then lint; exit status 1 when the lint finds
    errors."""
    from hetero.coreml.target import TARGETS

    fraction = ane.fixed("hetero convert --coreml")  # before the Core ML tooling loads
    chosen = next(t for t in TARGETS if t.name.startswith(target + "-")) if target else None

    try:
        contexts = [int(c) for c in context.split(",") if c.strip()]
    except ValueError:
        raise HeteroError(f"--context {context!r}: give one or more token counts separated by commas") from None
    manifest = export_coreml(model, out, fraction, chunk, contexts, progress=ProgressBar("export"), form=form,
                             target=chosen)
    progs = manifest["programs"]
    total = sum(p["weight_bytes"] for p in progs)
    reused = sum(p["reused"] for p in progs)
    note = f" ({manifest['weight_form_note']})" if manifest.get("weight_form_note") else ""
    print(f"wrote {len(progs)} Core ML programs for {manifest['target']} ({reused} reused, {total / 2**20:.1f} MiB "
          f"of {manifest['ane_weights']} weights) to {out}{note}")
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
    commands = {"run": cmd_run, "check": cmd_check, "tune": cmd_tune, "serve": cmd_serve, "plan": cmd_plan,
                "convert": cmd_convert, "doctor": cmd_doctor, "prefill": cmd_prefill}
    try:
        with using_dtype(getattr(args, "dtype", None)):  # also the loads that take no dtype (server, ranks)
            return commands[args.command](args)
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
