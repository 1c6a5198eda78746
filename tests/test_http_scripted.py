"""The real server on a scripted checkpoint (ARCHITECTURE §13): tool calls, stop strings, EOS, split multi-byte
characters, and 64 concurrent streaming clients of whom a quarter disconnect (must-show 3 and 4)."""
import asyncio
import json

import httpx
import openai
import pytest

from _http_server import EMOJI_SCRIPT, SCRIPTS, scripted_server
from radixserve.bench.soak_checks import held_by_requests

MODEL = "scripted"
TOOLS = [{"type": "function", "function": {
    "name": "get_forecast", "description": "Forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server():
    return scripted_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_tool_call_is_parsed(client):
    out = client.chat.completions.create(model=MODEL, messages=_ask("What is the weather in Paris?"), tools=TOOLS,
                                         temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_forecast" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(model=MODEL, messages=_ask("What is the weather in Paris?"),
                                                 tools=TOOLS, temperature=0, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
        [(0, "get_forecast", {"city": "Paris"})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    # Without tools the same text is plain content.
    plain = client.chat.completions.create(model=MODEL, messages=_ask("What is the weather in Paris?"), temperature=0)
    assert plain.choices[0].message.content == SCRIPTS["weather"] and plain.choices[0].finish_reason == "stop"


def test_stop_string_is_trimmed_and_eos_ends_generation(client, server):
    script = SCRIPTS["poem"]
    full = client.completions.create(model=MODEL, prompt="Write a poem", max_tokens=64, temperature=0)
    assert full.choices[0].text == script and full.choices[0].finish_reason == "stop"  # EOS, not the length limit
    cut = client.completions.create(model=MODEL, prompt="Write a poem", max_tokens=64, temperature=0, stop=["STOP"])
    assert cut.choices[0].text == script[:script.index("STOP")] and cut.choices[0].finish_reason == "stop"
    pieces = list(client.completions.create(model=MODEL, prompt="Write a poem", max_tokens=64, temperature=0,
                                            stop=["STOP"], stream=True))
    assert all("S" not in p.choices[0].text for p in pieces)  # a partial stop string never leaks
    assert "".join(p.choices[0].text for p in pieces) == cut.choices[0].text
    with server.client() as http:
        native = http.post("/generate", json={"text": "Write a poem", "sampling_params": {
            "max_new_tokens": 64, "temperature": 0, "stop": "STOP"}}).json()
        eos = http.post("/generate", json={"text": "Write a poem", "sampling_params": {
            "max_new_tokens": 64, "temperature": 0}}).json()
    assert native["meta_info"]["finish_reason"] == {"type": "stop", "matched": "STOP"}
    assert eos["meta_info"]["finish_reason"]["type"] == "stop"
    assert eos["meta_info"]["finish_reason"]["matched"] == eos["output_ids"][-1]  # the EOS token id


def test_split_multibyte_characters_arrive_intact(client, server):
    chunks = list(client.chat.completions.create(model=MODEL, messages=_ask("Show an emoji"), temperature=0,
                                                 stream=True))
    texts = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(texts) == EMOJI_SCRIPT
    assert not any("\ufffd" in t for t in texts)
    with server.client() as http, http.stream("POST", "/generate", json={
            "text": "Show an emoji", "stream": True, "sampling_params": {"max_new_tokens": 64}}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["text"] == EMOJI_SCRIPT and not any("\ufffd" in e["text"] for e in events)


def test_64_streaming_clients_with_early_disconnects(server):
    before = server.wait_idle()["stats"]
    systems = [f"You are helper {k}. Be brief, kind and precise in every reply you give. " * 4 for k in range(4)]
    topics = {"story": "Tell me a story", "poem": "Write a poem", "emoji": "Show an emoji"}
    expected = {"story": SCRIPTS["story"], "poem": SCRIPTS["poem"], "emoji": EMOJI_SCRIPT}
    names = list(topics)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, str | None]:
        name = names[i % len(names)]
        messages = [{"role": "system", "content": systems[i % 4]}, {"role": "user", "content": topics[name]}]
        leaves = i % 4 == 3
        extra = {"ignore_eos": True} if leaves else {}  # a leaver is still generating when it goes
        stream = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True,
                                                      max_tokens=200, extra_body=extra)
        text, finish, seen = "", None, 0
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            seen += 1
            if leaves and seen == 3:
                await stream.close()
                return name, None, None
        return name, text, finish

    async def run() -> list:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300,
                                      http_client=httpx.AsyncClient(limits=limits, timeout=300)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    completed = [(name, text, finish) for name, text, finish in results if text is not None]
    assert len(completed) == 48
    for name, text, finish in completed:
        assert text == expected[name] and finish == "stop"
    info = server.wait_idle()
    stats = info["stats"]
    assert stats["free_slots"] + stats["evictable_slots"] + stats["pinned_slots"] == stats["total_slots"]
    assert held_by_requests(stats) == 0 and info["num_in_flight"] == 0
    assert stats["num_requests_aborted"] - before["num_requests_aborted"] == 16
    assert stats["num_cached_tokens"] > before["num_cached_tokens"]  # the shared system prompts were reused


def test_min_tokens_holds_eos_back(client):
    plain = client.completions.create(model=MODEL, prompt="Write a poem", max_tokens=64, temperature=0)
    longer = client.completions.create(model=MODEL, prompt="Write a poem", max_tokens=64, temperature=0,
                                       extra_body={"min_tokens": plain.usage.completion_tokens + 5})
    assert plain.choices[0].finish_reason == "stop"
    assert longer.usage.completion_tokens >= plain.usage.completion_tokens + 5
    assert longer.choices[0].text.startswith(plain.choices[0].text)
