"""Grammars compile off the engine loop (scheduler/grammar_prep.py): a request with a new grammar waits on a
worker thread while the running requests keep stepping; a bad grammar is still a 400; an abort while it
waits is applied at admission."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("xgrammar")

from _http_battery import Guard  # noqa: E402
from _http_server import ServerProcess, tiny_model_path  # noqa: E402
from radixserve.scheduler.errors import RequestError  # noqa: E402
from radixserve.scheduler.grammar_prep import PendingGrammars  # noqa: E402


class _FakeGrammar:
    def __init__(self) -> None:
        self.cached: set[str] = set()
        self.release = threading.Event()

    def is_cached(self, params) -> bool:
        return params.regex in self.cached

    def prepare(self, params) -> None:
        self.release.wait(10)
        if params.regex == "bad":
            raise RequestError("invalid regex", "regex")
        self.cached.add(params.regex)


def _add(rid: str, regex: str | None, n: int = 1):
    return SimpleNamespace(rid=rid, params=SimpleNamespace(regex=regex, has_grammar=regex is not None), n=n)


def test_pending_grammars_hold_until_prepared():
    grammar = _FakeGrammar()
    pending = PendingGrammars(grammar)
    assert not pending.hold(_add("plain", None))  # no grammar: admitted at once
    assert pending.hold(_add("a", "[ab]+")) and pending.hold(_add("b", "bad")) and pending.hold(_add("c", "x"))
    assert pending.hold(_add("d", "z", n=3))  # three choices, one message: an abort names a choice
    assert pending.abort("c") and not pending.abort("plain") and not pending.abort("d") and pending.abort("d-1")
    assert len(pending) == 4 and pending.ready() == []
    grammar.release.set()
    deadline = time.monotonic() + 10
    done = []
    while len(done) < 4 and time.monotonic() < deadline:
        done += pending.ready()
        time.sleep(0.01)
    by_rid = {m.rid: (error, aborted) for m, error, aborted in done}
    assert by_rid["a"] == (None, []) and by_rid["c"] == (None, ["c"]) and by_rid["d"] == (None, ["d-1"])
    assert isinstance(by_rid["b"][0], RequestError) and len(pending) == 0 and not pending.abort("d-1")
    assert not pending.hold(_add("again", "[ab]+"))  # now cached
    assert pending.hold(_add("late", "y")) and [m.rid for m in pending.drain()] == ["late"]


@pytest.fixture(scope="module")
def slow_server():
    """Every grammar preparation sleeps 3 s first (RADIXSERVE_TEST_FAULT=slow-grammar)."""
    server = ServerProcess(["--model", tiny_model_path(), "--context-length", "1024", "--kv-cache-tokens", "8192"],
                           env={"RADIXSERVE_TEST_FAULT": "slow-grammar"})
    yield server
    server.stop()


def _schema(tag: str) -> dict:
    return {"type": "object", "properties": {tag: {"enum": ["a", "b"]}}, "required": [tag]}


def test_running_streams_keep_going_while_a_grammar_compiles(slow_server):
    guard = Guard(slow_server)
    stamps: list[float] = []
    body = {"prompt": "hello", "max_tokens": 900, "ignore_eos": True, "stream": True, "temperature": 0}
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", slow_server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.monotonic())
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    submitted = time.monotonic()
    r = httpx.post(slow_server.url + "/v1/completions", timeout=120, json={
        "prompt": "x", "max_tokens": 20, "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": _schema("first")}}})
    answered = time.monotonic()
    reader.join(120)
    assert r.status_code == 200, r.text
    assert answered - submitted >= 3.0, "the grammar's 3 s preparation was not waited for"
    during = [t for t in stamps if submitted < t < submitted + 2.5]
    assert len(during) >= 20, f"only {len(during)} stream chunks arrived while the grammar compiled"
    bad = httpx.post(slow_server.url + "/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "nonsense"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    guard.check()


def test_a_client_gone_while_its_grammar_compiles_is_aborted(slow_server):
    guard = Guard(slow_server)
    body = {"prompt": "x", "max_tokens": 800, "ignore_eos": True, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "items": {"type": "integer"}}}}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/v1/completions", json=body, timeout=1.0)
    held = slow_server.server_info()["stats"]  # ~2 s of its 3 s compile are left: still held
    assert held["num_grammar_pending"] == 1 and held["num_waiting"] >= 1, held
    # The server saw the client leave while the grammar compiled and sent the abort then; the compile (3 s)
    # finishes, and the request is admitted and aborted before any step. A held request is in no engine queue
    # yet, so wait for its abort to show rather than for idle (a loaded machine compiles slower).
    deadline = time.monotonic() + 60
    while slow_server.server_info()["stats"]["num_requests_aborted"] == guard.stats_before["num_requests_aborted"]:
        assert time.monotonic() < deadline, "the held request was never aborted"
        time.sleep(0.1)
    stats = guard.check()
    assert stats["num_requests_aborted"] == guard.stats_before["num_requests_aborted"] + 1
    assert stats["num_generated_tokens"] == guard.stats_before["num_generated_tokens"]  # not one of its 800
