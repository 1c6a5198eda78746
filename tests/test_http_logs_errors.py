"""The access log (one radixserve.access line per request, off with --disable-log-requests) and
OpenAI-format errors for everything the server answers: 404, 405 (with Allow), 413, a bad body,
and the requests a stop ends: a second Ctrl-C, or the graceful timeout running out (uvicorn would
cut a stream and send plain text)."""
import json
import re
import signal
import threading
import time

import httpx
import pytest

from _http_server import START_TIMEOUT_S, shared_server, tiny_model_path
from radixserve.frontend.spawn import ServerProcess as Spawned

ACCESS = re.compile(r'radixserve\.access: \S+ "(?P<method>\w+) (?P<path>\S+)" (?P<status>\d+) '
                    r"prompt_tokens=(?P<prompt>[\d-]+) cached_tokens=(?P<cached>[\d-]+) "
                    r"completion_tokens=(?P<completion>[\d-]+) ttft=(?P<ttft>[\d.]+s|-) latency=(?P<latency>[\d.]+)s"
                    r'(?: error=(?P<type>\S+) param=(?P<param>\S+) code=(?P<code>\S+) message=(?P<message>".*"))?$')
USER = [{"role": "user", "content": "hi"}]


def _args() -> list[str]:
    return ["--model", tiny_model_path(), "--context-length", "512", "--kv-cache-tokens", "4096",
            "--max-body-bytes", "4096", "--log-level", "info"]


@pytest.fixture(scope="module")
def logged():
    """A server at the default log level (info), so access lines are written."""
    return shared_server("logged", _args())


@pytest.fixture(scope="module")
def http(logged):
    with logged.client() as client:
        yield client


def _access_lines(server, path: str, count: int, timeout: float = 10.0) -> list[dict]:
    """The access lines for `path` once `count` of them were written (the line follows the body)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [m.groupdict() for m in map(ACCESS.search, list(server.lines)) if m and m["path"] == path]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_access_line_for_a_completion_has_its_tokens(logged, http):
    path = "/v1/completions"
    before = len(_access_lines(logged, path, 0, timeout=0))
    r = http.post(path, json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200
    usage = r.json()["usage"]
    line = _access_lines(logged, path, before + 1)[-1]
    assert (line["method"], line["status"]) == ("POST", "200")
    assert int(line["prompt"]) == usage["prompt_tokens"] == 3
    assert int(line["cached"]) == usage["prompt_tokens_details"]["cached_tokens"]
    assert int(line["completion"]) == usage["completion_tokens"] == 4
    assert float(line["ttft"][:-1]) <= float(line["latency"])


def test_access_line_of_a_stream_is_written_after_it_ends(logged, http):
    path = "/v1/chat/completions"
    before = len(_access_lines(logged, path, 0, timeout=0))
    with http.stream("POST", path, json={"messages": USER, "max_tokens": 6, "stream": True,
                                         "ignore_eos": True}) as r:
        body = b"".join(r.iter_bytes())
    assert r.status_code == 200 and body.endswith(b"data: [DONE]\n\n")
    line = _access_lines(logged, path, before + 1)[-1]
    assert line["status"] == "200" and line["completion"] == "6" and int(line["prompt"]) > 0
    assert float(line["ttft"][:-1]) <= float(line["latency"])


def test_access_line_of_native_generate_and_of_a_plain_endpoint(logged, http):
    r = http.post("/generate", json={"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {"max_new_tokens": 2,
                                                                                             "ignore_eos": True}})
    assert r.status_code == 200
    line = _access_lines(logged, "/generate", 1)[-1]
    assert (line["prompt"], line["completion"]) == ("5", "4")  # summed over the batch
    assert http.get("/get_model_info").status_code == 200
    line = _access_lines(logged, "/get_model_info", 1)[-1]
    assert (line["status"], line["prompt"], line["ttft"]) == ("200", "-", "-")


def test_a_passing_health_probe_is_logged_at_debug_only(logged, http):
    """A router probes /health every few seconds: at the default level (info) it writes no line."""
    before = len(_access_lines(logged, "/get_model_info", 0, timeout=0))
    assert http.get("/health").status_code == 200
    assert http.get("/get_model_info").status_code == 200  # its line comes after the probe's would have
    assert len(_access_lines(logged, "/get_model_info", before + 1)) == before + 1
    assert not _access_lines(logged, "/health", 1, timeout=0), logged.log()[-2000:]


def test_access_line_of_a_refused_request_says_why(logged, http):
    path = "/v1/chat/completions"
    before = len(_access_lines(logged, path, 0, timeout=0))
    error = _error(http.post(path, json={"messages": USER, "temperature": 150}), 400)
    line = _access_lines(logged, path, before + 1)[-1]
    assert line["status"] == "400" and (line["type"], line["param"]) == (error["type"], "temperature")
    assert (line["code"], json.loads(line["message"])) == (error["code"], error["message"])
    _error(http.get("/v1/nothing-here"), 404)
    line = _access_lines(logged, "/v1/nothing-here", 1)[-1]
    assert (line["type"], line["param"]) == ("not_found_error", "-") and "/v1/nothing-here" in line["message"]


def test_access_line_of_a_stream_the_client_left_says_499(logged, http):
    path = "/v1/completions"
    before = len(_access_lines(logged, path, 0, timeout=0))
    with http.stream("POST", path, json={"prompt": [5, 6], "max_tokens": 400, "ignore_eos": True,
                                         "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # one event, then hang up
    line = _access_lines(logged, path, before + 1)[-1]
    assert line["status"] == "499" and line["type"] is None, line


def test_unknown_path_is_an_openai_404(http, logged):
    error = _error(http.get("/v1/nothing-here"), 404)
    assert error["type"] == "not_found_error" and "/v1/nothing-here" in error["message"]
    _error(http.post("/nope", json={}), 404)
    assert _access_lines(logged, "/v1/nothing-here", 1)[-1]["status"] == "404"


def test_wrong_method_is_an_openai_405_with_allow(http):
    r = http.get("/v1/chat/completions")
    error = _error(r, 405)
    assert r.headers["allow"] == "POST" and "POST" in error["message"]
    r = http.post("/v1/models", json={})
    _error(r, 405)
    assert r.headers["allow"] == "GET, HEAD"


def test_body_errors_are_openai_errors(http):
    error = _error(http.post("/v1/completions", json={"prompt": "x" * 5000}), 413)
    assert "4096" in error["message"]
    error = _error(http.post("/v1/completions", content=b'{"prompt": "caf\xe9"}'), 400)
    assert error["message"].startswith("the request body is not valid UTF-8")
    error = _error(http.post("/v1/completions", content=b'{"prompt": "\\ud800"}'), 400)
    assert error["message"].startswith("the request body is not valid JSON")


def test_range_errors_use_the_common_wording(http):
    error = _error(http.post("/v1/chat/completions", json={"messages": USER, "temperature": 150}), 400)
    assert error["message"] == "temperature must be between 0 and 100, got 150"
    error = _error(http.post("/v1/chat/completions", json={"messages": USER, "n": 17}), 400)
    assert error["message"] == "n must be between 1 and 16, got 17"
    error = _error(http.post("/v1/chat/completions", json={"messages": USER, "top_p": 0}), 400)
    assert error["message"] == "top_p must be > 0 and <= 1, got 0"


def test_disable_log_requests_writes_no_access_line():
    quiet = shared_server("quiet", [*_args(), "--disable-log-requests"])
    with quiet.client() as c:
        assert c.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}).status_code == 200
        assert c.get("/health").status_code == 200
    time.sleep(0.5)
    assert not [line for line in quiet.lines if "radixserve.access" in line], quiet.log()
    assert any("radixserve ready" in line for line in quiet.lines)


def test_a_second_ctrl_c_ends_open_requests_with_an_openai_error_and_exits_130():
    """The engine hangs (test fault switch), so both requests are still open at the second SIGINT: the
    admitted stream gets an error event then [DONE], the one waiting for admission a 503 (uvicorn
    would cut the first and answer the second with a plain-text 500, after a traceback)."""
    server = _faulty_server(graceful_s=30)
    try:
        threads, out = _open_requests(server)
        server.proc.send_signal(signal.SIGINT)
        _wait_for_line(server, "received SIGINT: draining")
        server.proc.send_signal(signal.SIGINT)
        for thread in threads:
            thread.join(30)
        status = server.proc.wait(30)
    finally:
        server.stop(timeout=30)
    log = server.log()
    assert status == 130, log[-3000:]
    assert out["stream"][-1] == "data: [DONE]", out["stream"]
    error = json.loads(out["stream"][-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and "second shutdown signal" in error["message"], error
    assert _error(out["plain"], 503)["code"] == "server_shutting_down"
    assert re.search(r"received SIGINT: draining \d+ requests? \(up to 30 s\); Ctrl-C again to stop now", log)
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]
    # The tiny model's head_dim (16) is no multiple of 32, so the native kernel cannot read its pool.
    assert "(attention: torch flash op)" in log


def test_requests_left_when_the_graceful_timeout_runs_out_end_with_an_openai_error():
    """One SIGTERM: the drain waits --graceful-timeout (1 s) for the hung requests, ends them with the
    error naming it, and the server exits 0 (the stop was asked for)."""
    server = _faulty_server(graceful_s=1)
    try:
        threads, out = _open_requests(server)
        server.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        status = server.proc.wait(30)
    finally:
        server.stop(timeout=30)
    log = server.log()
    assert status == 0, log[-3000:]
    error = json.loads(out["stream"][-2].removeprefix("data: "))["error"]
    assert "--graceful-timeout 1 s ran out" in error["message"] and out["stream"][-1] == "data: [DONE]"
    assert _error(out["plain"], 503)["code"] == "server_shutting_down"
    assert "requests still running after 1 s; stopping anyway" in log and "Traceback" not in log


def _open_requests(server: Spawned) -> tuple[list[threading.Thread], dict]:
    """A chat stream, admitted (its status line came) and then held by the hung engine, and a completion
    sent after it, which waits for an admission that never comes."""
    out: dict = {}

    def stream() -> None:
        body = {"messages": USER, "max_tokens": 4, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            out["stream_status"] = r.status_code
            out["stream"] = [line for line in r.iter_lines() if line]

    def plain() -> None:
        out["plain"] = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}, timeout=60)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    threads[0].start()
    deadline = time.monotonic() + 30
    while out.get("stream_status") != 200:
        assert time.monotonic() < deadline, f"the stream did not start: {out}"
        time.sleep(0.02)
    threads[1].start()
    time.sleep(0.5)  # it reaches the server (no endpoint shows it: they all ask the hung engine)
    return threads, out


def _wait_for_line(server: Spawned, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for line in list(server.lines)):
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{server.log()[-2000:]}"
        time.sleep(0.02)


def _faulty_server(graceful_s: int) -> Spawned:
    return Spawned(["--model", tiny_model_path(), "--kv-cache-tokens", "1024", "--num-threads", "1",
                    "--graceful-timeout", str(graceful_s)], start_timeout_s=START_TIMEOUT_S,
                   env={"OMP_NUM_THREADS": "1", "RADIXSERVE_TEST_FAULT": "hang-forward"})
