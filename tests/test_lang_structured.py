"""Structured gens in the DSL: gen(regex=), gen(json_schema=) (dict or string), typed gens (dtype=int | float |
bool | str, gen_int, gen_string), on the fake backend and on the real engine through both backends.

The real-engine programs use the tiny random-weight checkpoint of tests/test_lang_backends.py (its fixtures):
whatever the weights, every constrained output must match, and every grammar here is bounded, so every gen
must end with finish_reason "stop" within its max_tokens.
"""
from __future__ import annotations

import importlib.util
import json
import re

import pytest

from radixserve.lang import BackendError, function, gen, gen_int, gen_string, select
from radixserve.lang.fake import FakeBackend
from radixserve.lang.ir import TYPE_REGEXES, Gen, convert_typed

# Module-scoped fixtures of the backend tests (one tiny checkpoint, an in-process Runtime, a server).
from test_lang_backends import ckpt, endpoint, runtime  # noqa: F401

needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                    reason="structured generation needs xgrammar (the structured extra)")

CODE_RE = r"[A-Z]{2}-[0-9]{2,4}"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
POINT = {"type": "object",
         "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "ok": {"type": "boolean"}},
         "required": ["x", "ok"]}
# A JSON string may hold up to 8 characters of up to 6 tokens each (\uXXXX escapes, one byte a token).
JSON_TOKENS = 96
# Typed gens' bounds (ir.TYPE_REGEXES) in tokens, plus the stop token: int 19 chars, float 33, bool 5,
# str 64 characters of up to 4 bytes (the byte-level vocabulary splits a character) and 2 quotes.
TYPED_TOKENS = {"int": 20, "float": 34, "bool": 6, "str": 4 * 64 + 3}


@function
def structured(s, topic):
    s += f"Facts about {topic}.\nCode: " + gen("code", regex=CODE_RE, max_tokens=16)
    s += "\nPerson: " + gen("person", json_schema=PERSON, max_tokens=JSON_TOKENS)
    s += "\nPoint: " + gen("point", json_schema=json.dumps(POINT), max_tokens=JSON_TOKENS)
    s += "\nCount: " + gen_int("count", max_tokens=TYPED_TOKENS["int"])
    s += "\nRatio: " + gen("ratio", dtype=float, max_tokens=TYPED_TOKENS["float"])
    s += "\nTrue? " + gen("flag", dtype=bool, max_tokens=TYPED_TOKENS["bool"])
    s += "\nName: " + gen_string("name", max_tokens=TYPED_TOKENS["str"])
    s += "\nVerdict: " + select("verdict", ["good", "bad"])  # select is unchanged beside them


def check_state(state) -> None:
    assert re.fullmatch(CODE_RE, state["code"]), state["code"]
    person = json.loads(state["person"], strict=False)  # xgrammar's strings may hold raw control characters
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 8
    assert isinstance(person["age"], int) and not isinstance(person["age"], bool) and 0 <= person["age"] <= 120
    point = json.loads(state["point"], strict=False)
    assert set(point) == {"x", "ok"} and isinstance(point["ok"], bool)
    assert isinstance(point["x"], int) and not isinstance(point["x"], bool) and -9 <= point["x"] <= 9
    for name, dtype, kind in [("count", int, "int"), ("ratio", float, "float"), ("flag", bool, "bool"),
                              ("name", str, "str")]:
        text, value = state[name], state.get_typed(name)
        assert isinstance(text, str) and re.fullmatch(TYPE_REGEXES[kind], text), (name, text)
        assert type(value) is dtype, (name, value)
        expected = {"int": int, "float": float, "bool": lambda t: t == "True", "str": lambda t: t[1:-1]}[kind]
        assert value == expected(text), (name, text, value)
        assert state.get_meta_info(name)["dtype"] == kind
    for name in ("code", "person", "point", "count", "ratio", "flag", "name"):
        assert state.get_meta_info(name)["finish_reason"] == "stop", (name, state[name])
    assert state["verdict"] in ("good", "bad") and state.get_typed("verdict") == state["verdict"]


# --- the real engine, both backends ----------------------------------------------------------------


@needs_xgrammar
def test_greedy_and_seeded_structured_programs_match_on_both_backends(request):
    # The schema dict goes to the engine as a dict in-process and as a JSON string over HTTP; seeded
    # sampling gives the same tokens whatever the batch, so both backends must agree on every text.
    in_process, over_http = request.getfixturevalue("runtime"), request.getfixturevalue("endpoint")
    for kwargs in (dict(temperature=0.0), dict(temperature=1.0, seed=1)):
        local = structured.run(topic="radix trees", backend=in_process, **kwargs)
        remote = structured.run(topic="radix trees", backend=over_http, **kwargs)
        check_state(local)
        check_state(remote)
        assert local.text() == remote.text()
        assert [local.get_typed(n) for n in ("count", "ratio", "flag", "name")] == \
            [remote.get_typed(n) for n in ("count", "ratio", "flag", "name")]


@needs_xgrammar
@pytest.mark.parametrize("backend_name", ["runtime", "endpoint"])
def test_structured_programs_in_a_batch_and_across_seeds(backend_name, request):
    backend = request.getfixturevalue(backend_name)
    states = structured.run_batch([{"topic": f"topic {i}"} for i in range(3)], backend=backend,
                                  temperature=1.0, seed=7)
    states += [structured.run(topic="topic 0", backend=backend, temperature=1.0, seed=seed) for seed in (2, 3, 4)]
    for state in states:
        check_state(state)


@needs_xgrammar
def test_streamed_constrained_gen(request):
    @function
    def digits(s):
        s += "Digits: " + gen("d", regex=r"[0-9]{5,8}", max_tokens=12) + "\nN: " + gen_int("n", max_tokens=20)

    for backend in (request.getfixturevalue("runtime"), request.getfixturevalue("endpoint")):
        state = digits.run(backend=backend, temperature=1.0, seed=5, stream=True)
        assert "".join(state.text_iter()) == state.text()
        assert re.fullmatch(r"[0-9]{5,8}", state["d"]) and isinstance(state.get_typed("n"), int)


@needs_xgrammar
@pytest.mark.parametrize("backend_name, http", [("runtime", ""), ("endpoint", r".*HTTP 400")])
def test_invalid_constraints_are_backend_errors_naming_the_gen(backend_name, http, request):
    backend = request.getfixturevalue(backend_name)
    name = "Runtime" if backend_name == "runtime" else "Endpoint"

    @function
    def bad_regex(s):
        s += "x" + gen("bad", regex="(ab", max_tokens=4)

    @function
    def bad_schema(s):
        s += "x" + gen("shape", json_schema={"type": "foo"}, max_tokens=4)

    with pytest.raises(BackendError, match=rf"gen\('bad'\) on {name}{http}.*regex"):
        bad_regex.run(backend=backend)
    with pytest.raises(BackendError, match=rf"gen\('shape'\) on {name}{http}.*json_schema"):
        bad_schema.run(backend=backend)


# --- the DSL itself (no model) ---------------------------------------------------------------------


def test_gen_builds_the_constraint_params():
    assert gen("a", regex="[0-9]+").params["regex"] == "[0-9]+"
    assert gen("a", json_schema=PERSON).params["json_schema"] is PERSON
    assert gen("a", json_schema='{"type": "string"}').params["json_schema"] == '{"type": "string"}'
    for dtype, kind in [(int, "int"), ("float", "float"), (bool, "bool"), (str, "str")]:
        expr = gen("a", dtype=dtype)
        assert isinstance(expr, Gen) and expr.dtype == kind and expr.params["regex"] == TYPE_REGEXES[kind]
    assert gen_int("a", max_tokens=9).dtype == "int" and gen_int("a", max_tokens=9).params["max_new_tokens"] == 9
    assert gen_string("a").dtype == "str"
    assert "regex" not in gen("a").params and "json_schema" not in gen("a").params


@pytest.mark.parametrize("kwargs, message", [
    (dict(regex="a", json_schema=PERSON), r"gen\('x'\): regex and json_schema cannot be used together"),
    (dict(dtype=int, regex="a"), r"gen\('x'\): dtype and regex cannot be used together"),
    (dict(dtype=int, json_schema=PERSON), "dtype and json_schema"),
    (dict(choices=["a"], regex="a"), "choices and regex"),
    (dict(dtype=list), r"dtype must be one of int, float, bool, str"),
    (dict(dtype="double"), r"dtype must be one of int, float, bool, str"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(json_schema=[1]), "json_schema must be a dict or a non-empty JSON string"),
])
def test_gen_refuses_bad_constraints(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gen("x", **kwargs)


def test_type_regexes_are_bounded_and_convert():
    for kind, good, bad in [
        ("int", ["0", "-7", "42", "9" * 18], ["", "-", "007", "1.5", "9" * 19, "+3"]),
        ("float", ["0", "-0.5", "3.25", "12"], ["", ".5", "1.", "1e5", "01.2", "1." + "0" * 16]),
        ("bool", ["True", "False"], ["true", "1", "TrueFalse"]),
        ("str", ['""', '"hi there"', '"' + "é" * 64 + '"'],
         ['"a', 'a"', '"a\\"b"', '"a\nb"', '"' + "x" * 65 + '"']),
    ]:
        for text in good:
            assert re.fullmatch(TYPE_REGEXES[kind], text), (kind, text)
        for text in bad:
            assert not re.fullmatch(TYPE_REGEXES[kind], text), (kind, text)
            with pytest.raises(ValueError, match=f"not a complete {kind}"):
                convert_typed(kind, text)
    assert convert_typed("int", "-12") == -12 and convert_typed("float", "2.5") == 2.5
    assert convert_typed("bool", "False") is False and convert_typed("str", '"a b"') == "a b"


def test_typed_gens_on_the_fake_backend_and_fork_gathers_values():
    backend = FakeBackend()

    @function
    def prog(s):
        s += "Q: " + gen_int("n") + " " + gen("f", dtype=float) + " " + gen("b", dtype=bool)
        s += " " + gen_string("w")
        forks = s.fork(3)
        for i, branch in enumerate(forks):
            branch += f"\nbranch {i}: " + gen_int("k")
        forks.join()

    state = prog.run(backend=backend)
    for name, dtype in [("n", int), ("f", float), ("b", bool), ("w", str)]:
        assert isinstance(state[name], str) and type(state.get_typed(name)) is dtype
    assert state.get_typed("w") == state["w"][1:-1]
    assert [type(v) for v in state.get_typed("k")] == [int] * 3
    assert state.get_typed("k") == [int(t) for t in state["k"]]
    sent_regexes = [params.get("regex") for _, params in backend.sent]
    assert sent_regexes[:4] == [TYPE_REGEXES[k] for k in ("int", "float", "bool", "str")]
    state["n"] = "changed"  # set_var replaces the typed value too
    assert state.get_typed("n") == "changed"


def test_fake_backend_honours_or_refuses_other_constraints():
    @function
    def regex_prog(s):
        s += "code: " + gen("code", regex=CODE_RE)

    @function
    def json_prog(s):
        s += "obj: " + gen("obj", json_schema=PERSON)

    with pytest.raises(BackendError, match=r"gen\('code'\) on fake.*does not constrain.*regex"):
        regex_prog.run(backend=FakeBackend())
    with pytest.raises(BackendError, match=r"gen\('obj'\) on fake.*not JSON"):
        json_prog.run(backend=FakeBackend())
    @function
    def bad_regex(s):
        s += "x" + gen("bad", regex="(ab")

    scripted = FakeBackend(respond=lambda prompt, params: "AB-123" if "regex" in params else '{"name": "x", "age": 3}')
    assert regex_prog.run(backend=scripted)["code"] == "AB-123"
    assert json.loads(json_prog.run(backend=scripted)["obj"]) == {"name": "x", "age": 3}
    with pytest.raises(BackendError, match=r"gen\('bad'\) on fake.*invalid regex"):
        bad_regex.run(backend=scripted)


def test_a_cut_off_typed_gen_fails_naming_it():
    backend = FakeBackend(respond=lambda prompt, params: "3.25")

    @function
    def prog(s):
        s += "x = " + gen("x", dtype=float, max_tokens=2)

    with pytest.raises(ValueError, match=r"gen\('x'\) with dtype=float on fake: the output '3\.' is not a complete "
                                         r"float.*finish_reason 'length'"):
        prog.run(backend=backend)
