"""Settings parsed once into typed values: one `--ane-fraction` parser (`AneSplit`) for every subcommand, the
library and the server; one draft-depth default and policy (`speculative.decode_depth`), shared by `hetero serve
--draft-depth` and the pipelined engine; the server's settings in one `ServerSettings`; a pipelined request as a
`Request` dataclass. Argument errors never load weights; the server test is real HTTP on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import hetero
from hetero.cli.main import build_parser, main
from hetero.decode.depth import MAX_DEPTH, decode_depth
from hetero.decode.options import DecodeOptions
from hetero.decode.penalties import Penalties
from hetero.decode.sampling import SamplingParams
from hetero.distributed.request import Request
from hetero.distributed.runtime import PipelineEngine
from hetero.errors import HeteroError
from hetero.host.settings import DEFAULT_DRAFT_DEPTH, PLAIN
from hetero.server import ServerSettings, create_app
from hetero.server.app import SERVE_MAX_BATCH, server_split
from hetero.validate import GPU_ONLY, AneSplit
from tiny_checkpoint import write_tiny_model

# every subcommand that takes --ane-fraction, with the other arguments it needs to parse
SPLIT_COMMANDS = {
    "run": ["--prompt", "x"],
    "serve": [],
    "prefill": ["--prompt-file", "p.txt", "--out", "c.safetensors"],
    "plan": [],
    "doctor": [],
    "convert": ["--coreml", "--out", "x"],
}
BAD_FRACTIONS = ["1.5", "-0.1", "nan", "inf", "half", ""]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("typed") / "model", max_context=512)


def cli(capsys, *args: str) -> tuple[int, str]:
    """`hetero ARGS` in-process: (exit status, stderr)."""
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse's usage errors
        rc = e.code if isinstance(e.code, int) else 1
    return rc, capsys.readouterr().err


def one_line(rc: int, err: str) -> str:
    assert rc == 1, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


# ----------------------------------------------------------------------------------------------------------
# --ane-fraction: one parser


@pytest.mark.parametrize("command", SPLIT_COMMANDS)
@pytest.mark.parametrize("text, want", [
    ("0", GPU_ONLY), ("0.0", GPU_ONLY), ("0.25", AneSplit(0.25)), ("1", AneSplit(1.0)), ("auto", AneSplit(auto=True)),
])
def test_every_subcommand_parses_ane_fraction_into_the_same_value(command, text, want):
    args = build_parser().parse_args([command, *SPLIT_COMMANDS[command], "--ane-fraction", text])
    assert args.ane_fraction == want == AneSplit.parse(text)
    assert isinstance(args.ane_fraction, AneSplit)


@pytest.mark.parametrize("command", ["run", "serve", "prefill"])
def test_no_ane_fraction_is_gpu_only(command):
    assert build_parser().parse_args([command, *SPLIT_COMMANDS[command]]).ane_fraction == GPU_ONLY


@pytest.mark.parametrize("text", BAD_FRACTIONS)
def test_every_subcommand_refuses_a_bad_fraction_in_the_same_line(capsys, text):
    lines = {}
    for command, extra in SPLIT_COMMANDS.items():
        err = one_line(*cli(capsys, command, *extra, "--ane-fraction", text))
        lines[command] = err.replace(f"hetero {command}", "hetero COMMAND")
    assert len(set(lines.values())) == 1, lines
    why = f"{text!r}: give a number in [0, 1] (0: GPU-only) or 'auto'"
    assert f"argument --ane-fraction: {why}" in lines["run"]
    # the library and the server's settings take the same parser's word for it
    for call, name in ((lambda: AneSplit.parse(text), "--ane-fraction"),
                       (lambda: ServerSettings(ane=text), "--ane-fraction"),
                       (lambda: AneSplit.parse(text, "ane_fraction"), "ane_fraction")):
        with pytest.raises(HeteroError) as e:
            call()
        assert str(e.value) == f"{name} {why}"


def test_the_library_and_the_server_parse_the_same_values():
    assert AneSplit.parse(None) == AneSplit.parse(0) == AneSplit.parse(0.0) == GPU_ONLY
    assert AneSplit.parse(0.5) == AneSplit.parse("0.5") == AneSplit(0.5)
    assert AneSplit.parse(AneSplit(auto=True)) == AneSplit(auto=True)
    assert ServerSettings(ane=0.5).ane == AneSplit(0.5) and ServerSettings().ane == GPU_ONLY
    for bad in (True, [0.5], -1, "1.5", "Auto"):
        with pytest.raises(HeteroError):
            AneSplit.parse(bad)
    assert str(AneSplit(0.5)) == "0.5" and str(AneSplit(auto=True)) == "auto" and GPU_ONLY.gpu_only


def test_library_prefill_refuses_a_bad_fraction_before_it_runs(tiny):
    engine = hetero.load(tiny)
    with pytest.raises(HeteroError, match=r"^ane_fraction 1\.5: give a number in \[0, 1\]"):
        hetero.prefill(engine, [1, 2, 3], ane_fraction=1.5)
    assert server_split(engine, 0, 64) is None and server_split(engine, GPU_ONLY, 64) is None


@pytest.mark.parametrize("argv, needle", [
    (["doctor", "--ane-fraction", "0"], "hetero doctor needs --ane-fraction F with 0 < F <= 1"),
    (["doctor", "--ane-fraction", "auto"], "hetero doctor needs a given --ane-fraction F with 0 < F <= 1, not 'auto'"),
    (["convert", "--coreml", "--out", "x", "--ane-fraction", "0"], "hetero convert --coreml needs --ane-fraction F"),
    (["convert", "--coreml", "--out", "x", "--ane-fraction", "auto"], "hetero convert --coreml needs a given"),
    (["convert", "--coreml", "--out", "x"], "hetero convert --coreml needs --ane-fraction F with 0 < F <= 1"),
    (["prefill", "--prompt-file", "p.txt", "--out", "c.safetensors", "--ane-fraction", "0", "--verify"],
     "--verify needs --ane-fraction F"),
    (["run", "--prompt", "x", "--ane-fraction", "0", "--trace", "t.json"], "--trace needs --ane-fraction F"),
])
def test_commands_that_need_a_given_split_say_so_in_one_line(capsys, argv, needle):
    assert needle in one_line(*cli(capsys, *argv))


def test_plan_takes_auto_as_the_recommended_plan(capsys):
    """`hetero plan --ane-fraction auto` plans the fraction `--recommend` picks (it used to be refused)."""
    assert main(["plan", "--ane-fraction", "auto", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert main(["plan", "--recommend", "--json"]) == 0
    assert auto == json.loads(capsys.readouterr().out) and auto["requested_fraction"] > 0


def test_plan_takes_0_as_a_gpu_only_plan(capsys):
    assert main(["plan", "--ane-fraction", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requested_fraction"] == 0.0


# ----------------------------------------------------------------------------------------------------------
# The draft depth: one default, one policy, one check


def test_the_depth_policy():
    assert decode_depth(True, None, None) == DEFAULT_DRAFT_DEPTH == 3
    assert decode_depth(True, None, None, tuned=2) == 2
    assert decode_depth(True, None, None, tuned=PLAIN) == 0  # plain decoding won `hetero tune` here
    assert decode_depth(True, None, 4, tuned=PLAIN) == 4  # a given depth turns MTP on after all
    assert decode_depth(True, True, None, tuned=PLAIN) == DEFAULT_DRAFT_DEPTH
    assert decode_depth(True, False, 4, tuned=2) == 0
    assert decode_depth(False, None, 4) == 0  # no head: plain
    assert decode_depth(True, None, None, tuned=MAX_DEPTH + 1) == DEFAULT_DRAFT_DEPTH  # a damaged saved depth
    for bad in (0, -1, MAX_DEPTH + 1, 2.5, True):
        with pytest.raises(HeteroError, match=rf"^--draft-depth must be an integer in \[1, {MAX_DEPTH}\]"):
            decode_depth(True, None, bad)


def test_the_default_depth_is_the_cli_default_and_the_planners():
    from hetero.cli.measure import Sizes
    from hetero.planner.plan import DEFAULT_DRAFT_DEPTH as planner_default

    assert build_parser().parse_args(["plan"]).draft_depth == DEFAULT_DRAFT_DEPTH == planner_default
    assert Sizes().draft_depth == DEFAULT_DRAFT_DEPTH


@pytest.mark.parametrize("command", ["run", "serve", "plan"])
@pytest.mark.parametrize("text", ["0", str(MAX_DEPTH + 1), "two"])
def test_a_bad_depth_is_one_line_in_every_command(capsys, command, text):
    err = one_line(*cli(capsys, command, *SPLIT_COMMANDS[command], "--draft-depth", text))
    assert "argument --draft-depth" in err and f"[1, {MAX_DEPTH}]" in err


class Sent(Exception):
    """Raised instead of sending a pipelined request to the ranks."""


def pipelined_engine(engine) -> tuple[PipelineEngine, list[Request]]:
    """A PipelineEngine over `engine`'s checkpoint whose requests are kept instead of sent (no ranks)."""
    stage = SimpleNamespace(args=engine.model.args, has_mtp=True, link=None)
    pipelined = PipelineEngine(stage, engine.path, engine.config, "tiny")
    sent: list[Request] = []

    def keep(request: Request):
        sent.append(request)
        raise Sent

    pipelined._request = keep
    return pipelined, sent


def test_one_host_and_the_pipeline_refuse_an_explicit_depth_0_alike(tiny):
    """0 is no draft depth in one process; across ranks it is refused the same way, not turned into 3."""
    engine = hetero.load(tiny)
    pipelined, sent = pipelined_engine(engine)
    errors = []
    for e in (engine, pipelined):
        with pytest.raises(HeteroError) as caught:
            e.generate([1, 2, 3], max_tokens=2, draft_depth=0)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and len(errors[0].splitlines()) == 1 and not sent


def test_the_pipeline_sends_the_depth_unchanged(tiny):
    pipelined, sent = pipelined_engine(hetero.load(tiny))
    for kw, depth in ((dict(draft_depth=5), 5), ({}, DEFAULT_DRAFT_DEPTH), (dict(mtp=False), 0),
                      (dict(mtp=False, draft_depth=5), 0)):
        with pytest.raises(Sent):
            pipelined.generate([1, 2, 3], max_tokens=2, **kw)
        assert sent[-1].depth == depth and sent[-1].kind == "generate", kw


def test_a_pipelined_request_round_trips_through_json():
    options = DecodeOptions(5, SamplingParams(0.7, 5, 0.9, 0.05), 7, Penalties(0.5, -0.25, 1.3, {7: -100.0, 11: 2.5}),
                            prefill_chunk=64, mtp=True, draft_depth=4, copy=False, logprobs=2, grammar="start: x",
                            thinking_budget=3)
    request = Request("generate", [1, 2, 3], options, depth=4, eos=[0, 2], max_context=512, prefix_cache=1024,
                      marks=[2], stoppable=True)
    for r in (request, Request("stop"), Request("logits", [4, 5], DecodeOptions(prefill_chunk=16)),
              Request("generate", [1], DecodeOptions(json_schema={"type": "object"}))):
        assert Request.from_json(json.loads(json.dumps(r.to_json()))) == r
    with pytest.raises(ValueError):
        Request("bogus")


# ----------------------------------------------------------------------------------------------------------
# The server's settings


def test_server_settings_come_from_the_command_line_once():
    args = build_parser().parse_args(["serve", "--draft-depth", "5", "--ane-fraction", "auto", "--port", "9000",
                                      "--served-model-name", "alias", "--max-batch", "2", "--decode-share", "0.5",
                                      "--ane-weights", "blockwise"])
    s = ServerSettings.from_args(args)
    assert (s.draft_depth, s.ane, s.port, s.served_name, s.max_batch, s.decode_share, s.ane_weights) == (
        5, AneSplit(auto=True), 9000, "alias", 2, 0.5, "blockwise")
    # the CLI's defaults are the settings' own, but that `hetero serve` batches (1 under mlx.launch: no pipelined form)
    assert ServerSettings.from_args(build_parser().parse_args(["serve"])) == ServerSettings(
        api_key=os.environ.get("HETERO_API_KEY"), max_batch=SERVE_MAX_BATCH)
    assert ServerSettings.from_args(build_parser().parse_args(["serve"]), pipelined=True).max_batch == 1


@pytest.mark.parametrize("kw, flag", [
    (dict(draft_depth=0), "--draft-depth"), (dict(draft_depth=MAX_DEPTH + 1), "--draft-depth"),
    (dict(ane=2), "--ane-fraction"), (dict(port=0), "--port"), (dict(max_batch=0), "--max-batch"),
    (dict(max_concurrent=0), "--max-concurrent"), (dict(decode_share=1.0), "--decode-share"),
    (dict(max_body_mb=0), "--max-body-mb"), (dict(served_name="\ud800"), "--served-model-name"),
    (dict(ane_weights="int4"), "--ane-weights"),
])
def test_server_settings_are_checked_when_built(kw, flag):
    with pytest.raises(HeteroError) as e:
        ServerSettings(**kw)
    assert str(e.value).startswith(flag) and len(str(e.value).splitlines()) == 1


def test_a_draft_depth_for_a_model_without_mtp_is_refused():
    headless = SimpleNamespace(model=SimpleNamespace(has_mtp=False), name="headless")
    with pytest.raises(HeteroError, match="headless has no MTP head"):
        create_app(headless, ServerSettings(draft_depth=2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_draft_depth_reaches_the_decoder(tiny, tmp_path):
    """`hetero serve --draft-depth 5` (neither the default nor a depth calibration would pick): every MTP request
    decodes at 5, /health says so, and no calibration runs at start-up (nothing is saved)."""
    port, url = free_port(), None
    env = {**os.environ, "HETERO_HOME": str(tmp_path)}  # this machine's saved tuning neither leaks in nor out
    proc = subprocess.Popen([sys.executable, "-m", "hetero", "serve", "--model", str(tiny), "--port", str(port),
                             "--no-session-cache", "--draft-depth", "5"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while url is None:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.time() < deadline, "hetero serve did not start"
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
                url = f"http://127.0.0.1:{port}"
            except httpx.TransportError:
                time.sleep(0.2)
        assert health["draft_depth"] == 5
        body = {"model": str(tiny), "prompt": "def f(x):", "max_tokens": 12, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["hetero"]["mtp"]["depth"] == 5
        r = httpx.post(url + "/v1/completions", json={**body, "mtp": False}, timeout=120)
        assert r.status_code == 200 and "mtp" not in r.json()["hetero"], r.text
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert not (tmp_path / "settings.json").exists()
