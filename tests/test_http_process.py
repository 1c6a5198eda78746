"""The process layout (ARCHITECTURE §2): a torch-free HTTP process, the engine in its own
process, batched events, and health that tells the truth (real servers, real signals)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from radixserve.frontend.spawn import ServerProcess
from _http_server import START_TIMEOUT_S, main_server, tiny_model_path


def _server(*args: str, fault: str | None = None) -> ServerProcess:
    env = {"OMP_NUM_THREADS": "1"}
    if fault is not None:
        env["RADIXSERVE_TEST_FAULT"] = fault
    return ServerProcess(["--model", tiny_model_path(), "--context-length", "512", "--kv-cache-tokens", "4096",
                          "--num-threads", "1", *args], start_timeout_s=START_TIMEOUT_S, env=env)


def _mapped_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_http_process_never_maps_libtorch():
    server = main_server()
    with server.client() as c:
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 4})
        gen = c.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 4}})
        tok = c.post("/tokenize", json={"prompt": "hello world"})
        resp = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4})
        engine_pid = server.server_info()["engine_pid"]
    assert chat.status_code == 200 and gen.status_code == 200 and resp.status_code == 200
    assert tok.status_code == 200 and tok.json()["count"] == len(tok.json()["tokens"])
    assert "libtorch" not in _mapped_libraries(server.proc.pid)
    assert "libtorch" in _mapped_libraries(engine_pid)  # the check can see libtorch where it is


def test_engine_refusal_is_a_400_before_any_stream_byte():
    with main_server().client() as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100000, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"


def test_one_event_message_per_engine_step():
    """Eight concurrent streams of 8 tokens: the engine sends at most one message per step
    (plus admissions), not one per token per request."""
    server = main_server()
    before = server.server_info()
    results = []

    def one(i: int) -> None:
        with server.client() as c:
            results.append(c.post("/generate", json={"input_ids": [5 + i, 7, 9],
                                                     "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
                                                     "stream": True}).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = server.wait_idle()
    assert results == [200] * 8
    steps = after["stats"]["num_steps"] - before["stats"]["num_steps"]
    messages = after["engine_messages"] - before["engine_messages"]
    tokens = after["stats"]["num_generated_tokens"] - before["stats"]["num_generated_tokens"]
    assert tokens == 64
    assert messages <= steps + 8 + 2, (messages, steps)  # + admissions + the two info calls


def _open_stream(server: ServerProcess, out: dict) -> threading.Thread:
    def run() -> None:
        body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
                "stream": True}
        events = []
        try:
            with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        out.setdefault("first", time.monotonic())
        except httpx.HTTPError as exc:
            out["exc"] = exc
        out["events"] = events
        out["ended"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_first_event(out: dict) -> None:
    deadline = time.monotonic() + 30
    while "first" not in out and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "first" in out, "the stream never started"


def test_engine_death_ends_streams_and_the_server_exits_nonzero():
    server = _server()
    try:
        engine_pid = server.server_info()["engine_pid"]
        out: dict = {}
        thread = _open_stream(server, out)
        _wait_first_event(out)
        killed = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive() and out["ended"] - killed < 5
        assert any('"error"' in e for e in out["events"]), out["events"][-3:]
        try:
            assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        except httpx.HTTPError:
            pass  # already exited
        server.proc.wait(15)
        assert server.proc.returncode not in (0, None)
    finally:
        server.stop(timeout=5)


def test_health_generate_is_503_when_every_forward_fails():
    server = _server(fault="fail-forward")
    try:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        r = httpx.get(server.url + "/health_generate", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unhealthy"
        # A Responses stream ends with response.failed, carrying the error (its status line was sent).
        body = {"input": "hi", "max_output_tokens": 4, "stream": True}
        with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "generation_failed"
        # A Messages stream ends with Anthropic's error event; the whole message is a 500 in Anthropic's format.
        body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=30) as stream:
            lines = list(stream.iter_lines())
        assert [line[7:] for line in lines if line.startswith("event: ")] == ["message_start", "ping", "error"]
        error = json.loads([line for line in lines if line.startswith("data: ")][-1][6:])
        assert error["type"] == "error" and error["error"]["type"] == "api_error", error
        r = httpx.post(server.url + "/v1/messages", json=dict(body, stream=False), timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error", r.text
    finally:
        server.stop(timeout=20)


def test_health_turns_503_when_the_engine_hangs_past_the_watchdog():
    server = _server("--watchdog-timeout", "2", fault="hang-forward")
    try:
        out: dict = {}
        thread = _open_stream(server, out)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        deadline = time.monotonic() + 20
        status = 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(0.25)
            status = httpx.get(server.url + "/health", timeout=5).status_code
        assert status == 503
        assert httpx.get(server.url + "/health", timeout=5).json()["error"]["code"] == "engine_stalled"
    finally:
        server.proc.kill()
        server.proc.wait(10)
        thread.join(10)


def test_sigterm_drains_and_stops_both_processes():
    server = _server()
    engine_pid = server.server_info()["engine_pid"]
    out: dict = {}
    thread = _open_stream(server, out)
    _wait_first_event(out)
    assert server.stop(timeout=60) == 0
    thread.join(10)
    assert out["events"][-1] == "data: [DONE]" and '"length"' in out["events"][-2]
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(engine_pid, 0)
            time.sleep(0.1)


def test_abort_request_ends_a_running_generation():
    server = main_server()
    body = {"input_ids": [3, 4, 5], "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if len(events) == 1:
                reply = httpx.post(server.url + "/abort_request", json={"rid": "to-abort"}, timeout=10)
                assert reply.status_code == 200 and reply.json() == {"aborted": 1}
    assert events[-1] == "data: [DONE]" and '"abort"' in events[-2] and len(events) < 100
    assert httpx.post(server.url + "/abort_request", json={"rid": "gone"}, timeout=10).json() == {"aborted": 0}
    assert httpx.post(server.url + "/abort_request", json={"rid": 5}, timeout=10).status_code == 400
    server.wait_idle()
