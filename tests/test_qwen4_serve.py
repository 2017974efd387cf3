"""Serving a qwen4_exp checkpoint: `hetero serve` on loopback with the official OpenAI SDK, `/v1/chat/completions`
and `/v1/responses`, streamed and not, on a tiny random Qwen4-Exp (hyper-connections, QSA, PLE, MTP head) that
ships its own chat template: Qwen3.6's (tests/data/qwen3.6_chat_template.jinja: the XML tool-call form, a <think>
block opened by the generation prompt) over a byte-level BPE with Qwen's tags as added tokens.

The weights are random, so what the model says is forced where a test needs it: a named `tool_choice` puts the
call under the call grammar (the call is then parsed from the model's own tokens), a thinking budget closes the
think block (its reasoning is then split from the answer). Each test fails if the qwen4 model broke that path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import qwen4_checkpoint as qc
from test_responses import raw_events
from test_tool_server import openai_stream
from tool_model import train_tokenizer

import hetero
from hetero.training.tokenizer_train import save_tokenizer
from tiny_checkpoint import TEXT as CORPUS

TEMPLATE = (Path(__file__).parent / "data" / "qwen3.6_chat_template.jinja").read_text(encoding="utf-8")
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
BUDGET = 8  # thinking tokens before the budget closes the block


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4serve")
    tok = train_tokenizer([CORPUS * 2, "<think>\nLet me see.\n</think>\n\nThe answer."], vocab_size=400)
    qc.build(path, nested=True, ple_layer_ids=(1, 2), seed=21, mtp=True, vocab_size=64 * -(-tok.get_vocab_size() // 64),
             eos_token_id=tok.token_to_id("<|im_end|>"))
    save_tokenizer(tok, path)
    config = path / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": TEMPLATE}))
    return hetero.load(str(path))


def test_the_served_model_is_qwen4_exp_with_its_template(engine):
    assert engine.tokenizer.chat_template == TEMPLATE
    assert engine.model.__class__.__module__.startswith("hetero.models.qwen4_exp") and engine.model.has_mtp


FORCED = {"type": "function", "function": {"name": "get_weather"}}


def test_chat_completions_tool_call_streamed_and_not(oai, model):
    """A named tool_choice: the call is decoded under the call grammar and parsed from the model's tokens into
    `tool_calls`, the same whole and streamed."""
    body = dict(model=model, messages=ASK, tools=[TOOL], tool_choice=FORCED, max_tokens=60, temperature=0.0)
    choice = oai.chat.completions.create(**body).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    content, _, calls, finish = openai_stream(oai, **body)
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_chat_completions_reasoning_split_streamed_and_not(oai, model):
    """The template opens <think>; the budget closes it: the reasoning comes back as `reasoning_content`, apart from
    the answer, with no tag in either, the same whole and streamed."""
    body = dict(model=model, messages=ASK, max_tokens=24, temperature=0.0,
                extra_body={"max_thinking_tokens": BUDGET})
    message = oai.chat.completions.create(**body).choices[0].message
    reasoning, answer = message.model_extra["reasoning_content"], message.content or ""
    assert reasoning and "think>" not in reasoning + answer
    content, streamed_reasoning, calls, _ = openai_stream(oai, **body)
    assert (streamed_reasoning, content, list(calls)) == (reasoning, answer, [])


def test_responses_tool_call_streamed_and_not(oai, model, server):
    """`/v1/responses` with a forced function tool: one function_call item, parsed by the SDK whole, and in the
    stream every event valid as the SDK's own types, ending in the same call."""
    body = dict(model=model, input=ASK[0]["content"], tools=[{"type": "function", **TOOL["function"]}],
                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60, temperature=0.0)
    response = oai.responses.create(**body)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    events = raw_events(server, body)
    done = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(i.name, i.arguments) for i in done.output if i.type == "function_call"] == [
        (calls[0].name, calls[0].arguments)]


def test_responses_reasoning_streamed_and_not(oai, model, server):
    """`/v1/responses` with a thinking budget: a reasoning item first, then the message; the stream's completed
    response carries the same items."""
    body = dict(model=model, input=ASK[0]["content"], max_output_tokens=24, temperature=0.0)
    response = oai.responses.create(**body, extra_body={"max_thinking_tokens": BUDGET})
    assert response.output[0].type == "reasoning" and response.output[0].content[0].text
    assert "think>" not in response.output[0].content[0].text + response.output_text
    events = raw_events(server, {**body, "max_thinking_tokens": BUDGET})
    done = events[-1].response  # the random answer runs to max_output_tokens: incomplete, as the whole one says
    assert events[-1].type == f"response.{response.status}" and done.status == response.status
    assert done.output[0].content[0].text == response.output[0].content[0].text
    assert done.output_text == response.output_text


def test_an_in_process_server_in_a_background_thread_exits_cleanly(tmp_path):
    """uvicorn run in a daemon thread (as a library user or a test embeds the server) makes the runner's workers
    daemon threads too. Left alive until interpreter exit (a pytest fixture's server, freed at exit), a worker that
    ran the compiled qwen4 steps dropped MLX's per-thread compile cache without the GIL and the process aborted
    ("terminate called without an active exception", status 134) after every test had passed. The server's lifespan
    now ends its workers when it stops (`Runner.close`). Run as its own pytest session, which is where it struck."""
    import subprocess
    import sys

    path = tmp_path / "ckpt"
    qc.build(path, ple_layer_ids=(1, 2), seed=0, mtp=True)
    qc.add_tokenizer(path)
    module = tmp_path / "test_embedded_server.py"
    module.write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import pytest\nimport hetero\nfrom test_server import LiveServer\n\n\n"
        "@pytest.fixture(scope='module')\ndef live():\n"
        f"    server = LiveServer(hetero.load({str(path)!r}), max_batch=1, draft_depth=3)\n"
        "    yield server\n    server.stop()\n\n\n"
        "def test_two_requests(live):\n    client = live.openai()\n    for _ in range(2):\n"
        "        client.completions.create(model=client.models.list().data[0].id, prompt='def add(a, b):',\n"
        "                                  max_tokens=6, temperature=0)\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(module)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "1 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]


def test_a_vision_config_of_an_architecture_that_reads_text_only_refuses_images_in_one_line(engine):
    """The nested checkpoint carries transformers' vision_config, but hetero does not read the qwen4_exp tower
    (`Architecture.reads_images`): an image is refused in one line before any tower runs. Regression: the Qwen3.5
    tower was built from that config and an image ended in an internal matmul error."""
    import io

    from PIL import Image

    assert isinstance(engine.config.get("vision_config"), dict) and engine.vision is None
    png = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(png, format="PNG")
    with pytest.raises(hetero.HeteroError, match="reads text only") as e:
        engine.image_prompt([1, 2, 3], [png.getvalue()])
    assert "\n" not in str(e.value)
