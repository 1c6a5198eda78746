"""Reasoning split out on the OpenAI APIs (issue 40 item 2), against a real server on the scripted thinking model
behind a Qwen3-style template with --reasoning-parser qwen3 (tests/_http_server.reasoning_server): its script's
<think> and </think> are cut across several tokens, so a stream that showed part of a tag would be caught."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from _http_battery import Guard
from _http_server import THINK_ANSWER, THINK_PIECES, THINK_REASONING, THINK_TOOL_REASONING, reasoning_server
from radixserve.bench.demo_kit.tokenizer import tokenizer_json
from radixserve.frontend.reasoning import EFFORT_BUDGETS

MODEL = "thinker"
ASK = [{"role": "user", "content": "Please count to four."}]


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


def test_thinking_token_budget_cuts_the_reasoning(server, client):
    guard = Guard(server)
    out = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                         extra_body={"thinking_token_budget": 9})
    message = out.choices[0].message.model_dump()
    assert message["content"] == THINK_ANSWER and out.choices[0].finish_reason == "stop"
    assert THINK_REASONING.startswith(message["reasoning_content"])
    assert len(message["reasoning_content"]) < len(THINK_REASONING)
    # The model's 9 tokens and the forced "\n</think>" (its last token closes the reasoning).
    assert 9 < out.usage.completion_tokens_details.reasoning_tokens < REASONING_TOKENS
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, stream=True,
                                                 extra_body={"thinking_token_budget": 9}))
    streamed = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in streamed) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in streamed) == THINK_ANSWER
    guard.check()  # idle afterwards: the forced tokens' KV came back like any other


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
    ({"thinking_token_budget": 0}, "thinking_token_budget"),
    ({"thinking_token_budget": "9"}, "thinking_token_budget"),
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


# -- the Responses API ---------------------------------------------------------------------------


def test_responses_reasoning_item(client):
    r = client.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    item = r.output[0]
    assert item.content[0].type == "reasoning_text" and item.content[0].text == THINK_REASONING
    assert item.summary == [] and item.status == "completed" and item.id.startswith("rs_")
    assert r.output_text == THINK_ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS < r.usage.output_tokens
    summarized = client.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0,
                                         reasoning={"effort": "high", "summary": "auto"})
    assert [s.text for s in summarized.output[0].summary] == [THINK_REASONING]
    assert summarized.reasoning.effort == "high" and summarized.reasoning.summary == "auto"


def test_responses_stream_reasoning_events(client):
    events = list(client.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == THINK_REASONING and len(deltas) > 3
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == THINK_ANSWER
    for piece in deltas:
        assert piece.strip() not in TAG_PIECES and "<think" not in piece and "</" not in piece
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == THINK_REASONING and done.output_index == 0
    # The reasoning item closes before the message opens; sequence numbers increase.
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [e.sequence_number for e in events] == sorted({e.sequence_number for e in events})
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS
    with client.responses.stream(model=MODEL, input=ASK[0]["content"], temperature=0) as stream:
        got = stream.get_final_response()  # the SDK's own accumulation accepts the sequence
    assert got.output[0].content[0].text == THINK_REASONING and got.output_text == THINK_ANSWER


def test_responses_thinking_token_budget(client):
    r = client.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0,
                                extra_body={"thinking_token_budget": 9})
    text = r.output[0].content[0].text
    assert THINK_REASONING.startswith(text) and len(text) < len(THINK_REASONING) and r.output_text == THINK_ANSWER


def test_responses_effort_none_turns_thinking_off(client):
    r = client.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0, reasoning={"effort": "none"})
    assert [o.type for o in r.output] == ["message"] and r.output_text == THINK_ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_responses_reasoning_items_round_trip(client):
    """The SDK's manual-context pattern: the previous output (reasoning item included) sent back as input."""
    first = client.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0, store=False)
    again = {"role": "user", "content": "And again?"}
    with_items = client.responses.create(model=MODEL, input=[ASK[0], *first.output, again], temperature=0,
                                         max_output_tokens=1)
    without = client.responses.create(model=MODEL, input=[ASK[0], first.output[1], again], temperature=0,
                                      max_output_tokens=1)
    assert with_items.usage.input_tokens > without.usage.input_tokens + 5  # the reasoning was rendered
    summary_only = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": THINK_REASONING}],
                    "encrypted_content": None}
    by_summary = client.responses.create(model=MODEL, input=[ASK[0], summary_only, first.output[1], again],
                                         temperature=0, max_output_tokens=1)
    assert by_summary.usage.input_tokens == with_items.usage.input_tokens
    chained = client.responses.create(model=MODEL, input="And again?", temperature=0, max_output_tokens=1,
                                      previous_response_id=client.responses.create(
                                          model=MODEL, input=ASK[0]["content"], temperature=0).id)
    # The stored turn kept its reasoning (its exact output ids: the model cut </think> finer than the template does).
    assert chained.usage.input_tokens >= with_items.usage.input_tokens


@pytest.mark.parametrize("body, param", [
    ({"reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"reasoning": {"summary": 1}}, "reasoning.summary"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text"}]}]}, "input[0].summary"),
    ({"input": [{"type": "reasoning", "summary": [], "content": "x"}]}, "input[0].content"),
])
def test_bad_responses_reasoning_is_400(server, body, param):
    guard = Guard(server)
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "x", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    guard.check()


TOOLS = [{"type": "function", "function": {
    "name": "get_forecast", "description": "Forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
GREET = [{"role": "user", "content": "A greeting, then the forecast for Rome please."}]


def test_tool_calls_are_parsed_in_the_answer_only(client):
    """The reasoning drafts a <tool_call> (kept as reasoning text); the answer's call is the one returned."""
    out = client.chat.completions.create(model=MODEL, messages=GREET, tools=TOOLS, temperature=0)
    choice = out.choices[0]
    assert choice.message.model_dump()["reasoning_content"] == THINK_TOOL_REASONING
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_forecast", {"city": "Rome"})]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=GREET, tools=TOOLS, temperature=0,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_dump().get("reasoning_content") or "" for d in deltas) == THINK_TOOL_REASONING
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("get_forecast", {"city": "Rome"})]
    r = client.responses.create(model=MODEL, input=GREET[0]["content"], temperature=0,
                                tools=[{"type": "function", **TOOLS[0]["function"]}])
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == THINK_TOOL_REASONING and r.output[1].name == "get_forecast"


def test_agents_sdk_sends_reasoning_items_back(server):
    """The Agents SDK's Responses model resends the reasoning item with the function call and its output."""
    agents = pytest.importorskip("agents")
    import asyncio

    from _http_server import SCRIPTS, TOOL_RESULT_TRIGGER

    agents.set_tracing_disabled(True)
    sent: list[tuple[dict, int]] = []
    calls: list[str] = []

    async def record(response: httpx.Response) -> None:
        sent.append((json.loads(response.request.content), response.status_code))

    @agents.function_tool
    def get_forecast(city: str) -> str:
        """The forecast for a city (no trigger word of another script)."""
        calls.append(city)
        return json.dumps({"city": city, "sky": "clear"})

    async def main() -> str:
        http = httpx.AsyncClient(event_hooks={"response": [record]})
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, http_client=http)
        agent = agents.Agent(name="greeter", instructions="Use the tools.", tools=[get_forecast],
                             model=agents.OpenAIResponsesModel(MODEL, client),
                             model_settings=agents.ModelSettings(temperature=0))
        return (await agents.Runner.run(agent, GREET[0]["content"])).final_output

    final = asyncio.run(main())
    assert calls == ["Rome"] and final == SCRIPTS[TOOL_RESULT_TRIGGER]
    assert [status for _, status in sent] == [200, 200]
    types = [item.get("type") for item in sent[1][0]["input"]]
    assert types[-3:] == ["reasoning", "function_call", "function_call_output"], types
