"""Sessions over HTTP (frontend/sessions_api.py): SGLang's /open_session, /close_session and session_params, and
session_id / x-session-id on the OpenAI APIs, with real clients against a real server."""
from __future__ import annotations

import time

import openai
import pytest

from _http_server import main_server


def _stats(server) -> dict:
    return server.server_info()["stats"]


@pytest.fixture(scope="module")
def server():
    return main_server()


def test_a_chat_session_keeps_its_history_pinned_until_it_closes(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    with server.client() as c:
        sid = c.post("/open_session", json={"capacity_of_str_len": 1000}).json()
        assert isinstance(sid, str) and sid
        before = _stats(server)
        history = [{"role": "user", "content": "tell me about the weather in a city " * 8}]
        first = client.chat.completions.create(model="tiny", messages=history, max_tokens=4,
                                               extra_body={"session_id": sid, "ignore_eos": True})
        stats = _stats(server)
        assert stats["num_pins"] == before["num_pins"] + 1 and stats["pinned_slots"] > first.usage.prompt_tokens - 2
        turn = history + [{"role": "assistant", "content": first.choices[0].message.content},
                          {"role": "user", "content": "and tomorrow?"}]
        second = client.chat.completions.create(model="tiny", messages=turn, max_tokens=4,
                                                extra_headers={"x-session-id": sid}, extra_body={"ignore_eos": True})
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8
        assert _stats(server)["num_pins_used"] >= before["num_pins_used"] + 1
        # Both turns ended with a final answer (no tool call): the server shortened their pins' time to live.
        deadline = time.monotonic() + 10
        while _stats(server)["num_pins_settled"] < before["num_pins_settled"] + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _stats(server)["num_pins_settled"] == before["num_pins_settled"] + 2
        closed = c.post("/close_session", json={"session_id": sid})
        assert closed.status_code == 200 and closed.json() == {"session_id": sid, "closed": True}
        assert c.post("/close_session", json={"session_id": sid}).json()["closed"] is False
        after = _stats(server)
        assert after["num_pins"] == before["num_pins"]


def test_generate_names_its_session_in_session_params(server):
    with server.client() as c:
        sid = c.post("/open_session", json={"session_id": "gen-session"}).json()
        assert sid == "gen-session"
        r = c.post("/generate", json={"input_ids": list(range(5, 70)), "session_params": {"id": sid},
                                      "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        assert r.status_code == 200
        assert _stats(server)["num_pins"] >= 1
        assert c.post("/close_session", json={"session_id": sid}).json()["closed"] is True


@pytest.mark.parametrize("path, body, headers, param", [
    ("/generate", {"text": "hi", "session_params": {"id": "s", "rid": "r1"}}, {}, "session_params.rid"),
    ("/generate", {"text": "hi", "session_params": "s"}, {}, "session_params"),
    ("/generate", {"text": "hi", "session_params": {"id": ""}}, {}, "session_params.id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "session_id": 5}, {}, "session_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "session_id": "a"},
     {"x-session-id": "b"}, "session_id"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, {"x-session-id": "x" * 300}, "x-session-id"),
    ("/close_session", {}, {}, "session_id"),
    ("/open_session", {"capacity_of_str_len": -1}, {}, "capacity_of_str_len"),
    ("/open_session", {"capacity_of_str_len": 1000, "streaming": True}, {}, "streaming"),  # SGLang's append mode
])
def test_bad_session_input_is_a_400_naming_the_parameter(server, path, body, headers, param):
    with server.client() as c:
        r = c.post(path, json=body, headers=headers)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert c.get("/health").status_code == 200


def test_a_dsl_program_over_http_runs_in_a_session(server):
    from radixserve.lang import Endpoint, function, gen

    @function
    def two_steps(s):
        s += "a question that is long enough to fill a few pages of cache " * 3
        s += gen("a", max_tokens=4, ignore_eos=True)
        s += gen("b", max_tokens=4, ignore_eos=True)

    before = _stats(server)
    backend = Endpoint(server.url)
    try:
        two_steps.run(backend=backend, temperature=0.0)
    finally:
        backend.shutdown()
    after = _stats(server)
    assert after["num_pins_used"] == before["num_pins_used"] + 1  # the second call took the first's pin
    assert after["num_sessions"] == before["num_sessions"] and after["num_pins"] == before["num_pins"]


def test_a_responses_turn_in_a_session_is_pinned_then_settled(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    before = _stats(server)
    first = client.responses.create(model="tiny", input="summarise the weather report for the coast " * 6,
                                    max_output_tokens=4, extra_body={"session_id": "resp-agent"})
    second = client.responses.create(model="tiny", input="and inland?", previous_response_id=first.id,
                                     max_output_tokens=4, extra_body={"session_id": "resp-agent"})
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 8
    deadline = time.monotonic() + 10
    while _stats(server)["num_pins_settled"] < before["num_pins_settled"] + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = _stats(server)
    assert after["num_pins_used"] == before["num_pins_used"] + 1
    assert after["num_pins_settled"] == before["num_pins_settled"] + 2
    with server.client() as c:
        assert c.post("/close_session", json={"session_id": "resp-agent"}).json()["closed"] is True


def test_a_previous_response_id_chain_is_a_session_of_its_own(server):
    """Without a session id, a stored response's chain is one: its first turn's id names it, each turn leaves a pin
    that the next turn (previous_response_id) takes. An unstored response with no predecessor opens none."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    before = _stats(server)
    client.responses.create(model="tiny", input="once", max_output_tokens=2, store=False)
    assert _stats(server)["num_pins_pinned"] == before["num_pins_pinned"]
    first = client.responses.create(model="tiny", input="the forecast for the harbour, in detail " * 6,
                                    max_output_tokens=4)
    assert _stats(server)["num_pins_pinned"] == before["num_pins_pinned"] + 1
    second = client.responses.create(model="tiny", input="and the hills?", previous_response_id=first.id,
                                     max_output_tokens=4)
    third = client.responses.create(model="tiny", input="and the valley?", previous_response_id=second.id,
                                    max_output_tokens=4)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 8
    after = _stats(server)
    assert after["num_pins_pinned"] == before["num_pins_pinned"] + 3
    assert after["num_pins_used"] == before["num_pins_used"] + 2  # turns 2 and 3 each took the one before's
    with server.client() as c:  # the chain's session is named after its first response
        assert c.post("/close_session", json={"session_id": first.id}).json()["closed"] is True
