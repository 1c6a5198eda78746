"""The DSL on the real engine: in-process (Runtime) and over HTTP (Endpoint, a server subprocess).

One tiny seeded checkpoint; greedy decoding, so both backends must produce the same text.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from _hidden_modules import check_hidden, hiding_env

from radixserve.lang import (BackendError, Endpoint, Runtime, assistant, function, gen, select, system, user)

# The same tiny checkpoint as the HTTP tests (tests/_http_server.TINY_MODEL), so CI builds it once.
CKPT_ARGS = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                 max_position_embeddings=1024, seed=3)
KV_TOKENS = 8192
CONTEXT = 1024


@pytest.fixture(scope="module")
def ckpt() -> str:
    from radixserve.bench.checkpoints import cached_checkpoint

    return cached_checkpoint("llama", **CKPT_ARGS)


@pytest.fixture(scope="module")
def runtime(ckpt):
    backend = Runtime(ckpt, num_threads=1, kv_cache_tokens=KV_TOKENS, context_length=CONTEXT)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def endpoint(ckpt, tmp_path_factory):
    port = _free_port()
    log_path = str(tmp_path_factory.mktemp("lang-server") / "server.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.frontend.cli", "serve", "--model", ckpt, "--host", "127.0.0.1",
             "--port", str(port), "--kv-cache-tokens", str(KV_TOKENS), "--context-length", str(CONTEXT)],
            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log_path)
        backend = Endpoint(url)
        yield backend
        backend.shutdown()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@function
def chat_program(s, question):
    s += system("You are a helpful assistant.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=12))
    with s.user():
        s += "Is that right? Answer yes or no."
    s += assistant(select("verdict", ["yes", "no"]))
    s += user("Give two more ideas.")
    with s.assistant():
        forks = s.fork(2)
        for i, branch in enumerate(forks):
            branch += f"Idea {i + 1}:" + gen("idea", max_tokens=8)
        forks.join()
        s += "Done."


@function
def plain_program(s, topic):
    s += f"Notes about {topic}:\n1."
    s += gen("first", max_tokens=10, stop="\n")
    s += "\n2." + gen("second", max_tokens=10, stop="\n")
    s += "\nRating: " + select("rating", ["good", "bad", "average"], method="normalized")


def test_same_programs_give_identical_greedy_text_on_both_backends(runtime, endpoint):
    for prog, kwargs in [(chat_program, {"question": "What is a radix tree?"}),
                         (plain_program, {"topic": "prefix caching"})]:
        local = prog.run(backend=runtime, temperature=0.0, **kwargs)
        remote = prog.run(backend=endpoint, temperature=0.0, **kwargs)
        assert local.text() == remote.text()
        assert local.requests and len(local.requests) == len(remote.requests)
        for a, b in zip(local.requests, remote.requests):
            assert (a.kind, a.prompt, a.output.output_ids) == (b.kind, b.prompt, b.output.output_ids)
            assert a.output.prompt_tokens == b.output.prompt_tokens
        for name in ("verdict", "rating"):
            if name in local._variables:
                la, lb = local.get_meta_info(name), remote.get_meta_info(name)
                assert la["sum_logprobs"] == pytest.approx(lb["sum_logprobs"], abs=1e-3)


def test_roles_match_transformers_apply_chat_template(runtime, ckpt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt)
    state = chat_program.run(question="Name a cache policy.", backend=runtime, temperature=0.0)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert state.text() == hf.apply_chat_template(messages, tokenize=False)
    # Each generation's prompt was the conversation so far plus the generation prompt.
    first_gen = next(r for r in state.requests if r.kind == "gen")
    assert first_gen.prompt == hf.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert runtime.encode(state.text()) == list(ids)


def test_select_picks_the_best_scored_choice_and_reuses_the_prefix(runtime):
    state = plain_program.run(topic="radix trees", backend=runtime, temperature=0.0)
    meta = state.get_meta_info("rating")
    best = max(range(3), key=lambda i: meta["normalized_logprobs"][i])
    assert state["rating"] == meta["choices"][best]
    scoring = [r for r in state.requests if r.kind == "select"]
    assert len(scoring) == 3
    last_gen = [r for r in state.requests if r.kind == "gen"][-1]
    # What the last gen left in the cache: its prompt and its outputs (all but the last token,
    # which was never fed back). Each choice prompt reuses as much of it as it shares.
    in_cache = runtime.encode(last_gen.prompt) + last_gen.output.output_ids[:-1]
    for record, num_choice_tokens in zip(scoring, meta["num_tokens"]):
        ids = runtime.encode(record.prompt)
        shared = _common_prefix_len(ids[:len(ids) - num_choice_tokens], in_cache)
        assert shared > len(runtime.encode(last_gen.prompt)) // 2
        assert record.output.cached_tokens >= shared


def test_fork_sends_the_prefix_once_and_branches_hit_it(runtime):
    state = chat_program.run(question="Why batch requests?", backend=runtime, temperature=0.0)
    kinds = [r.kind for r in state.requests]
    idx = kinds.index("prefix")
    prefix = state.requests[idx]
    assert prefix.output.completion_tokens == 0
    branches = state.requests[idx + 1:idx + 3]
    assert [r.kind for r in branches] == ["gen", "gen"]
    assert all(r.output.cached_tokens >= prefix.output.prompt_tokens - 1 for r in branches)


def test_streaming_yields_text_as_it_is_generated(runtime, endpoint):
    for backend in (runtime, endpoint):
        state = plain_program.run(topic="streams", backend=backend, temperature=0.0, stream=True)
        chunks = list(state.text_iter())
        assert "".join(chunks) == state.text()
        first = list(plain_program.run(topic="streams", backend=backend, temperature=0.0, stream=True)
                     .text_iter("first"))
        assert len(first) >= 2 and "".join(first) == state["first"]


def test_backend_errors_name_the_request_and_the_cause(runtime, endpoint):
    @function
    def too_long(s):
        s += "hello" + gen("out", max_tokens=CONTEXT + 10)

    with pytest.raises(BackendError, match=r"gen\('out'\) on Runtime.*context length"):
        too_long.run(backend=runtime)
    with pytest.raises(BackendError, match=r"gen\('out'\) on Endpoint.*HTTP 400.*context length"):
        too_long.run(backend=endpoint)


def test_react_example_hit_rate_is_near_optimal(runtime):
    from radixserve.lang.examples.react import run_agents

    # Short generations keep the longest prompt well inside the tiny model's 1024-token context.
    states, report = run_agents(runtime, num_agents=8, num_steps=6, thought_tokens=8, input_tokens=4)
    assert max(r.output.prompt_tokens for s in states for r in s.requests) < CONTEXT - 96
    assert all(len([r for r in s.requests if r.kind == "gen"]) == 13 for s in states)
    assert report.optimal_hit_rate > 0.5
    assert report.hit_rate <= report.optimal_hit_rate + 1e-9, report
    assert report.hit_rate >= 0.9 * report.optimal_hit_rate, report


def test_react_example_runs_over_http_without_httpx(endpoint, tmp_path):
    """The DSL's HTTP backend is the standard library's, so the README's examples run on the base install
    (httpx comes only with the test extra): the example with httpx hidden, against the server."""
    hidden = ("httpx",)
    env = hiding_env(hidden, tmp_path)
    check_hidden(env, hidden)
    proc = subprocess.run([sys.executable, "-m", "radixserve.lang.examples.react", "--url", endpoint.url,
                           "--agents", "3", "--steps", "2", "--thought-tokens", "4"],
                          env=dict(os.environ, **env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert [line.split(":")[0] for line in proc.stdout.splitlines()[:3]] == ["agent 0", "agent 1", "agent 2"]
    assert "hit rate:" in proc.stdout, proc.stdout


def test_run_batch_runs_programs_concurrently_in_one_engine_step(ckpt, capsys):
    backend = Runtime(ckpt, num_threads=1, kv_cache_tokens=KV_TOKENS, context_length=CONTEXT)
    try:
        assert backend.engine.stats()["max_batch_size"] == 0
        states = plain_program.run_batch([{"topic": f"topic {i}"} for i in range(32)], backend=backend,
                                         num_threads=32, progress_bar=True, temperature=0.0)
        assert [s["rating"] in ("good", "bad", "average") for s in states] == [True] * 32
        # Only gens of different programs can share a step here (no forks in plain_program, and a
        # select's prompts come from one program): a peak above 3 means programs batched together.
        assert backend.engine.stats()["max_batch_size"] > 3
    finally:
        backend.shutdown()
    assert "32/32" in capsys.readouterr().err


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log_path: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {open(log_path).read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server not healthy after {timeout_s}s: {open(log_path).read()[-2000:]}")
