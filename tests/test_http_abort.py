"""An abort asked for with /abort_request is a normal end on every OpenAI API, as on /generate: 200 with what
was generated and finish_reason "abort" (Responses: status "incomplete", incomplete_details.reason "abort"),
a final chunk then [DONE] when streamed; never an HTTP 500 nor an error event, in /metrics neither."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from _http_server import main_server

LONG = 450  # tokens with ignore_eos: seconds of decoding on the tiny model, time enough to abort
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abort me"}], "max_tokens": LONG,
                                 "ignore_eos": True})
COMPLETIONS = ("/v1/completions", {"prompt": "abort me", "max_tokens": LONG, "ignore_eos": True})
RESPONSES = ("/v1/responses", {"input": "abort me", "max_output_tokens": LONG, "ignore_eos": True})


@pytest.fixture(scope="module")
def server():
    return main_server()


def _http_500s(server) -> int:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    match = re.search(r'^radixserve_http_responses_total\{code="500"\} (\d+)', text, re.M)
    return int(match.group(1)) if match else 0


def _abort_once_running(server) -> None:
    deadline = time.monotonic() + 30
    while server.server_info()["stats"]["num_running"] < 1:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.01)
    reply = httpx.post(server.url + "/abort_request", json={"abort_all": True}, timeout=10)
    assert reply.status_code == 200 and reply.json() == {"aborted": 1}, reply.text


def _post_aborted(server, path: str, body: dict) -> httpx.Response:
    """POST body (not streamed), abort it once it runs; the answer."""
    out: dict = {}

    def post() -> None:
        out["reply"] = httpx.post(server.url + path, json=body, timeout=120)

    thread = threading.Thread(target=post)
    thread.start()
    _abort_once_running(server)
    thread.join(60)
    return out["reply"]


def _stream_aborted(server, path: str, body: dict) -> list[str]:
    """The data lines of body streamed, aborted after its first generated text."""
    lines = []
    with httpx.stream("POST", server.url + path, json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 3:  # past the role / created events: tokens are coming
                    _abort_once_running(server)
    return lines


@pytest.mark.parametrize("path, body", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_abort_answers_200_with_finish_reason_abort(server, path, body):
    before = _http_500s(server)
    r = _post_aborted(server, path, body)
    assert r.status_code == 200, r.text
    payload = r.json()
    choice = payload["choices"][0]
    assert choice["finish_reason"] == "abort", choice
    assert 0 < payload["usage"]["completion_tokens"] < LONG
    text = choice["message"]["content"] if path == CHAT[0] else choice["text"]
    assert text  # what was generated until the abort
    assert _http_500s(server) == before
    server.wait_idle()


@pytest.mark.parametrize("path, body", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_aborted_stream_ends_with_finish_reason_abort_then_done(server, path, body):
    before = _http_500s(server)
    lines = _stream_aborted(server, path, body)
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    assert not any("error" in e for e in events), events[-3:]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["abort"], events[-3:]
    assert len(events) < LONG
    assert _http_500s(server) == before
    server.wait_idle()


def test_aborted_response_is_incomplete_with_reason_abort(server):
    before = _http_500s(server)
    r = _post_aborted(server, *RESPONSES)
    assert r.status_code == 200, r.text
    response = r.json()
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "abort"}
    assert response["error"] is None and 0 < response["usage"]["output_tokens"] < LONG
    message = response["output"][0]
    assert message["status"] == "incomplete" and message["content"][0]["text"]
    stored = httpx.get(f"{server.url}/v1/responses/{response['id']}", timeout=30).json()
    assert stored["status"] == "incomplete"
    assert _http_500s(server) == before
    server.wait_idle()


def test_aborted_response_stream_ends_with_response_incomplete(server):
    before = _http_500s(server)
    events = [json.loads(line) for line in _stream_aborted(server, *RESPONSES)]
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.incomplete" and "response.failed" not in kinds and "error" not in kinds
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "abort"} and final["error"] is None
    assert 0 < final["usage"]["output_tokens"] < LONG
    assert _http_500s(server) == before
    server.wait_idle()
