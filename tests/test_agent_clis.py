"""Claude Code, Codex CLI and OpenCode, the real npm releases at pinned versions, finish their turns against
`hetero serve`, inside a network namespace with only loopback (tests/agent_clis.py runs them).

The plain and cached turns run on the bundled model as a user gets it; the tool loop runs on a tiny model trained
here (tests/agent_model.py, cached between runs) that calls the CLI's own shell tool. Where namespaces or npm are missing these tests skip
with the reason, except under CI, where that is a failure.
"""

from __future__ import annotations

import os

import pytest

import agent_clis
from agent_model import CALLS, FINAL_ANSWER, PROMPTS, PROOF_FILE, cached_agent_model
from hetero.checkpoint.source import BUNDLED_MODEL

CLIS = sorted(agent_clis.PINS)


@pytest.fixture(scope="module")
def cli_bin():
    why = agent_clis.namespaces_available()
    try:
        bin_dir = None if why else agent_clis.install()
    except agent_clis.Unavailable as e:
        why = str(e)
    if why:
        message = f"THE AGENT CLI TESTS DID NOT RUN: {why}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return bin_dir


def _main_request(turn: dict) -> dict:
    main = agent_clis.main_request(turn)
    assert main is not None, f"the turn made no generating request: {turn['requests']}"
    return main


def _finished(turn: dict, cli: str) -> None:
    assert turn["returncode"] == 0, f"{cli} exited {turn['returncode']}:\n{turn['stderr'][-2000:]}\n{turn['stdout'][-2000:]}"
    assert turn["reply"]["error"] is None, turn["reply"]["error"]
    assert all(r["status"] == "200" for r in turn["requests"] if r["method"] == "POST"), turn["requests"]


@pytest.mark.parametrize("cli", CLIS)
def test_a_plain_turn_then_a_second_turn_from_the_prefix_cache(cli, cli_bin, tmp_path):
    result = agent_clis.session(cli, str(BUNDLED_MODEL), ["Say hello.", "Thanks. Say it once more."], tmp_path,
                                cli_bin)
    first, second = result["turns"]
    for turn in (first, second):
        _finished(turn, cli)
        assert turn["reply"]["text"].strip(), f"{cli} showed no reply text: {turn['stdout'][-2000:]}"
        assert int(_main_request(turn)["completion"]) > 0
    assert int(_main_request(second)["cached"]) > 0, second["requests"]  # the first turn's prompt, not re-read


@pytest.mark.parametrize("cli", CLIS)
def test_a_tool_loop_runs_the_clients_shell_tool_then_answers(cli, cli_bin, tmp_path):
    model = cached_agent_model(cli)  # trained here the first time (about a minute), then cached
    tools = [CALLS[cli][0]] if cli == "claude" else None  # Claude Code asks before Bash unless told it may run it
    result = agent_clis.session(cli, str(model), [PROMPTS[cli]], tmp_path, cli_bin, tools=tools)
    (turn,) = result["turns"]
    _finished(turn, cli)
    assert PROOF_FILE in result["files"], f"{cli} did not run the tool call: {turn['stdout'][-3000:]}"
    assert FINAL_ANSWER in turn["reply"]["text"], turn["reply"]
    assert len([r for r in turn["requests"] if "prompt" in r]) >= 2  # the call, then the answer to its result


def test_claude_code_sends_a_pasted_screenshot_the_model_reads(cli_bin, tmp_path):
    """Claude Code sends a screenshot as its SDK does (a base64 `image` block) to a tiny VL checkpoint: the server reads
    it (no placeholder warning), and the next message reads the whole first prompt, image included, from the cache."""
    import base64

    from tests.vision_checkpoint import draw_image, encoded, save_chat_tokenizer, save_vl

    model = tmp_path / "vlm"
    model.mkdir()
    save_vl(model, "small")
    save_chat_tokenizer(model)
    shot = base64.b64encode(encoded(draw_image(320, 200), "PNG")).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": shot}}
    messages = [[image, {"type": "text", "text": "What does this screenshot show?"}], "And the colours?"]
    result = agent_clis.session("claude", str(model), [messages], tmp_path / "run", cli_bin, system="Answer briefly.")
    (turn,) = result["turns"]
    _finished(turn, "claude")
    first, second = [r for r in turn["requests"] if "prompt" in r]
    assert "image(s) omitted" not in result["server_log"]
    assert int(second["cached"]) == int(first["prompt"]), turn["requests"]  # the image's tokens came from the cache
