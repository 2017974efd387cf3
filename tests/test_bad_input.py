"""Bad input, end to end: every mistake is one line (CLI, exit 1) or a 4xx naming the field (server), never a
traceback, never a 500 for the client's fault, and the server keeps answering.

The CLI runs in-process through `main()` (argument and config errors never load weights) and in a subprocess
where the process boundary matters (argv and stdin bytes, a busy port, exit codes). The server is real HTTP on
loopback, one instance for the whole module. Fuzz tests (hypothesis) cover config.json, safetensors headers and
request bodies.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetero
from hetero.checkpoint.preflight import preflight
from hetero.cli.main import build_parser, main
from hetero.errors import HeteroError
from test_server import LiveServer
from tiny_checkpoint import write_tiny_model

# 40 examples keep the suite fast; HETERO_FUZZ_EXAMPLES=1000 digs deeper
FUZZ = settings(max_examples=int(os.environ.get("HETERO_FUZZ_EXAMPLES", 40)), deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("bad-input") / "model", max_context=512)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """`hetero ARGS` in-process: (exit status, stdout, stderr)."""
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse's own exits (help, version, usage errors)
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


def cli_process(*args: str | bytes, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """`hetero ARGS` as a real process (bytes arguments pass through undecoded)."""
    return subprocess.run([sys.executable, "-m", "hetero", *args], input=stdin, capture_output=True, timeout=120)


def assert_one_line(rc: int, err: str, *needles: str) -> None:
    assert rc == 1, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def copy_with_config(tiny: Path, dest: Path, edit) -> Path:
    """A copy of the tiny checkpoint whose parsed config.json went through `edit` (returns the new config)."""
    shutil.copytree(tiny, dest)
    config = json.loads((tiny / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(edit(config)))
    return dest


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: config.json and safetensors headers


def test_config_that_is_a_list_is_one_line(tiny, tmp_path, capsys):
    model = copy_with_config(tiny, tmp_path / "m", lambda c: [c])
    for command in (["run", "--prompt", "x"], ["plan"]):
        rc, _, err = cli(capsys, *command, "--model", str(model))
        assert_one_line(rc, err, "must hold a JSON object, got a JSON array")
    rc, out, _ = cli(capsys, "check", "--model", str(model))
    assert rc == 1 and "must hold a JSON object" in out and "result: FAIL" in out


def test_text_config_that_is_a_string_is_one_line(tiny, tmp_path, capsys):
    model = copy_with_config(tiny, tmp_path / "m", lambda c: {**c, "model_type": "qwen3_5", "text_config": "abc"})
    rc, _, err = cli(capsys, "run", "--model", str(model), "--prompt", "x")
    assert_one_line(rc, err, "text_config must be an object")


@pytest.mark.parametrize("field, value, needle", [
    ("num_attention_heads", 0, "num_attention_heads must be an integer in [1, 2147483647], got 0"),
    ("hidden_size", -32, "hidden_size must be an integer in [1, "),
    ("head_dim", 16.5, "head_dim must be an integer in [1, 2147483647], got 16.5"),
    ("vocab_size", "320", "vocab_size must be an integer in [1, 2147483647], got str"),
    ("num_key_value_heads", True, "num_key_value_heads must be an integer"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be a finite number > 0"),
    ("layer_types", "full_attention", "layer_types must be a list"),
    ("rope_parameters", [1], "rope_parameters must be an object"),
    ("eos_token_id", -2, "eos_token_id must be a token id"),
    ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
])
def test_bad_config_sizes_are_one_line(tiny, tmp_path, capsys, field, value, needle):
    model = copy_with_config(tiny, tmp_path / "m", lambda c: {**c, field: value})
    rc, _, err = cli(capsys, "run", "--model", str(model), "--prompt", "x")
    assert_one_line(rc, err, needle)
    rc, out, _ = cli(capsys, "check", "--model", str(model))
    assert rc == 1 and needle in out and "result: FAIL" in out


def test_nested_text_config_fields_are_checked_too(tiny, tmp_path, capsys):
    def nest(c):
        return {"model_type": "qwen3_5", "text_config": {**c, "num_attention_heads": 0}}

    model = copy_with_config(tiny, tmp_path / "m", nest)
    rc, _, err = cli(capsys, "run", "--model", str(model), "--prompt", "x")
    assert_one_line(rc, err, "text_config.num_attention_heads must be an integer in [1, ")


@pytest.mark.parametrize("content, needle", [
    ("[1, 2]", "generation_config.json must hold a JSON object"),
    ('{"eos_token_id": "x"}', "eos_token_id must be a token id"),
])
def test_bad_generation_config_is_one_line(tiny, tmp_path, capsys, content, needle):
    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    (model / "generation_config.json").write_text(content)
    rc, _, err = cli(capsys, "run", "--model", str(model), "--prompt", "x")
    assert_one_line(rc, err, needle)


def write_safetensors_header(file: Path, header, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_safetensors_header_that_is_a_list_is_one_line(tiny, tmp_path, capsys):
    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    write_safetensors_header(model / "model.safetensors", [{"dtype": "F32"}])
    rc, _, err = cli(capsys, "run", "--model", str(model), "--prompt", "x")
    assert_one_line(rc, err, "corrupt safetensors header", "not an object")


# ----------------------------------------------------------------------------------------------------------
# Options


@pytest.mark.parametrize("seed", ["-1", str(2**70), "2**70"])
def test_seed_out_of_range_is_one_line(capsys, seed):
    rc, _, err = cli(capsys, "run", "--prompt", "x", "--temp", "0.7", "--seed", seed)
    assert_one_line(rc, err, "--seed", "[0, 2^64-1]")


@pytest.mark.parametrize("args", [
    ["run", "--prompt", "x", "--max-tokens", "-1"],
    ["run", "--prompt", "x", "--max-tokens", "0"],
    ["run", "--prompt", "x", "--temp", "nan"],
    ["run", "--prompt", "x", "--temp", "inf"],
    ["run", "--prompt", "x", "--temp", "-0.5"],
    ["run", "--prompt", "x", "--top-p", "nan"],
    ["run", "--prompt", "x", "--top-p", "1.5"],
    ["run", "--prompt", "x", "--top-k", "-1"],
    ["run", "--prompt", "x", "--min-p", "1"],
    ["run", "--prompt", "x", "--draft-depth", "0"],
    ["run", "--prompt", "x", "--draft-depth", "99"],
    ["run", "--prompt", "x", "--prefill-chunk", "-64"],
    ["run", "--prompt", "x", "--memory-gb", "0"],
    ["run", "--prompt", "x", "--memory-gb", "nan"],
    ["run", "--prompt", "x", "--verify-tol", "-1"],
    ["run", "--prompt", "x", "--verify-tokens", "0"],
    ["run", "--prompt", "x", "--ane-fraction", "1.5"],
    ["run", "--prompt", "x", "--ane-fraction", "nan"],
    ["plan", "--context", "0"],
    ["plan", "--chunk", "0"],
    ["plan", "--ane-fraction", "-0.1"],
    ["plan", "--accepted-length", "0.5"],
    ["plan", "--prompt-tokens", "-5"],
    ["plan", "--draft-depth", "0"],
    ["check", "--context", "-1"],
    ["tune", "--tokens", "0"],
    ["serve", "--port", "0"],
    ["serve", "--port", "70000"],
    ["serve", "--max-concurrent", "0"],
    ["serve", "--prefix-cache-max-gb", "-1"],
    ["serve", "--session-cache-max-gb", "inf"],
    ["convert", "--coreml", "--out", "x", "--ane-fraction", "1.5"],  # (0 parses: GPU-only, which --coreml refuses)
    ["serve", "--draft-depth", "0"],
    ["prefill", "--prompt-file", "p", "--out", "c.safetensors", "--ane-fraction", "2"],
    ["doctor", "--ane-fraction", "-1"],
    ["convert", "--coreml", "--out", "x", "--chunk-size", "0"],
    ["convert", "--coreml", "--out", "x", "--context", "4096,-1"],
    ["convert", "--coreml", "--out", "x", "--context", ","],
])
def test_out_of_range_options_are_refused_in_one_line(capsys, args):
    rc, out, err = cli(capsys, *args)
    assert_one_line(rc, err, f"argument {next(a for a in reversed(args) if a.startswith('--'))}")
    assert out == ""


def test_invalid_utf8_prompt_in_argv_is_one_line():
    out = cli_process("run", "--prompt", b"def \xff\xfe(", "--max-tokens", "2")
    assert_one_line(out.returncode, out.stderr.decode(), "--prompt is not valid UTF-8")


def test_invalid_utf8_prompt_on_stdin_is_one_line():
    out = cli_process("run", "--prompt", "-", "--max-tokens", "2", stdin=b"import os\n\xc3\x28")
    assert_one_line(out.returncode, out.stderr.decode(), "stdin is not valid UTF-8", "0xc3")


def test_serve_session_cache_that_is_a_file_is_one_line(tmp_path, capsys):
    file = tmp_path / "cache"
    file.write_text("not a directory")
    rc, out, err = cli(capsys, "serve", "--session-cache", str(file), "--port", str(free_port()))
    assert_one_line(rc, err, "is a file, not a directory")
    assert "serving on" not in out


def test_tune_tokens_zero_is_one_line(capsys):
    rc, _, err = cli(capsys, "tune", "--tokens", "0")
    assert_one_line(rc, err, "--tokens", "integer >= 1")


def test_an_internal_error_is_one_line_and_debug_shows_the_traceback(tiny, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise KeyError("layers.7")  # stands in for any bug below the CLI

    monkeypatch.setattr("hetero.cli.main.preflight", broken)  # the name `hetero check` calls
    rc, _, err = cli(capsys, "check", "--model", str(tiny))
    assert_one_line(rc, err, "KeyError", "--debug")
    with pytest.raises(KeyError):
        main(["check", "--model", str(tiny), "--debug"])


# ----------------------------------------------------------------------------------------------------------
# CLI manners


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bare_hetero_prints_help():
    out = cli_process()
    assert out.returncode == 0
    text = out.stdout.decode()
    assert "usage: hetero" in text and all(c in text for c in ("run", "serve", "check", "plan", "tune", "convert"))


def test_version(capsys):
    rc, out, _ = cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"hetero {hetero.__version__}"


def test_every_option_help_shows_its_default():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if action.nargs == 0 or action.required or not action.option_strings:
                continue  # flags (off unless given), required options and positionals have no default to show
            shown = formatter._expand_help(action) if action.help else ""
            assert "default" in shown, f"hetero {name} {action.option_strings[0]}: help shows no default: {shown!r}"


def test_port_in_use_fails_before_serving_is_printed():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        out = cli_process("serve", "--port", str(busy.getsockname()[1]), "--no-session-cache")
    assert_one_line(out.returncode, out.stderr.decode(), "is in use", "--port")
    assert b"serving on" not in out.stdout


def test_convert_lint_on_a_missing_path_fails_at_once():
    probe = ("import sys; from hetero.cli.main import main; rc = main(['convert', '--lint', '/no/such/exports']); "
             "print(rc, 'coremltools' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["1", "False"], out.stderr  # refused before the Core ML tooling (coremltools) loads
    assert_one_line(1, out.stderr, "no such file or directory")


# ----------------------------------------------------------------------------------------------------------
# Fuzz: config.json and safetensors headers through the real loader

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 2**70), st.sampled_from([0, 1, 2, 3, 16, 32, 64, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=8)
CONFIG_KEYS = [
    "model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "vocab_size", "layer_types", "rope_parameters",
    "rope_scaling", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "mtp_num_hidden_layers",
    "eos_token_id", "full_attention_interval", "text_config", "quantization", "num_experts", "mlp_only_layers",
    "decoder_sparse_step", "partial_rotary_factor", "rope_theta", "attention_bias",
]


def load_or_refuse(model: Path) -> None:
    """Pre-flight, load and generate: either works or raises HeteroError (anything else is a bug)."""
    report = preflight(model)
    assert all(isinstance(e, str) for e in report.errors)
    try:
        hetero.load(model).generate("def add", max_tokens=2)
    except HeteroError as e:
        assert "\n" not in str(e)


CONFIG_VALUES = st.one_of(  # mostly near the real values, so that some configs get past the first check
    st.integers(0, 70), st.sampled_from([None, 1e-6, 0.5, 10_000.0, True, False]),
    st.lists(st.sampled_from(["linear_attention", "full_attention", "moe"]), max_size=4), JSON_VALUES,
)


@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), CONFIG_VALUES), min_size=1, max_size=3),
       nest=st.booleans())
def test_fuzzed_config_loads_or_is_refused_in_one_line(tiny, tmp_path_factory, edits, nest):
    model = tmp_path_factory.mktemp("fuzz-config") / "m"

    def edit(c):
        c = {**c, **dict(edits)}
        return {"model_type": "qwen3_5", "text_config": c} if nest else c

    load_or_refuse(copy_with_config(tiny, model, edit))


HEADER_ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.one_of(st.sampled_from(["F32", "F16", "BF16", "U32", "I64", "F8_E4M3", "X"]), JSON_VALUES),
    "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=3), JSON_VALUES),
    "data_offsets": st.one_of(st.lists(st.integers(-2, 2**40), min_size=2, max_size=2), JSON_VALUES),
})


@FUZZ
@given(header=st.one_of(JSON_VALUES, st.dictionaries(st.sampled_from(["model.embed_tokens.weight", "lm_head.weight",
                                                                       "__metadata__", "x"]), HEADER_ENTRY,
                                                      max_size=3)),
       keep=st.booleans(), extra=st.binary(max_size=64))
def test_fuzzed_safetensors_header_loads_or_is_refused(tiny, tmp_path_factory, header, keep, extra):
    model = tmp_path_factory.mktemp("fuzz-header") / "m"
    shutil.copytree(tiny, model)
    if keep:  # the real header with the fuzzed entries merged in: the rest of the file stays plausible
        raw = (tiny / "model.safetensors").read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        real = json.loads(raw[8:8 + n])
        header = {**real, **header} if isinstance(header, dict) else header
        write_safetensors_header(model / "model.safetensors", header, raw[8 + n:])
    else:
        write_safetensors_header(model / "model.safetensors", header, extra)
    load_or_refuse(model)


# ----------------------------------------------------------------------------------------------------------
# Server: one live server on loopback for the module


@pytest.fixture(scope="module")
def server(tiny):
    engine = hetero.load(tiny)
    engine.name = "model"  # the name requests below send
    live = LiveServer(engine)
    yield live
    live.stop()


def good_chat(server) -> dict:
    return {"model": "model", "messages": [{"role": "user", "content": "def add"}], "max_tokens": 2}


def post(server, path: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60, **kw)


def assert_still_answers(server) -> None:
    r = post(server, "/v1/chat/completions", good_chat(server))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
def test_deeply_nested_body_is_400(server, path):
    r = post(server, path, b"[" * 100_000)
    assert r.status_code == 400 and "nested too deeply" in r.text
    r = post(server, path, b'{"model": "model", "x": ' + b"[" * 80 + b"]" * 80 + b"}")
    assert r.status_code == 400 and "nested too deeply" in r.text
    assert_still_answers(server)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", b'{"model": "model", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("/v1/completions", b'{"model": "model", "max_tokens": 2, "prompt": "\\ud800"}'),
    ("/v1/messages", b'{"model": "model", "max_tokens": 2, "system": "\\udfff", "messages": [{"role": "user", "content": "x"}]}'),
    ("/v1/chat/completions", b'{"model": "model", "max_tokens": 2, "stop": ["\\ud800"], "messages": [{"role": "user", "content": "x"}]}'),
    ("/v1/chat/completions", b'{"model": "model", "\\ud800": 1, "messages": [{"role": "user", "content": "x"}]}'),
])
def test_lone_surrogate_is_400(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 400 and "lone surrogate" in r.text, r.text
    assert_still_answers(server)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value", [
    ("seed", -1), ("seed", 2**70), ("top_p", 0), ("min_p", 1), ("top_k", -1), ("temperature", -1),
    ("max_tokens", 0),
])
def test_parameters_the_engine_rejects_are_400_before_the_first_byte(server, field, value, stream):
    for path, body in (("/v1/chat/completions", good_chat(server)),
                       ("/v1/completions", {"model": "model", "prompt": "def", "max_tokens": 2}),
                       ("/v1/messages", good_chat(server))):
        with httpx.stream("POST", server.url + path, json={**body, field: value, "stream": stream}, timeout=60) as r:
            r.read()
            assert r.status_code == 400, (path, r.text)
            assert r.headers["content-type"].startswith("application/json")
            assert field in r.text
    assert_still_answers(server)


@pytest.mark.parametrize("raw", [b'{"model": "model", "temperature": NaN}', b'{"model": "model", "top_p": Infinity}',
                                 b'{"max_tokens": ' + b"9" * 5000 + b"}", b"\xff\xfe", b"[1, 2]", b""])
def test_malformed_json_is_400(server, raw):
    r = post(server, "/v1/chat/completions", raw)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def fail_mid_generation(engine, error: Exception):
    """The engine streams one piece of text, then fails (stands in for a fault deep in generation)."""

    def generate(ids, on_text=None, progress=None, **kw):
        progress(0, len(ids))
        on_text("partial")
        raise error

    return generate


@pytest.mark.parametrize("error, status", [(RuntimeError("kernel exploded"), 500), (HeteroError("bad prompt"), 400)])
def test_failures_in_generation_are_json_errors_with_a_request_id(server, monkeypatch, error, status):
    engine = _served_engine(server)
    monkeypatch.setattr(engine, "generate", fail_mid_generation(engine, error))
    r = post(server, "/v1/chat/completions", good_chat(server))
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    message = r.json()["error"]["message"]
    assert str(error) in message
    if status == 500:
        assert r.json()["error"]["type"] == "server_error" and "chatcmpl-" in message
    r = post(server, "/v1/messages", good_chat(server))
    assert r.status_code == status and r.json()["type"] == "error" and str(error) in r.json()["error"]["message"]
    if status == 500:
        assert r.json()["error"]["type"] == "api_error" and "msg_" in r.json()["error"]["message"]


def fail_before_generating(error: Exception):
    """The engine fails before it reports any progress (stands in for a check deep in the engine)."""

    def generate(ids, **kw):
        raise error

    return generate


@pytest.mark.parametrize("error, status", [(RuntimeError("kernel exploded"), 500), (HeteroError("bad prompt"), 400)])
def test_a_stream_that_fails_before_generating_is_an_http_error(server, monkeypatch, error, status):
    engine = _served_engine(server)
    monkeypatch.setattr(engine, "generate", fail_before_generating(error))
    for path, body in (("/v1/chat/completions", good_chat(server)), ("/v1/messages", good_chat(server))):
        with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
            r.read()
        assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
        assert str(error) in r.text
    monkeypatch.undo()
    assert_still_answers(server)


def test_a_failure_mid_stream_sends_an_error_event(server, monkeypatch):
    engine = _served_engine(server)
    monkeypatch.setattr(engine, "generate", fail_mid_generation(engine, RuntimeError("kernel exploded")))
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = good_chat(server) if "chat" in path else {"model": "model", "prompt": "x", "max_tokens": 2}
        with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        error = json.loads(events[-1])["error"]
        assert "kernel exploded" in error["message"] and error["type"] == "server_error"
        assert "[DONE]" not in events
    with httpx.stream("POST", server.url + "/v1/messages", json={**good_chat(server), "stream": True}, timeout=60) as r:
        lines = list(r.iter_lines())
    assert "event: error" in lines
    error = json.loads(lines[lines.index("event: error") + 1][6:])
    assert error["type"] == "error" and "kernel exploded" in error["error"]["message"]
    monkeypatch.undo()
    assert_still_answers(server)


def _served_engine(server):
    """The Engine behind the live server (the routes close over it; /health reads the same object)."""
    for route in server.app.routes:
        for cell in getattr(route.endpoint, "__closure__", None) or ():
            if isinstance(cell.cell_contents, hetero.Engine):
                return cell.cell_contents
    raise AssertionError("no engine found behind the app")


# ----------------------------------------------------------------------------------------------------------
# Fuzz: request bodies

FIELD_VALUES = st.one_of(JSON_VALUES, st.integers(-3, 4), st.floats(-1, 3), st.sampled_from(["\ud800", "x\udfff"]))
CONTENT = st.one_of(
    st.text(max_size=12), JSON_VALUES,
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_result", "tool_use", "image"])},
                                    optional={"text": st.one_of(st.text(max_size=8), JSON_VALUES),
                                              "content": st.one_of(st.text(max_size=8), JSON_VALUES),
                                              "name": st.text(max_size=4), "input": JSON_VALUES}), max_size=2),
)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "developer"]),
                                                   JSON_VALUES)}, optional={"content": CONTENT})
# Each field is mostly in range (so that generation runs, streamed or not) and sometimes anything at all
MUTATIONS = {
    "model": st.one_of(st.just("model"), JSON_VALUES),
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), JSON_VALUES),
    "prompt": st.one_of(st.text(max_size=12), st.lists(st.integers(-2, 400), max_size=4), JSON_VALUES),
    "system": st.one_of(st.text(max_size=8), CONTENT),
    "max_tokens": st.one_of(st.integers(-1, 3), FIELD_VALUES),
    "max_completion_tokens": st.one_of(st.integers(1, 3), FIELD_VALUES),
    "temperature": st.one_of(st.floats(0, 2), FIELD_VALUES),
    "top_p": st.one_of(st.floats(0, 1), FIELD_VALUES),
    "top_k": st.one_of(st.integers(0, 400), FIELD_VALUES),
    "min_p": st.one_of(st.floats(0, 1), FIELD_VALUES),
    "seed": st.one_of(st.integers(-2**70, 2**70), st.integers(0, 2**64 - 1), FIELD_VALUES),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), FIELD_VALUES),
    "stop_sequences": st.one_of(st.lists(st.text(max_size=3), max_size=3), FIELD_VALUES),
    "stream": st.one_of(st.booleans(), FIELD_VALUES),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), FIELD_VALUES),
    "n": st.one_of(st.just(1), FIELD_VALUES),
    "mtp": st.one_of(st.booleans(), FIELD_VALUES),
    "ane_fraction": st.one_of(st.just(0), FIELD_VALUES),
}
BASE = {"model": "model", "messages": [{"role": "user", "content": "def add"}], "prompt": "def add", "max_tokens": 2}


@st.composite
def request_bodies(draw) -> dict | list:
    """A good request with a few fields changed (or added), now and then any JSON value at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON_VALUES)
    keys = draw(st.lists(st.sampled_from(sorted(MUTATIONS)), max_size=4, unique=True))
    return {**BASE, **{k: draw(MUTATIONS[k]) for k in keys}}


@FUZZ
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages"]), body=request_bodies())
def test_fuzzed_requests_never_get_a_500(server, path, body):
    raw = json.dumps(body).encode("utf-8", "surrogatepass")  # lone surrogates travel as \\udXXX escapes
    with httpx.stream("POST", server.url + path, content=raw, headers={"content-type": "application/json"},
                      timeout=60) as r:
        text = r.read().decode("utf-8", "replace")
    assert r.status_code < 500, text
    if r.status_code >= 400:
        assert r.headers["content-type"] == "application/json" and "error" in json.loads(text)
    elif r.headers["content-type"].startswith("text/event-stream"):  # a valid request streams to its end
        assert ("event: message_stop" if path == "/v1/messages" else "data: [DONE]") in text, text
    else:
        assert "choices" in json.loads(text) or "content" in json.loads(text)


def test_server_answers_after_the_fuzzing(server):
    assert_still_answers(server)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"

