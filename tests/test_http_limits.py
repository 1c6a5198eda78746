"""Context limits over HTTP: a refusal names the parameter of the API it came through (max_tokens,
max_completion_tokens, max_output_tokens; the prompt's field when the prompt alone leaves no room), never the engine's
max_new_tokens; and a KV pool smaller than the model's context caps the context, said once at start-up."""
from __future__ import annotations

import httpx
import pytest

from _http_server import ServerProcess, main_server, tiny_model_path

CHAT, CMPL, RESP, GEN = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate"
LONG_TEXT = "hello " * 600  # over the main server's context of 512 tokens
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    return main_server()


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"messages": HI, "max_tokens": 600}, "max_tokens"),
    (CHAT, {"messages": HI, "max_completion_tokens": 600}, "max_completion_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 600}, "max_tokens"),
    (RESP, {"input": "hi", "max_output_tokens": 600}, "max_output_tokens"),
    (GEN, {"text": "hi", "sampling_params": {"max_new_tokens": 600}}, "sampling_params.max_new_tokens"),
], ids=["chat", "chat-max-completion-tokens", "completions", "responses", "generate"])
def test_too_many_tokens_names_the_apis_parameter(server, path, body, param):
    error = _refusal(server, path, body)
    assert error["param"] == param and error["code"] == "context_length_exceeded", error
    assert f"{param} is 600" in error["message"] and "exceeds the context length 512" in error["message"], error
    if path != GEN:
        assert "max_new_tokens" not in error["message"], error


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 8}, "messages"),
    (CMPL, {"prompt": LONG_TEXT, "max_tokens": 8}, "prompt"),
    (RESP, {"input": LONG_TEXT}, "input"),
    (RESP, {"input": LONG_TEXT, "max_output_tokens": 8}, "input"),
    (GEN, {"text": LONG_TEXT, "sampling_params": {"max_new_tokens": 8}}, "text"),
], ids=["chat", "chat-with-max-tokens", "completions", "responses", "responses-with-max-output-tokens", "generate"])
def test_a_prompt_past_the_context_names_the_prompt(server, path, body, param):
    error = _refusal(server, path, body)
    assert error["param"] == param and error["code"] == "context_length_exceeded", error
    assert "leaves no room to generate in the context length 512" in error["message"], error
    assert "max_new_tokens" not in error["message"] and "messages" not in error["message"], error


def test_min_tokens_over_the_default_names_the_responses_parameter(server):
    error = _refusal(server, RESP, {"input": "hi " * 200, "min_tokens": 400})
    assert error["param"] == "min_tokens" and "must be <= max_output_tokens" in error["message"], error


def test_a_pool_smaller_than_the_models_context_caps_it():
    """The tiny model allows 1024 positions; a 256-slot pool without --context-length serves requests of up to 256
    tokens, says so once at start-up, and refuses a longer one naming the cap (not every request, as before)."""
    server = ServerProcess(["--model", tiny_model_path(), "--kv-cache-tokens", "256", "--max-tokens-default", "8"])
    try:
        capped = [line for line in server.lines if "context length capped" in line]
        assert len(capped) == 1 and "capped to 256 tokens" in capped[0] and "model's is 1024" in capped[0], capped
        assert "--kv-cache-tokens" in capped[0]
        with server.client() as c:
            assert c.get("/health_generate").status_code == 200
            models = c.get("/v1/models").json()["data"]
            assert models[0]["max_model_len"] == 256
            ok = c.post(CHAT, json={"messages": HI})
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
            long = c.post(CMPL, json={"prompt": [7] * 200, "max_tokens": 100})
        error = long.json()["error"]
        assert long.status_code == 400 and error["param"] == "max_tokens", error
        assert "300 exceeds the context length 256" in error["message"], error
    finally:
        server.stop(timeout=20)


def _refusal(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]
