"""`hetero run / check / convert` end to end on the bundled model, and the library API behind them."""

import json
import subprocess
import sys

import numpy as np
import pytest

import hetero

JSON_KEYS = {
    "text", "tokens", "prompt_tokens", "generated_tokens", "ttft_s", "prefill_tps", "decode_tps",
    "peak_memory_bytes", "model", "finish_reason",
}


def hetero_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetero.cli.main", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def engine() -> hetero.Engine:
    return hetero.load()


def test_run_json_has_the_documented_keys(engine):
    out = hetero_cli("run", "--prompt", "import os\n", "--max-tokens", "12", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert JSON_KEYS <= result.keys()
    assert result["model"] == "bundled"
    assert result["prompt_tokens"] == len(engine.tokenizer.encode("import os\n"))
    assert result["generated_tokens"] == len(result["tokens"]) <= 12
    assert result["text"] == engine.tokenizer.decode(result["tokens"])
    assert result["ttft_s"] > 0 and result["peak_memory_bytes"] > 0
    assert result["finish_reason"] in ("stop", "length")


def test_streamed_text_equals_json_text_and_library_greedy():
    streamed = hetero_cli("run", "--prompt", "def parse(", "--max-tokens", "20")
    as_json = json.loads(hetero_cli("run", "--prompt", "def parse(", "--max-tokens", "20", "--json").stdout)
    assert streamed.returncode == 0
    assert streamed.stdout.rstrip("\n") == as_json["text"].rstrip("\n")
    assert "decode" in streamed.stderr and "tok/s" in streamed.stderr


def test_prompt_from_stdin_and_chat_template(engine):
    piped = json.loads(hetero_cli("run", "--prompt", "-", "--max-tokens", "4", "--json", stdin="class Foo:").stdout)
    assert piped["prompt_tokens"] == len(engine.tokenizer.encode("class Foo:"))
    chat = json.loads(hetero_cli("run", "--prompt", "hello", "--chat", "--max-tokens", "4", "--json").stdout)
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat["prompt_tokens"] == len(engine.tokenizer.encode(rendered))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/dir"], "no such directory"),
        (["--top-p", "0"], "--top-p: must be a number in (0, 1]"),
        (["--prefill-chunk", "0"], "--prefill-chunk: must be an integer >= 1"),
    ],
)
def test_user_errors_are_one_line_without_traceback(args, message):
    out = hetero_cli("run", "--prompt", "x", *args)
    assert out.returncode == 1
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_prompt_longer_than_the_window_is_refused(engine):
    window = engine.max_context
    out = hetero_cli("run", "--prompt", "-", "--max-tokens", "2", stdin="a = 1\n" * window)
    assert out.returncode == 1 and f"context window is {window}" in out.stderr


def test_check_reports_the_bundled_model():
    out = hetero_cli("check", "--json")
    assert out.returncode == 0
    report = json.loads(out.stdout)
    assert report["ok"] and report["has_mtp"] and report["model_type"] == "qwen3_5"


def test_convert_quantize_writes_a_model_that_runs(tmp_path):
    out = hetero_cli("convert", "--quantize", "4", "--out", str(tmp_path / "q4"))
    assert out.returncode == 0, out.stderr
    config = json.loads((tmp_path / "q4" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4}
    ran = hetero_cli("run", "--model", str(tmp_path / "q4"), "--prompt", "import ", "--max-tokens", "8", "--json")
    assert ran.returncode == 0 and json.loads(ran.stdout)["generated_tokens"] > 0
    again = hetero_cli("convert", "--quantize", "4", "--out", str(tmp_path / "q4"))
    assert again.returncode == 1 and "not empty" in again.stderr


def test_library_logits_match_generation(engine):
    ids = engine.tokenizer.encode("for i in range(10):\n")
    logits = engine.logits(ids)
    assert logits.dtype == np.float32 and logits.shape == (len(ids), engine.model.args.vocab_size)
    first = engine.generate(ids, max_tokens=1, temperature=0).tokens
    assert first == [int(np.argmax(logits[-1]))] or (first == [] and int(np.argmax(logits[-1])) in engine.eos_ids)
    # prefill in small chunks gives the same logits as one pass
    assert np.allclose(engine.logits(ids, chunk=3), logits, atol=1e-4 * np.abs(logits).max())


def test_seeded_sampling_repeats(engine):
    a = engine.generate("def ", max_tokens=16, temperature=0.9, top_p=0.95, seed=3)
    b = engine.generate("def ", max_tokens=16, temperature=0.9, top_p=0.95, seed=3)
    assert a.tokens == b.tokens and a.text == b.text


def test_eos_stops_generation(engine):
    greedy = engine.generate("def ", max_tokens=8).tokens
    assert greedy, "the bundled model should produce a token after 'def '"
    saved = engine.eos_ids
    engine.eos_ids = saved | {greedy[3]}
    try:
        stopped = engine.generate("def ", max_tokens=8)
    finally:
        engine.eos_ids = saved
    assert stopped.tokens == greedy[: greedy.index(greedy[3])]
    assert stopped.stats["finish_reason"] == "stop"


def test_run_json_names_the_blas_in_use(capsys):
    """`hetero run --json` reports the BLAS library MLX's CPU backend really uses (the one describe() finds)."""
    from hetero.cli.main import main
    import hetero.host.blas

    assert main(["run", "--prompt", "x", "--max-tokens", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["blas"] == hetero.host.blas.describe()


def test_run_penalty_flags_reach_the_decoder(engine, capsys):
    """`hetero run --logit-bias ID=BIAS` and the penalty flags give what the library gives with the same fields."""
    from hetero.cli.main import main

    greedy = engine.generate("def parse(", max_tokens=12, use_prefix_cache=False).tokens
    fields = dict(logit_bias={greedy[0]: -100.0}, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.2)
    library = engine.generate("def parse(", max_tokens=12, use_prefix_cache=False, **fields).tokens
    assert main(["run", "--prompt", "def parse(", "--max-tokens", "12", "--json", "--logit-bias", f"{greedy[0]}=-100",
                 "--presence-penalty", "1.5", "--frequency-penalty", "0.5", "--repetition-penalty", "1.2"]) == 0
    tokens = json.loads(capsys.readouterr().out)["tokens"]
    assert tokens == library and tokens[0] != greedy[0]
