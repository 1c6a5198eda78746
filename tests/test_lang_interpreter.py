"""The DSL interpreter against the in-memory fake backend (no model needed)."""
from __future__ import annotations

import logging
import threading

import pytest

from radixserve.lang import BackendError, assistant, function, gen, select, set_default_backend, system, user
from radixserve.lang.fake import FakeBackend, chatml, default_respond
from radixserve.lang.roles import ChatTemplate


@function
def qa(s, question):
    s += system("Be brief.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=24, stop="\n"))


def test_roles_render_like_the_template_after_every_turn():
    backend = FakeBackend()

    @function
    def chat(s):
        s += system("sys")
        s += user("hello")
        s += assistant(gen("a", max_tokens=10))
        with s.user():
            s += "second "
            s += "question"
        s += assistant("fixed reply")

    state = chat.run(backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[3]["content"] == "second question"
    assert state.text() == chatml(messages, False)
    # While the assistant turn was open, the prompt was the generation-prompt rendering.
    gen_prompt = backend.sent[0][0]
    assert gen_prompt == chatml(messages[:2], True)


def test_gen_sets_variable_applies_stop_and_defaults():
    backend = FakeBackend()
    state = qa.run(question="why?", backend=backend, temperature=0.0, top_k=5)
    prompt, params = backend.sent[0]
    expected = default_respond(prompt, params)[:24].split("\n")[0]
    assert state["answer"] == expected
    assert state.get_meta_info("answer")["finish_reason"] in ("stop", "length")
    assert params["temperature"] == 0.0 and params["top_k"] == 5  # run() defaults
    assert params["max_new_tokens"] == 24 and params["stop"] == ["\n"]  # gen's own values win


def test_select_sum_and_normalized_pick_their_argmax():
    # Every character costs -1, except "x" which costs -0.3: "xxxxx" (5 tokens) has the best
    # mean, "b" (1 token) the best sum.
    def score(context: str, char: str) -> float:
        return -0.3 if char == "x" else -1.0

    backend = FakeBackend(score=score)

    @function
    def pick(s, method):
        s += "Choose:"
        s += select("c", ["xxxxx", "b", "cc"], method=method)

    assert pick.run(method="sum", backend=backend)["c"] == "b"
    state = pick.run(method="normalized", backend=backend)
    assert state["c"] == "xxxxx"
    meta = state.get_meta_info("c")
    assert meta["num_tokens"] == [5, 1, 2]
    assert meta["sum_logprobs"] == pytest.approx([-1.5, -1.0, -2.0])
    assert state.text() == "Choose:xxxxx"
    # One request per choice, each scoring from the choice's first token (prefix cached).
    sent = backend.sent[-3:]
    assert [p for p, _ in sent] == ["Choose:xxxxx", "Choose:b", "Choose:cc"]
    assert all(sp["logprob_start_len"] == len("Choose:") and sp["max_new_tokens"] == 0 for _, sp in sent)


def test_fork_sends_prefix_once_then_branches_run_concurrently():
    backend = FakeBackend(latency_s=0.05)

    @function
    def tree(s):
        s += "Problem: 2+2.\n"
        branches = s.fork(3)
        for i, branch in enumerate(branches):
            branch += f"Idea {i}:" + gen("idea", max_tokens=8)
        branches.join()
        s += "Best idea."

    state = tree.run(backend=backend)
    kinds = [r.kind for r in state.requests]
    assert kinds == ["prefix", "gen", "gen", "gen"]
    prefix_prompt, prefix_params = backend.sent[0]
    assert prefix_prompt == "Problem: 2+2.\n" and prefix_params == {"max_new_tokens": 0}
    # Each branch's prompt extends the prefix, so it hits what the prefix request cached.
    assert all(r.output.cached_tokens >= len(prefix_prompt) for r in state.requests[1:])
    assert backend.max_in_flight == 3
    assert len(state["idea"]) == 3
    assert state.text() == "Problem: 2+2.\nBest idea."


def test_join_concate_and_append():
    backend = FakeBackend()

    @function
    def concat(s):
        s += "P:"
        forks = s.fork(2)
        forks += gen("g", max_tokens=5)
        forks.join(mode="concate_and_append")

    state = concat.run(backend=backend)
    outs = [r.output.text for r in state.requests if r.kind == "gen"]
    assert state.text() == "P:" + "".join(outs)


def test_streaming_text_iter_yields_the_program_text():
    backend = FakeBackend(latency_s=0.01)
    state = qa.run(question="stream me", backend=backend, stream=True)
    chunks = list(state.text_iter())
    assert len(chunks) > 3
    assert "".join(chunks) == state.text()
    state2 = qa.run(question="stream me", backend=backend, stream=True)
    assert "".join(state2.text_iter("answer")) == state2["answer"]


def test_backend_errors_name_the_expression_and_cause():
    def respond(prompt, params):
        raise ValueError("prompt has 9 tokens and max_new_tokens is 99: exceeds the context length 64")

    with pytest.raises(BackendError, match=r"gen\('answer'\).*context length 64"):
        qa.run(question="q", backend=FakeBackend(respond=respond))
    state = qa.run(question="q", backend=FakeBackend(respond=respond), stream=True)
    with pytest.raises(BackendError, match="context length"):
        list(state.text_iter())


def test_program_exceptions_and_role_misuse_surface():
    backend = FakeBackend()

    @function
    def nested(s):
        with s.user():
            s += user("inner")

    with pytest.raises(ValueError, match="inside an open user turn"):
        nested.run(backend=backend)

    @function
    def boom(s):
        s += "x"
        raise KeyError("from the program")

    with pytest.raises(KeyError, match="from the program"):
        boom.run(backend=backend)


def test_no_template_and_no_backend_errors():
    @function
    def prog(s):
        s += user("hi")

    set_default_backend(None)
    with pytest.raises(ValueError, match="no backend"):
        prog.run()
    no_template = FakeBackend()
    no_template._template = None
    with pytest.raises(ValueError, match="needs a chat template"):
        prog.run(backend=no_template)


def test_template_that_rewrites_turns_is_rerendered_and_logged_once(caplog):
    def trimming(messages, add_generation_prompt):
        return chatml([{**m, "content": m["content"].strip()} for m in messages], add_generation_prompt)

    backend = FakeBackend(template=ChatTemplate(trimming, "trimming"))

    @function
    def chat(s):
        s += user("  padded  ")
        s += assistant(" also padded ")
        s += user("next")

    with caplog.at_level(logging.WARNING, logger="radixserve.lang.roles"):
        state = chat.run(backend=backend)
        chat.run(backend=backend)
    assert state.text() == trimming(state.messages(), False)
    assert len([r for r in caplog.records if "re-rendering" in r.message]) == 1


def test_run_batch_keeps_order_runs_concurrently_and_shows_progress(capsys):
    backend = FakeBackend(latency_s=0.02)
    set_default_backend(backend)
    try:
        states = qa.run_batch([{"question": f"q{i}"} for i in range(32)], num_threads=8, progress_bar=True,
                              temperature=0.0)
    finally:
        set_default_backend(None)
    assert [s.messages()[1]["content"] for s in states] == [f"q{i}" for i in range(32)]
    assert backend.max_in_flight > 1
    assert "32/32" in capsys.readouterr().err


def test_state_is_usable_from_the_program_while_work_is_queued():
    backend = FakeBackend(latency_s=0.01)
    seen = []

    @function
    def loop(s):
        s += "Count:"
        for i in range(3):
            s += gen(f"g{i}", max_tokens=4)
            seen.append((threading.current_thread().name, s[f"g{i}"]))

    state = loop.run(backend=backend)
    assert [v for _, v in seen] == [state[f"g{i}"] for i in range(3)]
    assert state.text() == "Count:" + "".join(v for _, v in seen)
