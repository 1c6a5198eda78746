"""Tenants over real HTTP (issue 41 items 1, 5, 6): a server started with --api-keys (a TOML file) and --api-key.

Keys resolve to tenants through both headers and reach the engine (its weights and caps, the KV slots it
reports per tenant); each limit answers 429 with Retry-After in the API's own format and leaves the server healthy
with the idle KV identity; metrics and the access log name the tenant; stored responses, sessions and in-flight
requests are their tenant's; admin endpoints need an admin key; a bad keys file stops the start in one line."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
import pytest
from _http_battery import Guard, assert_openai_error
from _http_server import ServerProcess, shared_server, tiny_model_path

from radixserve.frontend.cli import main as cli_main
from radixserve.frontend.tenants import load_keys_file

KV_SLOTS = 4096
KEYS: dict[str, dict[str, Any]] = {
    "sk-ops-admin": {"tenant": "ops", "admin": True},
    "sk-acme": {"tenant": "acme", "weight": 3},
    "sk-acme-2": {"tenant": "acme", "weight": 3},
    "sk-beta": {"tenant": "beta"},
    "sk-solo": {"tenant": "solo", "limits": {"max_running_requests": 1, "max_queued_requests": 0}},
    "sk-pair": {"tenant": "pair", "limits": {"max_running_requests": 1, "max_queued_requests": 1}},
    "sk-tpm": {"tenant": "tpm", "limits": {"tokens_per_minute": 40}},
    "sk-kv": {"tenant": "kv", "limits": {"max_kv_share": 0.05}},
}
SINGLE_KEY = "sk-single-admin"
ADMIN = {"Authorization": "Bearer sk-ops-admin"}
LONG = 1000  # prompt + output tokens of a request a test holds open (it is aborted long before it ends)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def toml(keys: dict[str, dict[str, Any]]) -> str:
    """The keys file as TOML (one table per key, its limits a sub-table)."""
    lines = []
    for key, entry in keys.items():
        lines.append(f'["{key}"]')
        lines += [f"{k} = {json.dumps(v)}" for k, v in entry.items() if k != "limits"]
        if "limits" in entry:
            lines.append(f'["{key}".limits]')
            lines += [f"{k} = {json.dumps(v)}" for k, v in entry["limits"].items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "keys.toml"
    path.write_text(toml(KEYS))
    return shared_server("tenants", ["--model", tiny_model_path(), "--context-length", "1024", "--kv-cache-tokens",
                                     str(KV_SLOTS), "--max-running-requests", "8", "--api-keys", str(path),
                                     "--api-key", SINGLE_KEY, "--served-model-name", "tiny"])


def gen(key_headers: dict[str, str], n_prompt: int = 8, max_new: int = 2, first: int = 10, **extra: Any) -> dict:
    return {"json": {"input_ids": list(range(first, first + n_prompt)),
                     "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}, **extra},
            "headers": key_headers}


@contextmanager
def held(server, key_headers: dict[str, str], n_prompt: int = 8, **extra: Any) -> Iterator[Iterator[str]]:
    """A long /generate stream of the key's tenant, open (its first event read) until the block ends: closing
    the connection aborts it. Yields its remaining lines."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/generate", **gen(key_headers, n_prompt, LONG - n_prompt, stream=True, **extra)) as response:
            assert response.status_code == 200, response.read()
            lines = response.iter_lines()
            assert any(line.startswith("data:") for line in lines), "the stream ended before its first event"
            yield lines


def metric(server, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=ADMIN, timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^radixserve_{name}\{{{re.escape(want)}\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def assert_429(response: httpx.Response, limit_word: str) -> int:
    assert response.status_code == 429, response.text
    error = assert_openai_error(response)
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded", error
    assert limit_word in error["message"], error
    retry = int(response.headers["retry-after"])
    assert 1 <= retry <= 60, retry
    return retry


# -- keys -> tenants ---------------------------------------------------------------------------


def test_keys_resolve_to_tenants_through_both_headers(server):
    guard = Guard(server, ADMIN)
    before = {t: metric(server, "tenant_requests_total", tenant=t) for t in ("acme", "beta", "default")}
    with server.client() as http:
        for headers in (bearer("sk-acme"), {"x-api-key": "sk-acme-2"}, {"x-api-key": "sk-beta"},
                        bearer(SINGLE_KEY)):
            assert http.post("/generate", **gen(headers)).status_code == 200
        for headers in ({}, bearer("sk-nope"), {"x-api-key": "sk-acm"}, {"x-api-key": "wrong"},
                        {"Authorization": "Basic sk-acme"}):
            response = http.post("/generate", **gen(headers))
            assert response.status_code == 401, response.text
            assert assert_openai_error(response)["code"] == "invalid_api_key"
    after = {t: metric(server, "tenant_requests_total", tenant=t) for t in before}
    assert {t: after[t] - before[t] for t in before} == {"acme": 2, "beta": 1, "default": 1}
    assert metric(server, "tenant_prompt_tokens_total", tenant="beta") >= 8
    assert metric(server, "tenant_generation_tokens_total", tenant="beta") >= 2
    assert metric(server, "tenant_queue_time_seconds_count", tenant="beta") >= 1
    stats = guard.check()
    # The weights and caps reached the engine process (Engine.set_tenants) and stand in its fair share.
    assert stats["tenant_weights"]["acme"] == 3.0 and stats["tenant_weights"]["beta"] == 1.0
    assert stats["tenant_caps"] == {"solo": 1, "pair": 1}
    lines = [line for line in server.lines if '"POST /generate" 200' in line]
    assert any('tenant="acme"' in line for line in lines) and any('tenant="beta"' in line for line in lines)


def test_admin_endpoints_need_an_admin_key(server):
    with server.client() as http:
        for method, path in (("POST", "/flush_cache"), ("GET", "/get_server_info"), ("GET", "/server_info"),
                             ("GET", "/metrics")):
            response = http.request(method, path, headers=bearer("sk-beta"))
            assert response.status_code == 403, (path, response.text)
            error = assert_openai_error(response)
            assert error["type"] == "permission_error" and error["code"] == "admin_required", error
            for admin in (ADMIN, bearer(SINGLE_KEY)):  # a file's admin key, and the single --api-key
                assert http.request(method, path, headers=admin).status_code == 200, path
        assert http.get("/get_load", headers=bearer("sk-beta")).status_code == 200  # what a router balances on


def test_both_processes_freeze_their_startup_heap(server):
    """torch and the model stay out of full collections (scheduler/gc_freeze.py): each process froze >10k objects."""
    with server.client() as http:
        info = http.get("/get_server_info", headers=ADMIN).json()
    assert info["gc_frozen_objects"] > 10_000 and info["stats"]["gc_frozen_objects"] > 10_000, info
    assert info["gc_full_passes"] >= 0 and info["stats"]["gc_full_passes"] >= 0, info  # FullPasses in both


# -- limits --------------------------------------------------------------------------------------


def test_running_limit_is_429_with_retry_after_in_both_formats(server):
    guard = Guard(server, ADMIN)
    with held(server, bearer("sk-solo")), server.client() as http:
        assert assert_429(http.post("/generate", **gen(bearer("sk-solo"))), "queued or running") == 1
        messages = http.post("/v1/messages", headers={"x-api-key": "sk-solo"},
                             json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert messages.status_code == 429 and messages.headers["retry-after"] == "1", messages.text
        assert messages.json()["type"] == "error" and messages.json()["error"]["type"] == "rate_limit_error"
        assert http.post("/generate", **gen(bearer("sk-beta"))).status_code == 200  # the limit is solo's own
    guard.check()
    assert metric(server, "tenant_rate_limited_total", tenant="solo", limit="requests") >= 2
    with server.client() as http:  # its request ended: solo is admitted again
        assert http.post("/generate", **gen(bearer("sk-solo"))).status_code == 200


def test_engine_runs_a_tenants_cap_and_queues_the_rest(server):
    guard = Guard(server, ADMIN)
    with held(server, bearer("sk-pair")):
        with httpx.Client(base_url=server.url, timeout=60) as http2:
            with http2.stream("POST", "/generate", **gen(bearer("sk-pair"), max_new=LONG, first=40, stream=True)):
                deadline = time.monotonic() + 20
                while True:  # the server runs 8 at once; pair's cap keeps its second request waiting in the engine
                    stats = server.server_info(ADMIN)["stats"]
                    if stats["num_waiting"] == 1 or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                assert (stats["num_running"], stats["num_waiting"]) == (1, 1), stats
                with server.client() as http:
                    assert_429(http.post("/generate", **gen(bearer("sk-pair"))), "queued or running")
    guard.check()


def test_tokens_per_minute(server):
    guard = Guard(server, ADMIN)
    with server.client() as http:
        first = http.post("/generate", **gen(bearer("sk-tpm"), n_prompt=20, max_new=25))
        assert first.status_code == 200, first.text  # 45 tokens: the window is over its 40 now
        assert_429(http.post("/generate", **gen(bearer("sk-tpm"))), "tokens per minute")
        assert http.post("/generate", **gen(bearer("sk-beta"))).status_code == 200
    guard.check()
    assert metric(server, "tenant_rate_limited_total", tenant="tpm", limit="tokens_per_minute") == 1


def test_kv_share(server):
    guard = Guard(server, ADMIN)
    share = KEYS["sk-kv"]["limits"]["max_kv_share"] * KV_SLOTS
    with held(server, bearer("sk-kv"), n_prompt=300):
        assert metric(server, "tenant_kv_slots", tenant="kv") >= 300 > share
        with server.client() as http:
            assert_429(http.post("/generate", **gen(bearer("sk-kv"))), "KV slots")
    guard.check()
    assert metric(server, "tenant_kv_slots", tenant="kv") == 0
    with server.client() as http:  # it holds nothing now: admitted again
        assert http.post("/generate", **gen(bearer("sk-kv"))).status_code == 200


# -- ownership -----------------------------------------------------------------------------------


def test_stored_responses_are_their_tenants(server):
    with server.client() as http:
        made = http.post("/v1/responses", headers=bearer("sk-acme"),
                         json={"model": "tiny", "input": "hello", "max_output_tokens": 3, "store": True})
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
        path = f"/v1/responses/{rid}"
        for headers in (bearer("sk-beta"), bearer(SINGLE_KEY)):
            for method, url in (("GET", path), ("GET", path + "/input_items"), ("DELETE", path)):
                response = http.request(method, url, headers=headers)
                assert response.status_code == 404, (method, url, response.text)
                assert_openai_error(response)
            chained = http.post("/v1/responses", headers=headers, json={
                "model": "tiny", "input": "more", "max_output_tokens": 2, "previous_response_id": rid})
            assert chained.status_code == 404 and assert_openai_error(chained)["param"] == "previous_response_id"
        owner = bearer("sk-acme-2")  # the tenant's other key
        assert http.get(path, headers=owner).json()["id"] == rid
        assert http.get(path + "/input_items", headers=owner).status_code == 200
        assert http.post("/v1/responses", headers=owner, json={
            "model": "tiny", "input": "more", "max_output_tokens": 2, "previous_response_id": rid}).status_code == 200
        assert http.delete(path, headers=owner).json()["deleted"] is True


def test_sessions_are_their_tenants(server):
    with server.client() as http:
        def call(path: str, key: str, body: dict) -> Any:
            response = http.post(path, headers=bearer(key), json=body)
            assert response.status_code == 200, response.text
            return response.json()

        assert call("/open_session", "sk-acme", {"session_id": "agent-1"}) == "agent-1"
        assert call("/close_session", "sk-beta", {"session_id": "agent-1"})["closed"] is False
        assert call("/close_session", "sk-acme-2", {"session_id": "agent-1"})["closed"] is True
        sid = call("/open_session", "sk-beta", {})  # named by the server, still beta's
        assert isinstance(sid, str) and sid
        assert call("/close_session", "sk-acme", {"session_id": sid})["closed"] is False
        assert call("/close_session", "sk-beta", {"session_id": sid})["closed"] is True
        # A request naming a session opens it for its tenant only.
        assert http.post("/generate", **gen(bearer("sk-acme"), session_id="agent-2")).status_code == 200
        assert call("/close_session", "sk-beta", {"session_id": "agent-2"})["closed"] is False
        assert call("/close_session", "sk-acme", {"session_id": "agent-2"})["closed"] is True


def test_abort_touches_only_the_tenants_requests(server):
    guard = Guard(server, ADMIN)
    with held(server, bearer("sk-acme"), rid="acme-run") as stream, server.client() as http:
        for body in ({"rid": "acme-run"}, {"abort_all": True}):
            response = http.post("/abort_request", headers=bearer("sk-beta"), json=body)
            assert response.json() == {"aborted": 0}, response.text
        # Another request naming its id is refused, and neither takes the running one's place nor ends it.
        taken = http.post("/generate", **gen(bearer("sk-beta"), rid="acme-run"))
        assert taken.status_code == 400 and assert_openai_error(taken)["param"] == "rid", taken.text
        assert next(line for line in stream if line.startswith("data:"))  # still streaming
        assert http.post("/abort_request", headers=bearer("sk-acme-2"), json={"rid": "acme-run"}).json() == \
            {"aborted": 1}
        events = [json.loads(line[5:]) for line in stream if line.startswith("data:") and "{" in line]
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort", events[-1]
    with held(server, bearer("sk-beta")), server.client() as http:
        assert http.post("/abort_request", headers=ADMIN, json={"abort_all": True}).json()["aborted"] >= 1
    guard.check()


def test_keys_never_in_the_log(server):
    log = server.log()
    assert "tenant=" in log
    for key in [*KEYS, SINGLE_KEY]:
        assert key not in log


# -- the keys file ---------------------------------------------------------------------------------


BAD_FILES = [
    ("not-json.json", "{not json", "not valid JSON"),
    ("bad.toml", '["k"\ntenant = 1', "not valid TOML"),
    ("empty.json", "{}", "none are given"),
    ("field.json", json.dumps({"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "b", "wieght": 2}}),
     "entry 2: unknown field(s) wieght"),
    ("weight.json", json.dumps({"sk-a": {"tenant": "a", "weight": -1}}), "entry 1: tenant 'a': weight"),
    ("share.json", json.dumps({"sk-a": {"tenant": "a", "limits": {"max_kv_share": 2}}}), "max_kv_share"),
    ("limit.json", json.dumps({"sk-a": {"tenant": "a", "limits": {"max_running": 2}}}), "unknown limit(s)"),
    ("disagree.json", json.dumps({"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "a", "weight": 2}}),
     "entry 2 (tenant 'a') gives another weight"),
    ("noname.json", json.dumps({"sk-a": {"weight": 2}}), "entry 1: tenant must be"),
]


@pytest.mark.parametrize("name, text, words", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_keys_file_is_one_line_exit_2(tmp_path, capsys, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(words)):
        load_keys_file(str(path))
    assert cli_main(["serve", "--api-keys", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("radixserve: error: --api-keys") and "\n" not in err and words in err, err
    assert "sk-a" not in err and "sk-b" not in err  # a bad entry is named by its position, never by its key


def test_bad_keys_file_stops_the_process(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-secret": {"tenant": "a", "admin": "yes"}}))
    proc = subprocess.run([sys.executable, "-m", "radixserve.frontend.cli", "serve", "--api-keys", str(path),
                           "--device", "cpu"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "entry 1: tenant 'a': admin must be true or false" in lines[0] and "sk-secret" not in lines[0]


# -- replicas ----------------------------------------------------------------------------------------


def test_replicas_resolve_tenants_on_every_worker(tmp_path):
    """Every worker reads the same file; the router in front passes each client's Bearer key through."""
    pytest.importorskip("sglang_router")
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({key: KEYS[key] for key in ("sk-acme", "sk-beta", "sk-ops-admin")}))
    server = ServerProcess(["--model", tiny_model_path(), "--replicas", "2", "--api-keys", str(path), "--api-key",
                            SINGLE_KEY, "--served-model-name", "tiny", "--context-length", "512", "--kv-cache-tokens",
                            "2048"])
    try:
        with server.client() as http:
            for key in ("sk-acme", "sk-beta", SINGLE_KEY):
                chat = http.post("/v1/chat/completions", headers=bearer(key), json={
                    "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": f"hello {key}"}]})
                assert chat.status_code == 200, chat.text
            assert http.post("/generate", **gen(bearer("sk-nope"))).status_code == 401
        workers = re.findall(r"worker \d+ ready on (http://[\d.]+:\d+)", server.log())
        served: dict[str, float] = {}
        for url in workers:
            assert httpx.get(url + "/metrics", headers=bearer("sk-beta"), timeout=30).status_code == 403
            text = httpx.get(url + "/metrics", headers=ADMIN, timeout=30).text
            for tenant, n in re.findall(r'^radixserve_tenant_requests_total\{tenant="(\w+)"\} (\S+)$', text, re.M):
                served[tenant] = served.get(tenant, 0) + float(n)
        assert served == {"acme": 1, "beta": 1, "default": 1}
    finally:
        assert server.stop(timeout=60) == 0, server.log()[-3000:]
    assert not any(key in server.log() for key in ("sk-acme", "sk-beta", "sk-ops-admin", SINGLE_KEY))
