"""Failure behaviour of the HTTP server: bad input, auth, limits, overload, disconnects, SIGTERM."""
import json
import signal
import threading
import time
import uuid

import httpx
import openai
import pytest

from _http_server import main_server, shared_server, tiny_model_path
from radixserve.bench.soak_checks import held_by_requests

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    return main_server()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def limited():
    """One running + one queued request at most, an API key, and pages of 4 tokens."""
    return shared_server("limited", ["--model", tiny_model_path(), "--context-length", "512", "--kv-cache-tokens",
                                     "4096", "--api-key", API_KEY, "--max-running-requests", "1",
                                     "--max-queued-requests", "1", "--page-size", "4"])


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": USER, "temperature": "warm"}, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {"messages": USER, "n": 100}, "n"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("/v1/completions", {"prompt": [1, 2, 512]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logprobs": "many"}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": "eos"}, "stop_token_ids"),
    ("/generate", {"input_ids": [5, 100000]}, "input_ids"),
    ("/generate", {"text": "x", "sampling_params": {"top_k": "a"}}, "sampling_params.top_k"),
])
def test_bad_input_is_400_naming_the_parameter(http, path, body, param):
    error = _error(http.post(path, json=body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_malformed_json_and_wrong_body_type(http):
    assert "JSON" in _error(http.post("/v1/chat/completions", content=b"{not json"), 400)["message"]
    assert _error(http.post("/v1/completions", json=[1, 2]), 400)["message"].startswith("body must be")


def test_prompt_plus_max_tokens_over_context_states_both(http):
    error = _error(http.post("/v1/completions", json={"prompt": [7] * 500, "max_tokens": 20}), 400)
    assert "500" in error["message"] and "20" in error["message"] and "512" in error["message"]
    assert error["param"] == "max_tokens"
    error = _error(http.post("/generate", json={"input_ids": [7] * 600}), 400)
    assert "600" in error["message"] and "512" in error["message"]


def test_unknown_model_is_404(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=USER, max_tokens=2)
    assert info.value.body["param"] == "model"


def test_body_over_limit_is_413(http):
    error = _error(http.post("/v1/completions", json={"prompt": "x" * 70000}), 413)
    assert "65536" in error["message"]


def test_api_key_required_but_health_open(limited):
    with limited.client() as http:
        assert _error(http.get("/v1/models"), 401)["type"] == "authentication_error"
        _error(http.post("/generate", json={"text": "hi"}, headers={"Authorization": "Bearer wrong"}), 401)
        assert http.get("/health").status_code == 200
        assert http.get("/health_generate").status_code == 200
        assert http.get("/v1/models", headers=AUTH).status_code == 200
    client = openai.OpenAI(base_url=limited.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_cached_tokens_with_pages(limited):
    client = openai.OpenAI(base_url=limited.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    prompt = f"A repeated prompt for paging {uuid.uuid4().hex}"
    first = client.completions.create(model=tiny_model_path(), prompt=prompt, max_tokens=2)
    second = client.completions.create(model=tiny_model_path(), prompt=prompt, max_tokens=2)
    length = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == ((length - 1) // 4) * 4


def test_queue_full_is_429_and_admitted_requests_complete(limited):
    body = {"prompt": "overload", "max_tokens": 400, "ignore_eos": True, "stream": True}
    results: dict[int, list] = {}

    def stream(i: int) -> None:
        with limited.client(headers=AUTH) as http, http.stream("POST", "/v1/completions", json=body) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            results[i] = [response.status_code, lines]

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 60
    while limited.server_info(AUTH)["num_in_flight"] < 2:  # one running, one queued
        assert time.monotonic() < deadline and all(w.is_alive() for w in workers)
        time.sleep(0.01)
    with limited.client(headers=AUTH) as http:
        refused = http.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
    for w in workers:
        w.join(120)
    assert _error(refused, 429)["code"] == "queue_full"
    assert refused.headers["retry-after"].isdigit()
    for status, lines in results.values():
        assert status == 200 and lines[-1] == "data: [DONE]"
        finishes = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines[:-1]]
        assert [f for f in finishes if f] == ["length"]
    assert len(results) == 2


def test_client_disconnect_aborts_and_frees_kv(server, http):
    before = server.wait_idle()["stats"]
    body = {"prompt": f"disconnect {uuid.uuid4().hex}", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with server.client() as other, other.stream("POST", "/v1/completions", json=body) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    stats = server.wait_idle()["stats"]
    assert stats["num_requests_aborted"] == before["num_requests_aborted"] + 1
    assert stats["free_slots"] + stats["evictable_slots"] + stats["pinned_slots"] == stats["total_slots"]
    assert held_by_requests(stats) == 0
    # A non-streaming client that gives up is aborted as well.
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=dict(body, stream=False, max_tokens=440), timeout=0.3)
    stats = server.wait_idle()["stats"]
    assert stats["num_requests_aborted"] == before["num_requests_aborted"] + 2
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]


def test_sigterm_drains_running_streams_then_exits_zero(limited):
    """Runs last in this module: it stops the shared `limited` server (a later user would restart it)."""
    body = {"prompt": "drain me", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    lines: list[str] = []
    with limited.client(headers=AUTH) as http, http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            if len(lines) == 2:
                limited.proc.send_signal(signal.SIGTERM)
                with limited.client(headers=AUTH) as late:
                    deadline = time.monotonic() + 10
                    while late.get("/health").status_code != 503:  # the signal is handled asynchronously
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                    _error(late.post("/v1/completions", json={"prompt": "late", "max_tokens": 2}), 503)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 400  # the stream ran to the end after SIGTERM
    assert limited.proc.wait(60) == 0, limited.log()
