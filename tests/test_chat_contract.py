"""The checkpoint's chat contract (issue 34, part 4), on a tiny checkpoint whose chat template is written like
Qwen3.8-27B's (tests/thinking_model.py): its variables, reasoning-effort levels and think-block closing text read
from the template; each API's effort mapped onto the levels by the table in docs/server.md; a level the template
refuses as a 400 carrying its own message; preserve_thinking on by default; Qwen3.8's sampler defaults from
generation_config.json; and the thinking budget, exact under MTP, through real HTTP with the openai and anthropic
SDKs."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import openai
import pytest
import tokenizers
from test_server import LiveServer
from thinking_model import SAMPLER_DEFAULTS, TEMPLATE, THINK_PROMPT, write_thinking_model
from tiny_checkpoint import write_tiny_model
from tool_model import TEMPLATE as QWEN36_TEMPLATE

import hetero
from hetero.checkpoint.chat_contract import EFFORTS, chat_contract
from hetero.checkpoint.tokenizer import Tokenizer
from hetero.errors import HeteroError
from hetero.server.anthropic import parse_messages
from hetero.server.openai import parse_chat
from hetero.server.requests import Parser, RequestError
from hetero.server.responses import ResponseStore, parse_responses
from hetero.server.thinking import thinking_budget
from hetero.tools.thinking_budget import ThinkingBudget
from hetero.training.tokenizer_train import CHAT_TEMPLATE as CHATML_TEMPLATE

DOCS = Path(__file__).resolve().parent.parent / "docs" / "server.md"
REFUSED = "reasoning_effort must be one of low, medium, xhigh; got extreme"  # the template's own message
BUDGET = 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return hetero.load(str(write_thinking_model(tmp_path_factory.mktemp("thinking") / "model")))


def template_tokenizer(template: str) -> Tokenizer:
    """A tokenizer that only renders `template` (the contract reads nothing else)."""
    return Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), chat_template=template)


def prompt_ids(engine, messages=THINK_PROMPT, **kwargs) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                        preserve_thinking=True, **kwargs))


def block_end(engine, tokens: list[int]) -> int | None:
    """How many tokens the think block takes, its closing text included (None: it is never closed)."""
    close = engine.tokenizer.encode(chat_contract(engine.tokenizer).think_close)
    return next((i + len(close) for i in range(len(tokens)) if tokens[i : i + len(close)] == close), None)


# ------------------------------------------------------------------------------------------------------------
# The contract, read from the template


def test_the_contract_is_read_from_the_template():
    qwen38 = chat_contract(template_tokenizer(TEMPLATE))
    assert {"reasoning_effort", "preserve_thinking", "enable_thinking"} <= qwen38.variables
    assert qwen38.levels == ("low", "medium", "xhigh")  # the only ones it renders; it raises on the rest
    assert qwen38.think_close == "\n</think>\n\n"  # what it writes between a turn's reasoning and its answer
    assert qwen38.defaults() == {"preserve_thinking": True}
    qwen36 = chat_contract(template_tokenizer(QWEN36_TEMPLATE))
    assert not qwen36.names_effort and qwen36.levels == () and qwen36.think_close == "\n</think>\n\n"
    chatml = chat_contract(template_tokenizer(CHATML_TEMPLATE))  # no think block, no switches
    assert chatml.think_close is None and chatml.defaults() == {}
    free = chat_contract(template_tokenizer("Reasoning: {{ reasoning_effort }}\n{{ messages[0].content }}"))
    assert free.levels == EFFORTS  # a template that takes any value: every name passes as it is
    assert all(free.effort(name) == {"reasoning_effort": name} for name in EFFORTS)
    no_think = template_tokenizer("{% if enable_thinking is false %}<think></think>{% endif %}{{ messages[0].content }}"
                                  )
    assert chat_contract(no_think).think_close is None  # "<think></think>" closes no open block: nothing to force


def test_the_effort_table_in_the_docs_is_the_code():
    """docs/server.md's table, row by row, is what ChatContract.effort gives for a Qwen3.8-like template and for
    a template without reasoning_effort (Qwen3.6's) on the OpenAI routes."""
    def cell(kwargs: dict) -> str:
        ((name, value),) = kwargs.items()
        return f"`{name}: {str(value).lower()}`"

    rows = re.findall(r"^\| `(\w+)` \| (`[^|]+`) \| (`[^|]+`) \|$", DOCS.read_text(encoding="utf-8"), re.M)
    assert [name for name, _, _ in rows] == list(EFFORTS)
    qwen38, qwen36 = chat_contract(template_tokenizer(TEMPLATE)), chat_contract(template_tokenizer(QWEN36_TEMPLATE))
    for name, levels, switch in rows:
        assert (cell(qwen38.effort(name)), cell(qwen36.effort(name))) == (levels, switch), name
    assert qwen36.effort("high", switch=False) == {}  # Anthropic: `thinking` is that template's switch


def test_effort_reaches_the_template_from_each_api(engine):
    parser = Parser(engine, {"m"})
    chat = {"model": "m", "messages": THINK_PROMPT}
    assert "Reasoning effort: xhigh\n" in parse_chat(parser, {**chat, "reasoning_effort": "high"}).reply.prompt
    assert "Reasoning effort: low\n" in parse_chat(parser, {**chat, "reasoning_effort": "minimal"}).reply.prompt
    off = parse_chat(parser, {**chat, "reasoning_effort": "none"}).reply.prompt
    assert off.endswith("<think>\n\n</think>\n\n") and "Reasoning effort" not in off
    sent = parse_chat(parser, {**chat, "reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert "Reasoning effort: low\n" in sent.reply.prompt  # the template's own variable, sent as such, wins
    responses = parse_responses(ResponseStore())(parser, {"model": "m", "input": "hi",
                                                          "reasoning": {"effort": "medium"}})
    assert "Reasoning effort: medium\n" in responses.reply.prompt
    messages = parse_messages(parser, {**chat, "max_tokens": 8, "output_config": {"effort": "max"}})
    assert "Reasoning effort: xhigh\n" in messages.reply.prompt
    assert "Reasoning effort" not in parse_chat(parser, chat).reply.prompt  # not sent: the template's default


def test_a_level_the_template_refuses_is_a_400_with_its_message_in_each_api(oai, claude, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=THINK_PROMPT, max_tokens=1, reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort" and REFUSED in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, input="hi", max_output_tokens=1, reasoning={"effort": "extreme"})
    assert e.value.body["param"] == "reasoning.effort" and REFUSED in e.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model, messages=THINK_PROMPT, max_tokens=1, output_config={"effort": "extreme"})
    assert e.value.body["error"]["type"] == "invalid_request_error" and REFUSED in e.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:  # sent as the template's variable: the template refuses it too
        oai.chat.completions.create(model=model, messages=THINK_PROMPT, max_tokens=1,
                                    extra_body={"chat_template_kwargs": {"reasoning_effort": "extreme"}})
    assert REFUSED in e.value.body["message"]


def test_preserve_thinking_is_on_by_default(engine):
    parser = Parser(engine, {"m"})
    history = [{"role": "user", "content": "First?"},
               {"role": "assistant", "content": "One.", "reasoning_content": "EARLIER-REASONING"},
               {"role": "user", "content": "Second?"}]
    assert "EARLIER-REASONING" in parse_chat(parser, {"model": "m", "messages": history}).reply.prompt
    off = {"model": "m", "messages": history, "chat_template_kwargs": {"preserve_thinking": False}}
    assert "EARLIER-REASONING" not in parse_chat(parser, off).reply.prompt


def test_sampler_defaults_come_from_generation_config(engine):
    job = parse_chat(Parser(engine, {"m"}), {"model": "m", "messages": THINK_PROMPT})
    s = job.options.sampling
    assert {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k} == SAMPLER_DEFAULTS


# ------------------------------------------------------------------------------------------------------------
# The thinking budget, token by token


def budget(engine, n: int, opened: bool = True) -> ThinkingBudget:
    tok, close = engine.tokenizer, chat_contract(engine.tokenizer).think_close
    return ThinkingBudget(n, tok.encode(close), close.strip(), opened, tok.decode, engine.eos_ids,
                          engine.model.args.vocab_size)


def test_the_budget_forces_the_closing_text_and_rolls_back(engine):
    tok = engine.tokenizer
    close = tok.encode(chat_contract(tok).think_close)
    word = tok.encode("a")[0]
    b = budget(engine, len(close) + 2)
    for _ in range(2):
        assert b.mask().all()
        b.advance(word)
    for c in close:  # two thinking tokens spent: only the closing text may follow, one token at a time
        assert b.mask().sum() == 1 and b.mask()[c]
        b.advance(c)
    assert b.mask().all()  # the answer is free
    masks = b.recent_masks(len(close) + 1)  # [n, V]: the states a verify pass over the closing text reads
    assert masks.shape == (len(close) + 1, engine.model.args.vocab_size)
    assert masks.sum(axis=1).tolist() == [1] * len(close) + [masks.shape[1]]
    b.rollback(len(close) + 1)  # rejected drafts: back to one thinking token spent
    assert b.mask().all()
    b.advance(word)
    assert b.mask().sum() == 1 and b.mask()[close[0]]
    with pytest.raises(RuntimeError):
        b.advance(word)
    eos = min(engine.eos_ids)
    b.advance(close[0])
    assert not b.ended and not b.mask()[eos]  # no end of turn inside the closing text


def test_a_block_the_model_closes_itself_or_never_opens_is_left_alone(engine):
    tok = engine.tokenizer
    b = budget(engine, 8)
    for t in tok.encode("ab</think>\n\n") + tok.encode("a") * 20:
        assert b.mask().all()
        b.advance(t)
    answer = budget(engine, 4, opened=False)  # the prompt left no block open and the output does not open one
    for t in tok.encode("Hello") + tok.encode("a") * 10:
        assert answer.mask().all()
        answer.advance(t)
    close = tok.encode(chat_contract(tok).think_close)
    opens = budget(engine, len(close) + 2, opened=False)
    for t in tok.encode("\n<think>") + tok.encode("a") * 2:
        opens.advance(t)
    assert opens.mask().sum() == 1  # counted from its open tag: two tokens spent, the closing text follows
    eos = min(engine.eos_ids)
    ended = budget(engine, 100)
    ended.advance(eos)
    assert ended.ended and ended.mask().sum() == len(engine.eos_ids)


def test_a_budget_ends_the_block_by_its_last_token_and_mtp_keeps_plain_output(engine):
    ids = prompt_ids(engine)
    free = engine.generate(ids, max_tokens=300, temperature=0.0, mtp=False).tokens
    assert block_end(engine, free) is None  # left alone, the model thinks past 300 tokens
    plain = engine.generate(ids, max_tokens=120, temperature=0.0, mtp=False, thinking_budget=BUDGET).tokens
    end = block_end(engine, plain)
    close = len(engine.tokenizer.encode(chat_contract(engine.tokenizer).think_close))
    assert end == BUDGET and plain[: end - close] == free[: end - close]  # its own thinking, closed at the budget
    assert len(plain) > BUDGET  # then the answer
    spec = engine.generate(ids, max_tokens=120, temperature=0.0, mtp=True, draft_depth=3, thinking_budget=BUDGET)
    assert spec.tokens == plain and spec.stats["mtp"]["tokens_per_pass"] > 1  # drafts past the budget: never thinking
    sampled = engine.generate(ids, max_tokens=80, temperature=1.0, top_k=20, top_p=0.95, seed=3, mtp=True,
                              draft_depth=3, thinking_budget=16)
    assert (block_end(engine, sampled.tokens) or 0) <= 16 and "</think>" in sampled.text
    with pytest.raises(HeteroError, match="thinking_budget"):
        engine.generate(ids, max_tokens=4, thinking_budget=-1)


# ------------------------------------------------------------------------------------------------------------
# Through HTTP, with the SDKs (MTP on: the tests pin it as the server's default)


def test_budget_tokens_64_ends_thinking_by_the_closing_tag_then_answers(oai, claude, model, engine):
    body = dict(model=model, messages=THINK_PROMPT, temperature=0.0)
    free = oai.chat.completions.create(max_tokens=100, **body).choices[0].message
    assert free.content == "" and free.model_extra["reasoning_content"]  # thinks through all 100 tokens
    chat = oai.chat.completions.create(max_tokens=100, logprobs=True, extra_body={"max_thinking_tokens": BUDGET},
                                       **body).choices[0]
    tokens = [bytes(t.bytes).decode("utf-8", "replace") for t in chat.logprobs.content]
    closed = "".join(tokens[:BUDGET])
    assert "</think>" in closed and closed.endswith(chat_contract(engine.tokenizer).think_close)
    reasoning, answer = chat.message.model_extra["reasoning_content"], chat.message.content
    assert reasoning and answer and reasoning in free.model_extra["reasoning_content"]
    streamed = {"reasoning": "", "content": ""}
    for chunk in oai.chat.completions.create(max_tokens=100, stream=True, extra_body={"max_thinking_tokens": BUDGET},
                                             **body):
        delta = chunk.choices[0].delta if chunk.choices else None
        streamed["content"] += (delta and delta.content) or ""
        streamed["reasoning"] += (delta and (delta.model_extra or {}).get("reasoning_content")) or ""
    assert streamed == {"reasoning": reasoning, "content": answer}

    thinking = {"type": "enabled", "budget_tokens": BUDGET}
    body = dict(model=model, messages=THINK_PROMPT, extra_body={"temperature": 0.0})  # (this SDK has no argument)
    message = claude.messages.create(max_tokens=100, thinking=thinking, **body)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", reasoning), ("text", answer)]
    with claude.messages.stream(max_tokens=100, thinking=thinking, **body) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", reasoning), ("text", answer)]

    response = oai.responses.create(model=model, input=THINK_PROMPT[0]["content"], max_output_tokens=100,
                                    temperature=0.0, extra_body={"max_thinking_tokens": BUDGET})
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == reasoning and response.output_text == answer


def test_budgets_in_a_shared_decode_batch_give_the_answers_of_requests_alone(engine, oai, model):
    """--max-batch 2: two budgeted requests decoding in one batch (each row masked by its own budget) get what each
    gets alone."""
    def reply(client, budget: int):
        message = client.chat.completions.create(model=model, messages=THINK_PROMPT, max_tokens=100, temperature=0.0,
                                                 extra_body={"max_thinking_tokens": budget}).choices[0].message
        return message.model_extra["reasoning_content"], message.content

    alone = [reply(oai, budget) for budget in (BUDGET, 24)]
    batched = LiveServer(engine, max_batch=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda budget: reply(batched.openai(), budget), (BUDGET, 24)))
    finally:
        batched.stop()
    assert together == alone and len(alone[1][0]) < len(alone[0][0]) and all(answer for _, answer in alone)


def test_bad_budgets_are_400s_naming_the_field(oai, claude, model, tmp_path):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=THINK_PROMPT, max_tokens=1,
                                    extra_body={"max_thinking_tokens": -1})
    assert e.value.body["param"] == "max_thinking_tokens"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model, messages=THINK_PROMPT, max_tokens=1,
                               thinking={"type": "enabled", "budget_tokens": "many"})
    assert "thinking.budget_tokens" in e.value.body["error"]["message"]
    plain = Parser(hetero.load(str(write_tiny_model(tmp_path / "chatml"))), {"m"})  # ChatML: no think block
    with pytest.raises(RequestError, match="no think block") as e:
        thinking_budget(plain, 64, "max_thinking_tokens")
    assert e.value.status == 400
    body = {"model": "m", "max_tokens": 4, "messages": THINK_PROMPT,
            "thinking": {"type": "enabled", "budget_tokens": 64}}
    assert parse_messages(plain, body).options.thinking_budget is None  # required with `enabled`: sent for any model
