"""SGLang's own frontend language (sglang==0.5.23, as a client only) against our /generate, unchanged.

`sglang/__init__.py` imports the whole server stack (torch, transformers patches, psutil, ...), but the frontend
(`sglang.lang`) needs only a few light packages (numpy, requests, tqdm, IPython, pydantic, aiohttp, msgspec,
pybase64; all in the `test` extra). So the wheel is installed with `pip install --no-deps sglang==0.5.23` and its
package is registered here without running its `__init__`: the submodules load from the installed directory.
"""
import importlib.util
import sys
import types

import pytest
import regex

from _http_server import main_server

SGLANG_VERSION = "0.5.23"


def _sglang_lang():
    """The frontend modules of the installed sglang, without sglang/__init__.py's server imports."""
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            pytest.fail(f"SGLang's frontend is not installed: pip install --no-deps sglang=={SGLANG_VERSION}")
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["sglang"] = package
    from sglang.lang import api
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
    from sglang.lang.ir import REGEX_INT

    return api, RuntimeEndpoint, REGEX_INT


api, RuntimeEndpoint, REGEX_INT = _sglang_lang()
function, gen, select = api.function, api.gen, api.select


@pytest.fixture(scope="module")
def backend():
    return RuntimeEndpoint(main_server().url)


def _well_formed(pattern: str, text: str, meta: dict) -> bool:
    """A constrained output fullmatches its pattern, or is a prefix of a match when the length limit cut it."""
    if meta["finish_reason"]["type"] == "length":
        return regex.fullmatch(pattern, text, partial=True) is not None
    return regex.fullmatch(pattern, text) is not None


@function
def qa_program(s, question):
    s += "Question: " + question + "\nAnswer:"
    s += gen("answer", max_tokens=8, temperature=0, stop="\n")
    s += "\nIs that right? " + select("verdict", choices=["yes", "no", "not sure"])
    s += "\nA number: " + gen("number", regex=r"[0-9]{1,4}", max_tokens=6, temperature=0)
    s += "\nA count: " + api.gen_int("count", max_tokens=6)


def test_gen_select_regex_and_typed_gen(backend):
    state = qa_program.run(question="what is the capital of France?", backend=backend)
    assert state.error() is None
    answer_meta = state.get_meta_info("answer")
    assert answer_meta["completion_tokens"] <= 8 and "\n" not in state["answer"]
    assert state["verdict"] in ("yes", "no", "not sure")
    assert _well_formed(r"[0-9]{1,4}", state["number"], state.get_meta_info("number")), state["number"]
    count = state["count"]  # dtype int: SGLang's REGEX_INT with stops " " and "\n"
    assert _well_formed(REGEX_INT, count, state.get_meta_info("count")), count
    assert state.get_meta_info("count")["completion_tokens"] <= 6
    text = state.text()
    assert text.startswith("Question: what is the capital of France?\nAnswer:" + state["answer"])
    assert text.endswith("\nA count: " + count)


@function
def fork_program(s):
    s += "Here are two ideas for a weekend trip, each in a few words.\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Idea {i + 1}:" + gen("idea", max_tokens=5, temperature=0.8, top_p=0.9)
    forks.join()
    s += "Idea 1:" + forks[0]["idea"] + "\nIdea 2:" + forks[1]["idea"] + "\nBest: " + select(
        "best", choices=["Idea 1", "Idea 2"])


def test_fork_join_and_select(backend):
    state = fork_program.run(backend=backend)
    assert state["best"] in ("Idea 1", "Idea 2")
    ideas = [state.text().split("Idea 1:")[1].split("\nIdea 2:")[0]]
    assert all(len(i) > 0 for i in ideas)
    assert "\nBest: " + state["best"] in state.text()


STOP_REGEX = r"[aeo]"  # frequent in the random model's text, so that some requests stop on it


@function
def stop_program(s, topic):
    s += "Write about " + topic + ":"
    s += gen("words", max_tokens=12, stop_regex=STOP_REGEX, ignore_eos=True, temperature=0)


def test_run_batch_and_stop_regex(backend):
    states = stop_program.run_batch([{"topic": "rivers"}, {"topic": "mountains"}, {"topic": "cities"}],
                                    backend=backend, num_threads=2)
    assert len(states) == 3
    reasons = []
    for state in states:
        meta = state.get_meta_info("words")
        assert meta["completion_tokens"] <= 12
        assert not regex.search(STOP_REGEX, state["words"])  # trimmed at the match
        reasons.append(meta["finish_reason"])
    assert {"type": "stop", "matched": STOP_REGEX} in reasons


def test_streaming_gen(backend):
    state = stop_program.run(topic="the sea", backend=backend, stream=True)
    pieces = list(state.text_iter("words"))
    assert "".join(pieces) == state["words"]
