"""Stored responses: the SQLite store's bounds (count, age) and sharing (WAL file), a 10-turn previous_response_id
chain that hits the radix cache for the whole history, and a chain that survives a server restart (issue 12)."""
from __future__ import annotations

import multiprocessing

import httpx
import pytest

from _http_server import EMOJI_SCRIPT, ServerProcess, scripted_server, tiny_model_path
from radixserve.frontend.response_store import ResponseStore, StoredResponse

INSTRUCTIONS = "You are a terse assistant. Answer in a few words."


def _row(i: int, at: float) -> StoredResponse:
    return StoredResponse(id=f"resp_{i}", created_at=at, response={"id": f"resp_{i}"}, input_items=[],
                          conversation=[{"role": "user", "content": str(i)}], context_key="k",
                          prompt_ids=[1, 2, i], output_ids=[i, 2**31 - 1])


def test_store_evicts_the_oldest_beyond_the_count_and_the_expired():
    now = [1000.0]
    store = ResponseStore(None, max_items=3, ttl_s=60.0, clock=lambda: now[0])
    for i in range(5):
        store.put(_row(i, now[0] + i))
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.get("resp_4").prompt_ids == [1, 2, 4] and store.get("resp_4").output_ids == [4, 2**31 - 1]
    now[0] += 62.5  # resp_2 (stored at 1002) is now older than 60 s; resp_3 and resp_4 are not
    assert store.get("resp_2") is None and store.get("resp_3") is not None and len(store) == 2
    assert not store.delete("resp_2") and store.delete("resp_3") and store.get("resp_3") is None


def test_a_store_file_is_shared_between_processes_views(tmp_path):
    path = str(tmp_path / "responses.sqlite")
    a, b = (ResponseStore(path, max_items=10, ttl_s=3600.0) for _ in range(2))
    a.put(_row(1, __import__("time").time()))
    assert b.get("resp_1").conversation == [{"role": "user", "content": "1"}]
    assert b.delete("resp_1") and a.get("resp_1") is None


def _open_at_once(path: str, barrier, errors) -> None:
    barrier.wait()
    try:
        ResponseStore(path, max_items=10, ttl_s=3600.0).close()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        errors.put(repr(e))


def test_processes_opening_a_new_store_file_at_once_all_succeed(tmp_path):
    """The replicas' workers open one file together; switching it to WAL must not fail any of them with
    "database is locked" (a clean-clone CI run lost a worker to it)."""
    ctx = multiprocessing.get_context("fork")
    for attempt in range(5):
        path, barrier, errors = str(tmp_path / f"r{attempt}.sqlite"), ctx.Barrier(6), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(path, barrier, errors)) for _ in range(6)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        assert all(p.exitcode == 0 for p in procs)
        assert errors.empty(), errors.get()


def _turn(url: str, i: int, previous: str | None, model: str = "tiny", text: str = "tell me more") -> dict:
    body = {"model": model, "instructions": INSTRUCTIONS, "input": f"Turn {i}: {text}.",
            "max_output_tokens": 32, "temperature": 0, "previous_response_id": previous}
    r = httpx.post(url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _assert_history_cached(prev: dict, cur: dict) -> None:
    history = prev["usage"]["input_tokens"] + prev["usage"]["output_tokens"]
    cached = cur["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= 0.95 * history, (cached, history)
    assert cur["usage"]["input_tokens"] > history  # the new turn comes after the whole history


def test_ten_turn_chain_hits_the_cache_for_the_whole_history():
    """The scripted model answers every turn (its trigger stays in the history) with one token per UTF-8 byte,
    which the tokenizer would merge when re-rendering the conversation: only the previous turn's exact token
    ids keep the whole history in the cache."""
    url = scripted_server().url
    prev = _turn(url, 0, None, "scripted", "an emoji please")
    for i in range(1, 10):
        cur = _turn(url, i, prev["id"], "scripted")
        assert cur["output"][0]["content"][0]["text"] == EMOJI_SCRIPT
        _assert_history_cached(prev, cur)
        prev = cur
    # Changed instructions are not carried over: the conversation is re-rendered, and still continues.
    body = {"model": "scripted", "instructions": "Different.", "input": "again", "max_output_tokens": 4,
            "previous_response_id": prev["id"]}
    r = httpx.post(url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    # Re-rendered, the byte tokens merge: the prompt is shorter than the token history it replaces.
    assert 0 < r.json()["usage"]["input_tokens"] < prev["usage"]["input_tokens"] + prev["usage"]["output_tokens"]


def test_chain_continues_after_a_restart_and_count_eviction(tmp_path):
    args = ["--model", tiny_model_path(), "--context-length", "512", "--kv-cache-tokens", "4096",
            "--served-model-name", "tiny", "--response-store", str(tmp_path / "store.sqlite"),
            "--response-store-max-items", "3"]
    server = ServerProcess(args)
    try:
        turns = [_turn(server.url, 0, None)]
        turns.append(_turn(server.url, 1, turns[-1]["id"]))
    finally:
        assert server.stop() == 0
    server = ServerProcess(args)
    try:
        turns.append(_turn(server.url, 2, turns[-1]["id"]))  # a cold cache: exempt from the 95%
        turns.append(_turn(server.url, 3, turns[-1]["id"]))
        _assert_history_cached(turns[-2], turns[-1])
        assert httpx.get(f"{server.url}/v1/responses/{turns[1]['id']}").status_code == 200
        assert httpx.get(f"{server.url}/v1/responses/{turns[0]['id']}").status_code == 404  # the 4th evicted the 1st
    finally:
        server.stop()


@pytest.mark.parametrize("flag, value", [("--response-store-max-items", "0"), ("--response-store-ttl", "0")])
def test_bad_store_bounds_fail_fast(flag, value):
    from radixserve.frontend.cli import main

    assert main(["serve", flag, value]) == 2
