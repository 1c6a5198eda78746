"""A server without xgrammar, as on a platform xgrammar publishes no wheel for (issue 34 item 1).

xgrammar is hidden from the server's interpreters, the HTTP process's and the engine's (tests/_hidden_modules.py).
The server must start, warn once which features are off, serve `strict` tools best effort, and answer what needs
a grammar with a 400 naming the field the client sent, never the engine's `structural_tag`. Real HTTP through the
openai SDK (and httpx for /generate) against the tiny random-weight checkpoint of tests/_http_server.py.
"""
from __future__ import annotations

import httpx
import openai
import pytest

from _hidden_modules import check_hidden, hiding_env
from _http_server import ServerProcess, main_server, tiny_model_path

HIDDEN = ("xgrammar",)
WARNING = "structured generation is off"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER,
                                              "strict": True}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER,
                  "strict": True}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = hiding_env(HIDDEN, tmp_path_factory.mktemp("no-xgrammar"))
    check_hidden(env, HIDDEN)
    proc = ServerProcess(["--model", tiny_model_path(), "--context-length", "512", "--kv-cache-tokens", "4096",
                          "--served-model-name", "tiny"], env=env)
    yield proc
    proc.stop(timeout=20)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _refusal(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert "structural_tag" not in str(error) and "xgrammar" in error["message"], error
    return info.value


def test_start_up_warns_once(server):
    assert server.log().count(WARNING) == 1, server.log()
    assert WARNING not in main_server().log()  # a server with xgrammar says nothing


def test_strict_tools_are_best_effort(client):
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[CHAT_TOOL], max_tokens=8)
    assert chat.choices[0].finish_reason in ("stop", "length", "tool_calls")
    streamed = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[CHAT_TOOL], max_tokens=8,
                                              stream=True)
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason]
    response = client.responses.create(model="tiny", input="Weather in Paris?", tools=[RESPONSES_TOOL],
                                       max_output_tokens=8)
    assert response.status in ("completed", "incomplete")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_choice_is_400_naming_tool_choice(client, tool_choice):
    err = _refusal(lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[CHAT_TOOL],
                                                          tool_choice=tool_choice, max_tokens=8))
    assert err.param == "tool_choice" and err.body["message"].startswith("tool_choice"), err.body
    responses_choice = tool_choice if tool_choice == "required" else {"type": "function", "name": "get_weather"}
    err = _refusal(lambda: client.responses.create(model="tiny", input="Weather in Paris?", tools=[RESPONSES_TOOL],
                                                   tool_choice=responses_choice, max_output_tokens=8))
    assert err.param == "tool_choice", err.body


@pytest.mark.parametrize("fmt", [{"type": "json_object"},
                                 {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}],
                         ids=["json_object", "json_schema"])
def test_response_format_is_400_naming_response_format(client, fmt):
    err = _refusal(lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt,
                                                          max_tokens=8))
    assert err.param == "response_format" and fmt["type"] in err.body["message"], err.body
    text_format = {"type": "json_schema", "name": "w", "schema": WEATHER} if fmt["type"] == "json_schema" else fmt
    err = _refusal(lambda: client.responses.create(model="tiny", input="Weather in Paris?", max_output_tokens=8,
                                                   text={"format": text_format}))
    assert err.param == "text.format" and err.body["message"].startswith("text.format"), err.body


@pytest.mark.parametrize("key, value", [("regex", "[0-9]+"), ("json_schema", '{"type": "object"}'),
                                        ("ebnf", 'root ::= "a"')])
def test_generate_grammar_is_400_naming_the_field(server, key, value):
    r = httpx.post(server.url + "/generate", json={"text": "x", "sampling_params": {key: value, "max_new_tokens": 4}},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"sampling_params.{key}" and "xgrammar" in error["message"], error
    r = httpx.post(server.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200, r.text  # the same request without the grammar is served
