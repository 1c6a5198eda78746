"""Real agent-framework clients against a real server on the base install (issue 34).

The server runs from a venv that holds radixserve with its base dependencies only (no extras: what the README's
`pip install -e .` gives); each client runs from its own client-only venv (tests/_client_venvs.py) as a script
of tests/client_matrix/ that prints what the client returned. The model is a scripted checkpoint
(bench/checkpoints/scripted.py): "weather" in a prompt makes it call get_weather(city="Paris"), a tool result
in the prompt makes it answer ANSWER, "poem" makes it write the JSON of RAIN and "story" call the tool `Story`
with it. Every client asks for greedy decoding: at temperature 1 the scripted model's finite logit margins leave
each token a ~0.2% chance of being another one. One more test runs pydantic-ai on the built-in demo model, as the
README's `radixserve serve` starts it: there the answer's words come from the tool's result.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from _client_venvs import EXTRAS_ONLY_MODULES, ISOLATED_ENV, base_python, client_python, importable, run_script
from _http_server import START_TIMEOUT_S
from radixserve.bench.checkpoints import TOOL_RESULT_TRIGGER, cached_scripted_checkpoint
from radixserve.frontend.spawn import ServerProcess

SCRIPTS = Path(__file__).parent / "client_matrix"
MODEL = "scripted"
CHAINS = {
    "weather": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    TOOL_RESULT_TRIGGER: "It is sunny in Paris today.",
    "poem": '{"title": "Rain", "lines": 4}',
    "story": '<tool_call>{"name": "Story", "arguments": {"title": "Rain", "lines": 4}}</tool_call>',
}
WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ANSWER = CHAINS[TOOL_RESULT_TRIGGER]
RAIN = {"title": "Rain", "lines": 4}
TOOL_RESULT = '{"temperature": 17, "condition": "windy"}'  # what the scripts' get_weather returns
ACCESS = re.compile(r'radixserve\.access: \S+ "(\w+) (\S+)" (\d{3})')


@pytest.fixture(scope="module")
def base() -> str:
    return base_python()


@pytest.fixture(scope="module")
def server(base: str):
    checkpoint = cached_scripted_checkpoint(CHAINS, priority=(TOOL_RESULT_TRIGGER,))
    yield from _serve(base, "--model", checkpoint, "--kv-cache-tokens", "32768", "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def demo_server(base: str):
    yield from _serve(base)  # no --model: the built-in demo model, as the README's `radixserve serve`


def _serve(python: str, *args: str):
    proc = ServerProcess([*args, "--num-threads", "1"], start_timeout_s=START_TIMEOUT_S,
                         env={**ISOLATED_ENV, "OMP_NUM_THREADS": "1"}, python=python)
    yield proc
    proc.stop(timeout=20)


def run_client(server: ServerProcess, client: str, script: str, *args: str, requests: int, model: str = MODEL
               ) -> tuple[dict, list[tuple[str, int]]]:
    """The script's report, and (path, status) of the OpenAI API requests the server logged meanwhile: once
    `requests` of them are logged (a line is written as its response ends), or after a few seconds."""
    seen = len(server.lines)
    report = run_script(client_python(client), SCRIPTS / script, server.url, model, *args)
    deadline = time.monotonic() + 10
    while True:
        logged = [(m.group(2), int(m.group(3))) for m in map(ACCESS.search, server.lines[seen:])
                  if m and m.group(2).startswith("/v1/")]
        if len(logged) >= requests or time.monotonic() > deadline:
            return report, logged
        time.sleep(0.05)


def test_base_venv_holds_the_base_dependencies_only(base: str):
    # Every installed distribution is a (transitive) base requirement of radixserve, and none is missing;
    # structured output (xgrammar) is one of them.
    assert run_script(base, SCRIPTS / "base_closure.py") == {"unreached": [], "missing": []}
    assert importable(base, ("radixserve.frontend.cli", "xgrammar")) == ["radixserve.frontend.cli", "xgrammar"]
    assert importable(base, EXTRAS_ONLY_MODULES) == []


def test_openai_sdk_strict_named_and_json_schema(server):
    report, requests = run_client(server, "openai", "openai_sdk.py", requests=7)
    assert requests == [("/v1/chat/completions", 200)] * 7
    call = {"finish_reason": "tool_calls", "content": None, "tool_calls": [WEATHER_CALL]}
    assert report["strict_auto"] == call
    # Without tools the model says nothing to this prompt; the named tool_choice's grammar writes the call,
    # with an argument of the tool's enum.
    assert report["no_tools"]["content"] == "" and report["no_tools"]["tool_calls"] == []
    forced = report["named_forced"]
    assert forced["finish_reason"] == "tool_calls" and [c["name"] for c in forced["tool_calls"]] == ["get_weather"]
    assert forced["tool_calls"][0]["arguments"]["city"] in ("Paris", "Rome", "Oslo")
    assert report["named_round_trip"] == [call, {"finish_reason": "stop", "content": ANSWER, "tool_calls": []}]
    assert report["json_schema"] == {"parsed": RAIN, "finish_reason": "stop"}
    bounded = report["json_schema_forced"]["parsed"]  # validated by the SDK against BoundedPoem
    assert bounded["title"] in ("Rain", "Snow") and 1 <= bounded["lines"] <= 9, report["json_schema_forced"]


@pytest.mark.parametrize("kind, path", [("chat", "/v1/chat/completions"), ("responses", "/v1/responses")])
def test_pydantic_ai_agent_calls_the_tool(server, kind: str, path: str):
    report, requests = run_client(server, "pydantic_ai", "pydantic_ai_agent.py", kind, requests=2)
    assert requests == [(path, 200), (path, 200)]
    assert report["calls"] == ["Paris"]  # the tool ran once, with the parsed argument
    assert report["output"] == ANSWER
    assert report["parts"] == [[["user-prompt", None]], [["tool-call", None]], [["tool-return", None]],
                               [["text", ANSWER]]]
    first, second = report["requests"]
    # pydantic-ai sends its tool as strict; the second request carries the tool's own return value.
    assert first["tool_names"] == second["tool_names"] == ["get_weather"] and first["strict"] == [True]
    assert first["tool_results"] == [] and second["tool_results"] == [TOOL_RESULT]


def test_pydantic_ai_agent_on_the_demo_model(demo_server):
    # The demo model decides to call the tool on its own and answers from the tool's result.
    report, requests = run_client(demo_server, "pydantic_ai", "pydantic_ai_agent.py", "chat", requests=2,
                                  model="radixserve-demo")
    assert requests == [("/v1/chat/completions", 200)] * 2
    assert report["calls"] == ["Paris"] and report["requests"][1]["tool_results"] == [TOOL_RESULT]
    assert "windy" in report["output"] and "17" in report["output"], report["output"]


def test_instructor_tools_and_json_schema(server):
    report, requests = run_client(server, "instructor", "instructor_modes.py", requests=2)
    assert requests == [("/v1/chat/completions", 200)] * 2  # one each: no retry after a failed validation
    tools, schema = report["TOOLS"], report["JSON_SCHEMA"]
    assert (tools["type"], tools["object"]) == ("Story", RAIN)
    assert tools["requests"][0]["tool_choice"] == {"type": "function", "function": {"name": "Story"}}
    assert (schema["type"], schema["object"]) == ("Poem", RAIN)
    assert schema["requests"][0]["response_format"]["type"] == "json_schema"


def test_litellm_streams_the_tool_call(server):
    report, requests = run_client(server, "litellm", "litellm_stream.py", requests=2)
    assert requests == [("/v1/chat/completions", 200)] * 2
    assert report["calls"] == [WEATHER_CALL] and report["tool_call_deltas"] >= 1
    assert report["finish_reasons"] == ["tool_calls"]
    assert report["answer"] == ANSWER and report["answer_chunks"] > 2 and report["answer_finish"] == ["stop"]
