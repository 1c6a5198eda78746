"""Reasoning split out on the OpenAI APIs (issue 40 item 2), against a real server on the scripted thinking model
behind a Qwen3-style template with --reasoning-parser qwen3 (tests/_http_server.reasoning_server): its script's
<think> and </think> are cut across several tokens, so a stream that showed part of a tag would be caught."""
from __future__ import annotations

import httpx
import openai
import pytest

from _http_battery import Guard
from _http_server import THINK_ANSWER, THINK_PIECES, THINK_REASONING, reasoning_server
from radixserve.bench.demo_kit.tokenizer import tokenizer_json
from radixserve.frontend.reasoning import EFFORT_BUDGETS

MODEL = "thinker"
ASK = [{"role": "user", "content": "What is the answer?"}]


def _reasoning_token_count() -> int:
    """The script's tokens up to and including the last one of </think>."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json(2048))
    upto = THINK_PIECES[:THINK_PIECES.index(">") + 1]
    return sum(len(tok.encode(p, add_special_tokens=False).ids) for p in upto)


REASONING_TOKENS = _reasoning_token_count()
TAG_PIECES = ("<", "</", "think", "t", "h", "i", "n", "k", ">")


@pytest.fixture(scope="module")
def server():
    return reasoning_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_splits_reasoning(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0)
    message = out.choices[0].message.model_dump()
    assert message["content"] == THINK_ANSWER
    assert message["reasoning_content"] == message["reasoning"] == THINK_REASONING
    assert out.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS < out.usage.completion_tokens


def test_chat_stream_splits_reasoning_without_partial_tags(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    reasoning = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    content = [d["content"] for d in deltas if d.get("content")]
    assert "".join(reasoning) == THINK_REASONING and "".join(content) == THINK_ANSWER
    assert [d["reasoning"] for d in deltas if d.get("reasoning_content")] == reasoning
    assert len(reasoning) > 3  # streamed token by token, not held to the end
    for piece in reasoning + content:  # no delta is (or ends with) a piece of a tag
        assert not piece.strip() in TAG_PIECES and "<think" not in piece and "</" not in piece
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


@pytest.mark.parametrize("extra", [{"chat_template_kwargs": {"enable_thinking": False}},
                                   {"reasoning_effort": "none"}, {"reasoning_effort": "minimal"}])
def test_thinking_off(client, extra):
    on = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0)
    off = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, extra_body=extra)
    # The template closed an empty block in the prompt; the scripted model then answers at once.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert off.choices[0].message.content == THINK_ANSWER
    assert off.choices[0].message.model_dump()["reasoning_content"] is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_effort_on_keeps_thinking_with_its_budget(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, reasoning_effort="low")
    assert EFFORT_BUDGETS["low"] > REASONING_TOKENS
    assert out.choices[0].message.model_dump()["reasoning_content"] == THINK_REASONING


def test_reasoning_sent_back_is_rendered(client):
    base = [*ASK, {"role": "assistant", "content": THINK_ANSWER}, {"role": "user", "content": "And again?"}]
    plain = client.chat.completions.create(model=MODEL, messages=base, temperature=0, max_tokens=1)
    for key in ("reasoning_content", "reasoning"):
        turns = [dict(m) for m in base]
        turns[1][key] = THINK_REASONING
        out = client.chat.completions.create(model=MODEL, messages=turns, temperature=0, max_tokens=1)
        assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 5, key


@pytest.mark.parametrize("body, param", [
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs"),
    ({"messages": [*ASK, {"role": "assistant", "content": "x", "reasoning_content": 5}]}, "messages[1].reasoning_content"),
])
def test_bad_reasoning_options_are_400s(server, body, param):
    guard = Guard(server)
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    guard.check()
