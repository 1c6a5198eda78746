"""The bad-input battery, continued: a server started with --api-key (every route but the health checks
needs the key, checked before the body is read), and a small server under overload (2 running + 2
queued at most: the rest get 429, every admitted request finishes). Guards as in test_http_battery.py."""
from __future__ import annotations

import json
import threading
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest
from _http_battery import Guard, assert_answer, raw_exchange, request_bytes
from _http_battery_cases import CHAT, CMPL, GEN, chat, cmpl, gen
from _http_server import shared_server, tiny_model_path

MESSAGES = "/v1/messages"


def messages() -> dict[str, Any]:
    return {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


API_KEY = "sk-battery-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def keyed():
    return shared_server("battery-keyed", ["--model", tiny_model_path(), "--context-length", "512",
                                           "--kv-cache-tokens", "4096", "--max-body-bytes", "65536",
                                           "--api-key", API_KEY])


@pytest.fixture(scope="module")
def small():
    """Admits 2 running + 2 queued engine requests; the rest get 429."""
    return shared_server("battery-small", ["--model", tiny_model_path(), "--context-length", "1024",
                                           "--kv-cache-tokens", "8192", "--max-running-requests", "2",
                                           "--max-queued-requests", "2"])


# -- auth (a server started with --api-key) ----------------------------------------------------


AUTH_CASES = [
    pytest.param("GET", "/v1/models", {}, None, 401, id="models-no-header"),
    pytest.param("POST", CHAT, {}, chat(), 401, id="chat-no-header"),
    pytest.param("POST", GEN, {"Authorization": "Bearer wrong"}, gen(), 401, id="generate-wrong-key"),
    pytest.param("GET", "/get_server_info", {"Authorization": f"Basic {API_KEY}"}, None, 401, id="basic-scheme"),
    pytest.param("GET", "/v1/models", {"Authorization": "Bearer"}, None, 401, id="bearer-without-token"),
    pytest.param("GET", "/v1/models", {"Authorization": f"Bearer{API_KEY}"}, None, 401, id="bearer-no-space"),
    pytest.param("GET", "/v1/models", {"Authorization": f"Bearer {API_KEY}x"}, None, 401, id="key-plus-suffix"),
    pytest.param("GET", "/v1/models", {"Authorization": f"Bearer {API_KEY[:-1]}"}, None, 401, id="key-prefix"),
    pytest.param("GET", "/v1/models", {"Authorization": API_KEY}, None, 401, id="key-without-scheme"),
    pytest.param("GET", "/v1/models", {"X-Api-Key": API_KEY}, None, 200, id="x-api-key-header"),
    pytest.param("GET", "/v1/models", {"X-Api-Key": "wrong"}, None, 401, id="x-api-key-wrong"),
    pytest.param("POST", MESSAGES, {}, messages(), 401, id="messages-no-header"),
    pytest.param("POST", MESSAGES, {"x-api-key": "wrong"}, messages(), 401, id="messages-wrong-x-api-key"),
    pytest.param("POST", MESSAGES + "/batches", {}, messages(), 404, id="messages-unknown-path-404"),
    pytest.param("POST", MESSAGES, {"x-api-key": API_KEY}, messages(), 200, id="messages-x-api-key"),
    pytest.param("POST", MESSAGES, {"Authorization": "Bearer wrong", "x-api-key": API_KEY}, messages(), 200,
                 id="messages-either-header"),
    pytest.param("POST", CMPL, {}, b"{not json", 401, id="auth-before-body-parse"),
    pytest.param("POST", CMPL, {}, cmpl(prompt="x" * 70_000), 401, id="auth-before-body-size"),
    pytest.param("GET", "/metrics", {}, None, 401, id="metrics-needs-key"),
    pytest.param("POST", "/flush_cache", {}, None, 401, id="flush-needs-key"),
    pytest.param("POST", "/tokenize", {}, {"prompt": "x"}, 401, id="tokenize-needs-key"),
    pytest.param("POST", "/abort_request", {}, {"abort_all": True}, 401, id="abort-needs-key"),
    pytest.param("GET", "/v1/models", {"Authorization": f"bearer {API_KEY}"}, None, 200, id="scheme-lowercase"),
    pytest.param("GET", "/v1/models", {"Authorization": f"Bearer   {API_KEY}"}, None, 200, id="extra-spaces"),
    pytest.param("POST", CHAT, AUTH, chat(), 200, id="chat-right-key"),
    pytest.param("GET", "/health", {}, None, 200, id="health-open"),
    pytest.param("GET", "/health_generate", {}, None, 200, id="health-generate-open"),
    pytest.param("GET", "/health", {"Authorization": "Bearer wrong"}, None, 200, id="health-ignores-bad-key"),
]


@pytest.mark.parametrize("method, path, headers, body, status", AUTH_CASES)
def test_api_key(keyed, method, path, headers, body, status):
    guard = Guard(keyed, AUTH)
    kwargs: dict[str, Any] = {"headers": headers}
    if isinstance(body, bytes):
        kwargs["content"] = body
    elif body is not None:
        kwargs["json"] = body
    with keyed.client() as http:
        response = http.request(method, path, **kwargs)
    error = assert_answer(response, status)
    if status == 401:
        assert error["type"] == "authentication_error" and error.get("code", "invalid_api_key") == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    guard.check()


def test_api_key_with_non_ascii_header_bytes(keyed):
    guard = Guard(keyed, AUTH)
    data = request_bytes("GET", "/v1/models", headers={"Authorization": "Bearer sk-\xe9\xff"})
    assert_answer(raw_exchange(keyed.url, data), 401)
    guard.check()


def test_api_key_openai_sdk(keyed):
    guard = Guard(keyed, AUTH)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    out = client.completions.create(model=tiny_model_path(), prompt="keyed", max_tokens=2)
    assert out.usage.completion_tokens <= 2
    guard.check()


def test_api_key_anthropic_sdk(keyed):
    """The anthropic SDK sends its key as x-api-key; a wrong one is its AuthenticationError."""
    guard = Guard(keyed, AUTH)
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(
            model=tiny_model_path(), **messages())
    assert info.value.body["error"]["type"] == "authentication_error"
    client = anthropic.Anthropic(base_url=keyed.url, api_key=API_KEY, max_retries=0, timeout=60)
    assert client.messages.create(model=tiny_model_path(), **messages()).usage.output_tokens <= 2
    guard.check()


# -- overload (2 running + 2 queued at most) --------------------------------------------------


LONG = {"prompt": "keep the server busy", "max_tokens": 900, "ignore_eos": True, "stream": True}


def test_overload_is_429_and_every_admitted_request_finishes(small):
    guard = Guard(small)
    results: dict[int, tuple[int, list[str]]] = {}

    def stream(i: int) -> None:
        with small.client() as http, http.stream("POST", CMPL, json=LONG) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            results[i] = (response.status_code, lines)

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 60
    while small.server_info()["num_in_flight"] < 4:  # two running, two queued
        assert time.monotonic() < deadline and all(w.is_alive() for w in workers), results
        time.sleep(0.01)
    refusals = _refusals_while_full(small)
    for w in workers:
        w.join(120)
    # All four admitted streams ran to the end; only then are the refusals checked in full.
    assert len(results) == 4
    for status, lines in results.values():
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        finishes = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines[:-1]]
        assert [f for f in finishes if f] == ["length"]
    for name, (response, expect) in refusals.items():
        error = assert_answer(response, expect)
        if response.status_code == 429:
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error", (name, error)
            assert response.headers["retry-after"].isdigit(), (name, response.headers)
    assert refusals["health-while-full"][0].status_code == 200
    stats = guard.check()
    assert stats["num_requests_aborted"] == guard.stats_before["num_requests_aborted"]


def _refusals_while_full(small) -> dict[str, tuple[Any, Any]]:
    """Every kind of request the full server must refuse (or, for health and info, still answer)."""
    out: dict[str, tuple[Any, Any]] = {}
    with small.client() as http:
        out["chat"] = (http.post(CHAT, json=chat()), 429)
        out["completions"] = (http.post(CMPL, json=cmpl()), 429)
        out["completions-stream"] = (http.post(CMPL, json=cmpl(stream=True)), 429)
        out["generate"] = (http.post(GEN, json=gen()), 429)
        out["generate-batch"] = (http.post(GEN, json=gen(text=["a", "b"])), 429)
        out["n-over-capacity"] = (http.post(CMPL, json=cmpl(n=5)), 400)  # could never fit: not a 429
        out["flush-while-busy"] = (http.post("/flush_cache"), 400)
        out["health-while-full"] = (http.get("/health"), 200)
        out["server-info-while-full"] = (http.get("/get_server_info"), 200)
        out["bad-input-while-full"] = (http.post(CHAT, json=chat(temperature=-1)), (400, 429))
    try:
        client = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        client.completions.create(model=tiny_model_path(), prompt="sdk", max_tokens=2)
        out["sdk"] = (httpx.Response(200), 429)
    except openai.RateLimitError as exc:
        out["sdk"] = (exc.response, 429)
    return out


@pytest.mark.parametrize("path, body, param", [
    pytest.param(CMPL, cmpl(n=5), "n", id="completions-n-over-capacity"),
    pytest.param(CHAT, chat(n=5), "n", id="chat-n-over-capacity"),
    pytest.param(GEN, gen(text=["a"] * 5), None, id="generate-batch-over-capacity"),
])
def test_more_than_capacity_in_one_request_is_400_not_429(small, path, body, param):
    guard = Guard(small)
    with small.client() as http:
        error = assert_answer(http.post(path, json=body), 400)
    assert "at most 4" in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    guard.check()
