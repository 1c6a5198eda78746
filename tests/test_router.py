"""`serve --replicas 2` behind the real sglang-router (0.3.2) on loopback: what passes through,
what cache-aware routing saves against round robin, session pinning with the manual policy,
/v1/responses follow-ups across workers (one shared store), a worker killed mid-run, and the SIGTERM
drain (frontend/replicas.py, frontend/router_proc.py); first, the demo model's quiet start and the
stop on a second signal.

One module-scoped set: a supervisor with 2 tiny workers (an API key on, so the router's own probes
and the pass-through of the Authorization header are exercised) and its cache_aware router; the
round_robin and manual routers are extra routers started here against the same two workers.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

pytest.importorskip("sglang_router")

from radixserve.bench.router_bench import computed_tokens, text_gsp  # noqa: E402
from radixserve.frontend.router_proc import RouterProcess, free_port  # noqa: E402
from radixserve.kernels import native  # noqa: E402
from _http_server import ServerProcess, tiny_model_path  # noqa: E402

KEY = "sk-router-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
WORKER_LINE = re.compile(r"worker (\d+) (?:ready|is back) on (http://[\d.]+:\d+) \(pid (\d+)\)")


def test_replicas_of_the_demo_model_start_quietly_list_it_and_stop_on_a_second_sigterm():
    """The README's first steps with --replicas 2 on the built-in demo model: the router lists the model
    by the name a client sends (the workers' server info names it), the start logs no warning (no
    HTTP/2 probe noise, no router tokenizer warning) and no health-check lines at INFO, the ready line
    names the attention path; a second SIGTERM ends an open stream with an error event through the
    router and the supervisor exits 143. First in the module: its workers are gone before the next set
    starts."""
    server = ServerProcess(["--replicas", "2", "--kv-cache-tokens", "8192"])
    try:
        models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["radixserve-demo"]
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": models[0]["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        unnamed = httpx.post(server.url + "/v1/chat/completions", timeout=60,  # no model: as on a single server
                             json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert unnamed.status_code == 200 and unnamed.json()["model"] == "radixserve-demo", unnamed.text
        start_log = server.log()
        out: dict = {}
        thread = threading.Thread(target=_stream_until_stopped, args=(server.url, out))
        thread.start()
        deadline = time.monotonic() + 30
        while len(out.get("lines", [])) < 2:
            assert time.monotonic() < deadline and thread.is_alive(), out
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        server.proc.send_signal(signal.SIGTERM)
        thread.join(60)
        status = server.proc.wait(60)
    finally:
        server.stop(timeout=60)
    noise = [line for line in start_log.splitlines()
             if re.search(r"\bWARN(ING)?\b|Invalid HTTP request|PRI \*|Traceback|\"GET /health\"", line)]
    assert not noise, "\n".join(noise)
    attention = f"native {native.chosen_isa().name}" if native.cannot_build() is None else "torch flash op"
    assert re.search(rf"radixserve ready: serving radixserve-demo on .*attention: {attention}\)", start_log), start_log
    assert status == 143, server.log()[-3000:]
    lines = out["lines"]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2][6:])["error"]["code"] == "server_shutting_down", lines[-3:]


def _stream_until_stopped(url: str, out: dict) -> None:
    body = {"model": "radixserve-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
            "ignore_eos": True, "stream": True}
    out["lines"] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                out["lines"].append(line)


@pytest.fixture(scope="module")
def replicas():
    server = ServerProcess(["--model", tiny_model_path(), "--replicas", "2", "--api-key", KEY,
                            "--served-model-name", "tiny", "--context-length", "512", "--kv-cache-tokens", "8192",
                            "--max-tokens-default", "16", "--disable-log-requests"])
    yield server
    assert server.stop(timeout=60) == 0, server.log()[-3000:]


def workers(server: ServerProcess) -> dict[int, tuple[str, int]]:
    """Worker index -> (url, pid), the latest start of each, from the supervisor's log."""
    out = {}
    for m in WORKER_LINE.finditer(server.log()):
        out[int(m.group(1))] = (m.group(2), int(m.group(3)))
    return out


def stats(url: str) -> dict:
    return httpx.get(url + "/get_server_info", headers=AUTH, timeout=30).json()["stats"]


def flush_all(server: ServerProcess) -> None:
    for url, _ in workers(server).values():
        deadline = time.monotonic() + 30
        while httpx.post(url + "/flush_cache", headers=AUTH, timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "a worker would not flush its cache"
            time.sleep(0.1)


def chat(url: str, content: str, headers: dict | None = None, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "ignore_eos": True, **extra}  # the random model samples EOS now and then
    return httpx.post(url + "/v1/chat/completions", json=body, headers={**AUTH, **(headers or {})}, timeout=60)


def test_worker_surface_the_router_probes(replicas):
    url, _ = workers(replicas)[0]
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(url + path, headers=AUTH, timeout=30).json()
        assert info["served_model_name"] == "tiny" and info["replicas"] == 1 and info["num_threads"] == 1
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(url + path, headers=AUTH, timeout=30).json()["served_model_name"] == "tiny"
    (load,) = httpx.get(url + "/get_load", headers=AUTH, timeout=30).json()  # one entry per DP rank
    assert load["dp_rank"] == 0 and load["num_reqs"] == load["num_running_reqs"] + load["num_waiting_reqs"] == 0
    assert load["num_tokens"] == 0 and load["token_usage"] == 0.0
    assert httpx.get(url + "/get_load", timeout=30).status_code == 401
    router_loads = httpx.get(replicas.url + "/get_loads", headers=AUTH, timeout=30).json()["workers"]
    assert [w["load"] for w in router_loads] == [0, 0]  # the router reads it (-1: it could not)
    listed = httpx.get(replicas.url + "/workers", headers=AUTH, timeout=30).json()["workers"]
    assert sorted(w["url"] for w in listed) == sorted(u for u, _ in workers(replicas).values())
    assert all(w["is_healthy"] and w["model_id"] == "tiny" for w in listed)


def test_generation_endpoints_pass_through_with_the_api_key(replicas):
    url = replicas.url
    assert chat(url, "hello", headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = chat(url, "hello there", prompt_cache_key="session-1")
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    assert r.json()["prompt_cache_key"] == "session-1"  # kept by the router's chat request type
    assert r.json()["usage"]["completion_tokens"] == 4
    with httpx.stream("POST", url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "stream me"}],
                            "max_tokens": 5, "stream": True, "ignore_eos": True}) as s:
        lines = [line for line in s.iter_lines() if line]
    assert s.status_code == 200 and lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in lines[-2] and sum('"content"' in line for line in lines) >= 2
    gen = httpx.post(url + "/generate", headers=AUTH, timeout=60,
                     json={"text": "native hello", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert gen.status_code == 200 and gen.json()["meta_info"]["completion_tokens"] == 3
    comp = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "tiny", "prompt": "once", "max_tokens": 3, "ignore_eos": True})
    assert comp.status_code == 200 and comp.json()["usage"]["completion_tokens"] == 3
    models = httpx.get(url + "/v1/models", headers=AUTH, timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    typed = chat(url, "x", max_tokens=-1)  # the router checks types itself, in the OpenAI error format
    assert typed.status_code == 400 and typed.json()["error"]["type"] == "invalid_request_error"
    too_long = chat(url, "x", max_tokens=100000)  # the worker's own error comes back unchanged
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def test_messages_api_is_served_by_the_workers_not_the_router(replicas):
    """sglang-router 0.3.2 has no route for Anthropic's /v1/messages (README "Replicas and routing" says so; this
    fails once a router passes it on), while each worker answers it with the same key."""
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(replicas.url + "/v1/messages", json=body, headers=AUTH, timeout=60).status_code == 404
    for url, _ in workers(replicas).values():
        r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
        assert r.status_code == 200 and r.json()["type"] == "message", r.text


def _computed(server: ServerProcess, url: str, requests) -> int:
    """Prompt tokens computed (not cached) over both workers for `requests` sent one by one to url."""
    flush_all(server)
    urls = [u for u, _ in workers(server).values()]
    before = [stats(u) for u in urls]
    for req in requests:
        r = httpx.post(url + "/v1/chat/completions", json=req.body("tiny", stream=False), headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
    return computed_tokens(before, [stats(u) for u in urls])["computed_tokens"]


def test_cache_aware_computes_what_one_worker_does_round_robin_does_not(replicas):
    requests = text_gsp(num_groups=8, per_group=4, system_words=40, question_words=3, output_len=2, seed=1)
    urls = [u for u, _ in workers(replicas).values()]
    single = _computed(replicas, urls[0], requests)
    cache_aware = _computed(replicas, replicas.url, requests)
    rr = RouterProcess(urls, "127.0.0.1", free_port(), "round_robin", KEY)
    try:
        rr.wait_ready(2)
        round_robin = _computed(replicas, rr.url, requests)
    finally:
        rr.stop(timeout=10)
    assert abs(cache_aware - single) <= 0.1 * single, (single, cache_aware, round_robin)
    assert round_robin >= 1.3 * single, (single, cache_aware, round_robin)


def test_manual_policy_pins_a_routing_key_to_one_worker(replicas):
    """x-smg-routing-key (sglang-router's manual policy): one session's requests, whatever their text,
    reach one worker; without the header it falls back to random (not asserted)."""
    urls = [u for u, _ in workers(replicas).values()]
    manual = RouterProcess(urls, "127.0.0.1", free_port(), "manual", KEY)
    try:
        manual.wait_ready(2)
        landed: dict[str, set[int]] = {}
        for i in range(12):
            key = f"session-{i % 3}"
            before = [stats(u)["num_requests_finished"] for u in urls]
            assert chat(manual.url, f"turn {i} of {key}", headers={"x-smg-routing-key": key}).status_code == 200
            after = [stats(u)["num_requests_finished"] for u in urls]
            landed.setdefault(key, set()).update(w for w in range(2) if after[w] > before[w])
    finally:
        manual.stop(timeout=10)
    assert all(len(ws) == 1 for ws in landed.values()), landed


def responses(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json={"model": "tiny", "max_output_tokens": 4, **body}, headers=AUTH,
                      timeout=60)


def test_responses_pass_through_and_a_follow_up_resolves_on_every_worker(replicas):
    """sglang-router passes /v1/responses to one worker (its history backend serves only its gRPC and
    OpenAI backends), re-serialized from its typed request: previous_response_id and store kept,
    prompt_cache_key dropped. The workers share the supervisor's one store file, so a follow-up
    resolves whichever worker gets it; GET /v1/responses/{id} the router asks of every worker."""
    first = responses(replicas.url, input="remember the word apricot", prompt_cache_key="session-1")
    assert first.status_code == 200, first.text
    prev = first.json()
    assert prev["object"] == "response" and prev["prompt_cache_key"] is None  # the router dropped it
    history = prev["usage"]["input_tokens"] + prev["usage"]["output_tokens"]
    for url in [replicas.url] + [u for u, _ in workers(replicas).values()]:
        r = responses(url, input="which word was it?", previous_response_id=prev["id"])
        assert r.status_code == 200, (url, r.text)
        assert r.json()["previous_response_id"] == prev["id"]
        assert r.json()["usage"]["input_tokens"] > history  # the stored turn is in the prompt
    got = httpx.get(replicas.url + f"/v1/responses/{prev['id']}", headers=AUTH, timeout=30)
    assert got.status_code == 200 and got.json()["id"] == prev["id"]
    with httpx.stream("POST", replicas.url + "/v1/responses", headers=AUTH, timeout=60,
                      json={"model": "tiny", "input": "stream it", "max_output_tokens": 3, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line.startswith("event: ")]
    assert s.status_code == 200 and events[0] == "event: response.created"
    assert events[-1] in ("event: response.completed", "event: response.incomplete")
    unknown = responses(replicas.url, input="x", previous_response_id="resp_nope")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "response_not_found"


def _long_request(url: str, i: int, stream: bool, out: dict) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"long request {i}"}], "max_tokens": 400,
            "ignore_eos": True, "stream": stream}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        done = r.status_code == 200 and (not stream or lines[-1:] == ["data: [DONE]"] and '"length"' in lines[-2])
        out[i] = ("ok" if done else f"error {r.status_code} {lines[-1:]}", time.monotonic())
    except httpx.HTTPError as exc:
        out[i] = (f"error {exc!r}", time.monotonic())


def test_a_killed_worker_fails_its_requests_fast_and_comes_back(replicas):
    """SIGKILL a worker with long requests open (its engine dies with it): its streams end with an
    error at once, requests sent afterwards all succeed, and the supervisor restarts it."""
    before = workers(replicas)
    threads, results = [], {}
    for i in range(6):
        threads.append(threading.Thread(target=_long_request, args=(replicas.url, i, i % 2 == 0, results)))
        threads[-1].start()
    deadline = time.monotonic() + 30
    while not (busy := [w for w, (u, _) in before.items() if stats(u)["num_running"] > 0]):
        assert time.monotonic() < deadline, "no worker got the long requests"
        time.sleep(0.05)
    victim = busy[0]
    victim_requests = stats(before[victim][0])["num_running"]
    os.kill(before[victim][1], signal.SIGKILL)
    killed_at = time.monotonic()
    after = [chat(replicas.url, f"after the kill {i}") for i in range(8)]
    for t in threads:
        t.join(timeout=60)
    # Every request ends within 10 s of the kill, none hangs. Streams cut on the victim end with an
    # error (no [DONE]); the router retries a non-streaming request whose worker connection failed,
    # so those usually complete on the other worker.
    assert len(results) == 6 and victim_requests >= 1
    assert all(ended - killed_at < 10 for _, ended in results.values()), results
    assert any(outcome != "ok" for outcome, _ in results.values()), results
    assert [r.status_code for r in after] == [200] * 8
    deadline = time.monotonic() + 120
    while workers(replicas)[victim][0] == before[victim][0]:
        assert time.monotonic() < deadline, "the killed worker did not come back:\n" + replicas.log()[-3000:]
        time.sleep(0.5)
    current = sorted(u for u, _ in workers(replicas).values())  # the dead URL is gone from the router too
    deadline = time.monotonic() + 30
    while sorted((w["url"], w["is_healthy"]) for w in httpx.get(
            replicas.url + "/workers", headers=AUTH, timeout=30).json()["workers"]) != [(u, True) for u in current]:
        assert time.monotonic() < deadline, "the router did not swap the dead worker for the restarted one"
        time.sleep(0.2)
    new_url = workers(replicas)[victim][0]
    assert chat(new_url, "direct to the restarted worker").status_code == 200


def test_sigterm_drains_the_workers_then_stops_the_router(replicas):
    """Last (it ends the set): a request running at SIGTERM still completes through the router,
    then the supervisor exits 0 with every worker and the router gone."""
    results: dict = {}
    thread = threading.Thread(target=_long_request, args=(replicas.url, 99, False, results))
    thread.start()
    deadline = time.monotonic() + 30
    while not any(stats(u)["num_running"] for u, _ in workers(replicas).values()):
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.05)
    pids = [pid for _, pid in workers(replicas).values()]
    replicas.proc.send_signal(signal.SIGTERM)
    thread.join(timeout=60)
    assert results[99][0] == "ok", results
    assert replicas.proc.wait(timeout=60) == 0, replicas.log()[-3000:]
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    with pytest.raises(httpx.ConnectError):
        httpx.get(replicas.url + "/liveness", timeout=5)
