"""A bad-input battery against real servers: malformed and adversarial requests on every endpoint.

The table is tests/_http_battery_cases.py; auth and overload are in tests/test_http_auth_overload.py.
After every case the guard (tests/_http_battery.py) asserts that the server is healthy, that no
answer was 500/502/504 (503 only under overload), that every non-2xx body is an OpenAI error
naming what to fix, that nothing logged a traceback, and that once idle the KV pool accounts
for every slot (free + evictable + locked + in flight == total, none locked or in flight).

Unknown fields, as the server treats them today: OpenAI bodies ignore unknown top-level fields
(clients send vendor extras), and so does /generate at the top level (SGLang clients send extras
such as image_data); unknown keys inside /generate's sampling_params are refused naming the key,
as SGLang's SamplingParams(**kwargs) refuses them.
"""
from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest
from _http_battery import (
    Guard,
    assert_answer,
    connect,
    raw_exchange,
    read_until,
    request_bytes,
)
from _http_battery_cases import (
    _UNSET,
    ABORT,
    ALL_CASES,
    CHAT,
    CMPL,
    GEN,
    USER,
    Case,
    cmpl,
)
from _http_server import main_server


@pytest.fixture(scope="module")
def server():
    """--context-length 512, --max-body-bytes 65536, served as "tiny" (tests/_http_server.py)."""
    return main_server()


@pytest.fixture
def guard(server):
    """Taken before the case (the server must be idle then); each case ends with guard.check()."""
    return Guard(server)


def _send(server, case: Case):
    kwargs: dict[str, Any] = {"headers": case.headers}
    if case.json is not _UNSET:
        kwargs["json"] = case.json
    elif case.content is not None:
        kwargs["content"] = case.content
    with server.client() as http:
        return http.request(case.method, case.path, **kwargs)


@pytest.mark.parametrize("case", ALL_CASES)
def test_bad_input(server, guard, case):
    response = _send(server, case)
    error = assert_answer(response, case.status)
    if error is not None:
        if case.param is not None:
            assert error["param"] == case.param, error
        if case.code is not None:
            assert error["code"] == case.code, error
        if case.says is not None:
            assert case.says.lower() in error["message"].lower(), error
    elif response.status_code == 200 and case.check is not None:
        case.check(response.json())
    if response.status_code == 307:
        assert response.headers["location"].endswith(case.path.rstrip("/"))
    guard.check()


# -- raw sockets: lies about the body, truncated uploads, protocol errors --------------------


def test_content_length_shorter_than_declared_then_close(server, guard):
    """The client promises 5000 bytes, sends 30 and leaves: no engine request, no 500 counted."""
    before = guard.stats_before["num_requests_finished"] + guard.stats_before["num_requests_aborted"]
    with connect(server.url) as sock:
        sock.sendall(request_bytes("POST", CMPL, b'{"prompt": "upload", "max_tok', content_length=5000,
                                   headers={"Content-Type": "application/json"}))
        time.sleep(0.2)
    stats = guard.check()
    assert stats["num_requests_finished"] + stats["num_requests_aborted"] == before


def test_chunked_upload_cut_mid_body(server, guard):
    with connect(server.url) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"10\r\n{\"text\": \"uploa")
        time.sleep(0.2)
    guard.check()


def test_headers_cut_mid_request_line(server, guard):
    with connect(server.url) as sock:
        sock.sendall(b"POST /v1/chat/compl")
        time.sleep(0.1)
    guard.check()


def test_complete_body_over_raw_socket(server, guard):
    """Sanity for the raw path: the same bytes the cut cases send, whole, are answered 200."""
    response = raw_exchange(server.url, request_bytes("POST", CMPL, json.dumps(cmpl()).encode(),
                                                      headers={"Content-Type": "application/json"}))
    assert_answer(response, 200)
    assert response.json()["object"] == "text_completion"
    guard.check()


def test_declared_length_over_limit_is_413_before_the_body(server, guard):
    """413 from the Content-Length header alone; the client never sends the 100 MB."""
    with connect(server.url, timeout=10) as sock:
        sock.sendall(request_bytes("POST", CHAT, b"{", content_length=100_000_000))
        data = read_until(sock, b"}}", 1)
    status = int(data.split(b" ", 2)[1])
    assert status == 413, data[:300]
    guard.check()


@pytest.mark.parametrize("header", ["Content-Length: abc", "Content-Length: -5"], ids=["letters", "negative"])
def test_invalid_content_length_is_400(server, guard, header):
    """h11 refuses these before the app runs: uvicorn's plain-text 400, and the server stays up."""
    data = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{header}\r\nConnection: close\r\n\r\n{{}}".encode()
    response = raw_exchange(server.url, data)
    assert response.status_code == 400, response.content
    guard.check()


def test_non_ascii_bytes_in_header_value(server, guard):
    data = request_bytes("POST", CMPL, json.dumps(cmpl()).encode(), headers={"X-Note": "caf\xe9 \xff"})
    assert_answer(raw_exchange(server.url, data), 200)
    guard.check()


# -- the openai SDK on bad input -------------------------------------------------------------


def test_sdk_bad_requests_raise_typed_errors(server, guard):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, temperature=-3)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, stop=[f"s{i}" for i in range(100)])
    assert info.value.body["param"] == "stop"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt="z" * 70_000, max_tokens=1)
    assert info.value.status_code == 413
    guard.check()


def test_sdk_stream_with_bad_input_fails_before_streaming(server, guard):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "tool", "content": "x"}], stream=True)
    assert info.value.body["param"] == "messages[0].tool_call_id"
    guard.check()


# -- disconnects ----------------------------------------------------------------------------


STREAMS = [
    pytest.param(CHAT, {"messages": [{"role": "user", "content": "stream away"}], "max_tokens": 400,
                        "ignore_eos": True, "stream": True}, 1, id="chat-stream"),
    pytest.param(CMPL, {"prompt": "stream away", "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 3},
                 3, id="completions-stream-n3"),
    pytest.param(GEN, {"text": "stream away", "stream": True,
                       "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}, 1, id="generate-stream"),
    pytest.param(GEN, {"text": ["stream a", "stream b"], "stream": True,
                       "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}, 2,
                 id="generate-batch-stream"),
]


@pytest.mark.parametrize("path, body, num", STREAMS)
def test_disconnect_mid_stream_aborts_and_frees_kv(server, guard, path, body, num):
    aborted = guard.stats_before["num_requests_aborted"]
    with connect(server.url) as sock:
        sock.sendall(request_bytes("POST", path, json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"}))
        head = read_until(sock, b"data: ", 3)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
    stats = guard.check()
    assert stats["num_requests_aborted"] == aborted + num


@pytest.mark.parametrize("path, body", [
    pytest.param(CMPL, {"prompt": "wait for me", "max_tokens": 450, "ignore_eos": True}, id="completions"),
    pytest.param(GEN, {"text": "wait for me", "sampling_params": {"max_new_tokens": 450, "ignore_eos": True}},
                 id="generate"),
])
def test_disconnect_while_waiting_for_a_whole_answer(server, guard, path, body):
    aborted = guard.stats_before["num_requests_aborted"]
    with connect(server.url) as sock:
        sock.sendall(request_bytes("POST", path, json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"}))
        _wait_running(server)
    stats = guard.check()
    assert stats["num_requests_aborted"] == aborted + 1


def test_abort_request_ends_a_running_stream_and_frees_kv(server, guard):
    aborted = guard.stats_before["num_requests_aborted"]
    body = {"text": "abort me", "rid": "battery-abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 450, "ignore_eos": True}}
    with connect(server.url) as sock:
        sock.sendall(request_bytes("POST", GEN, json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"}))
        read_until(sock, b"data: ", 2)
        with server.client() as http:
            answer = http.post(ABORT, json={"rid": "battery-abort-me"})
        assert_answer(answer, 200)
        events = read_until(sock, b"data: [DONE]", 1)
    last = json.loads(events.split(b"data: ")[-2].split(b"\r\n")[0])
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
    stats = guard.check()
    assert stats["num_requests_aborted"] == aborted + 1


def _wait_running(server, headers: dict | None = None, num: int = 1, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while server.server_info(headers)["stats"]["num_running"] < num:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.01)
