"""Structured generation (issue 11): regex / json_schema / ebnf through xgrammar, in-process and over HTTP.

Every grammar here is bounded (its outputs are short), so each request must end with finish_reason "stop";
outputs are checked with re.fullmatch or with the small JSON-schema validator below (xgrammar's JSON strings
may hold raw control characters, so JSON is parsed with strict=False).
"""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")

from _http_server import main_server, tiny_model_path  # noqa: E402
from radixserve.scheduler import Engine, SamplingParams  # noqa: E402
from radixserve.scheduler.errors import RequestError  # noqa: E402

REGEXES = [
    r"[a-z]{3,8}@(foo|bar)\.com",
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}",
    r"0x[0-9a-f]{2,6}",
    r"(\d{1,3}\.){3}\d{1,3}",
    r"[01]{4,10}",
    r"(ab|cd){1,6}e",
    r"\(\d{1,2}, \d{1,2}\)",
    r"(red|green|blue)-[0-9]",
    r"[àéîõü]{1,5}",
    r"(世界|你好|🚀){1,3}",
    r"-?[1-9][0-9]{0,3}",
    r"[a-z]{1,8}(_[a-z]{1,8}){0,2}",
    r"(true|false|null)",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
]

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["ok", "note"]},
    {"type": "number", "minimum": -10, "maximum": 10},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -99, "maximum": 99},
        "y": {"type": "integer", "minimum": -99, "maximum": 99}}, "required": ["x", "y"]}},
     "required": ["point"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                               "minItems": 2, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"a": {"type": "string", "enum": ["x", "y"]}, "b": {"type": "boolean"}},
     "required": ["a"]},  # optional field b
    {"type": "string", "maxLength": 8},  # unicode strings (the byte-level vocabulary emits any code point)
    {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 5},
                                      "temp": {"type": "number", "minimum": -50, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}},
     "required": ["city", "unit"]},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                       "maximum": 9}},
                                "required": ["id"]}, "minItems": 0, "maxItems": 2},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "object", "properties": {"kind": {"const": "event"}, "level": {"enum": [1, 2, 3]}},
     "required": ["kind", "level"]},
    {"type": "boolean"},
    {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 1}, "minItems": 1, "maxItems": 2}, "minItems": 1,
        "maxItems": 2}}, "required": ["m"]},
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 5}}},  # all optional
]

EBNF = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [a-c] | "z"'
EBNF_RE = r"\([a-cz](,[a-cz]){0,2}\)"
PROMPT = "The answer is"
MAX_NEW = 96  # above every grammar's longest output in tokens (a token holds at least one byte)


def validate(value, schema, where="$"):
    """A validator for the JSON-schema subset of SCHEMAS (xgrammar is strict: no extra properties)."""
    if "const" in schema:
        assert value == schema["const"], where
    if "enum" in schema:
        assert value in schema["enum"], where
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind in types:
        assert isinstance(value, types[kind]), (where, value)
    elif kind in ("integer", "number"):
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (where, value)
        if kind == "integer":
            assert isinstance(value, int), (where, value)
        assert schema.get("minimum", -float("inf")) <= value <= schema.get("maximum", float("inf")), where
    if kind == "string":
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 10**9), (where, value)
    if kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9), (where, value)
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{where}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        assert set(value) <= set(props), (where, value)
        assert set(schema.get("required", [])) <= set(value), (where, value)
        for key, item in value.items():
            validate(item, props[key], f"{where}.{key}")


def check_output(text: str, kind: str, spec) -> None:
    if kind == "regex":
        assert re.fullmatch(spec, text), (spec, text)
    elif kind == "ebnf":
        assert re.fullmatch(EBNF_RE, text), text
    else:
        validate(json.loads(text), spec)  # strict: no raw control characters inside strings


CASES = [("regex", r) for r in REGEXES] + [("json_schema", s) for s in SCHEMAS] + [("ebnf", EBNF)]


def case_params(kind, spec, sampled: bool, seed: int, **extra) -> dict:
    params = {kind: spec, "max_new_tokens": MAX_NEW, **extra}
    if sampled:
        params.update(temperature=1.0, top_p=0.95, top_k=50, seed=seed)
    else:
        params.update(temperature=0.0)
    return params


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model_path(), num_threads=1, kv_cache_tokens=16384)


def test_case_count():
    assert len(REGEXES) + len(SCHEMAS) >= 30


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_outputs_match_their_grammar(engine, sampled):
    """One batch: every case, the sampled ones with three seeds each (different outputs, all valid)."""
    seeds = [11, 12, 13] if sampled else [0]
    jobs = [(kind, spec, case_params(kind, spec, sampled, seed)) for kind, spec in CASES for seed in seeds]
    results = engine.generate([PROMPT] * len(jobs), [p for _, _, p in jobs])
    for (kind, spec, _), r in zip(jobs, results):
        assert r.finish_reason == "stop", (spec, r.text, r.finish_reason)
        check_output(r.text, kind, spec)
    if sampled:
        assert len({r.text for r in results}) > len(CASES)  # the seeds really sample
    engine.check_integrity()


def test_streamed_deltas_match(engine):
    """Step by step (the streaming path): the concatenated deltas are the final text and match."""
    rids = {engine.add_request(PROMPT, case_params(kind, spec, True, 7)): (kind, spec) for kind, spec in CASES}
    texts = dict.fromkeys(rids, "")
    results = {}
    while engine.has_unfinished():
        for d in engine.step():
            texts[d.rid] += d.text
            if d.finished:
                results[d.rid] = d.result
    for rid, (kind, spec) in rids.items():
        assert results[rid].finish_reason == "stop"
        assert texts[rid] == results[rid].text
        check_output(texts[rid], kind, spec)
    engine.check_integrity()


def test_repeated_schema_is_compiled_once(engine):
    schema = {"type": "object", "properties": {"q": {"type": "integer", "minimum": 0, "maximum": 3}},
              "required": ["q"]}
    before = engine.grammar.num_compiled
    engine.generate([PROMPT] * 3, [dict(json_schema=schema, max_new_tokens=20, temperature=0.0),
                                   dict(json_schema=json.loads(json.dumps(schema)), max_new_tokens=20),
                                   dict(json_schema=json.dumps(schema, separators=(",", ":")),
                                        max_new_tokens=20, temperature=0.0)])
    assert engine.grammar.num_compiled - before == 1


def test_property_order_follows_the_schema(engine):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"]}
    r, = engine.generate([PROMPT], dict(json_schema=schema, max_new_tokens=40, temperature=0.0))
    assert list(json.loads(r.text)) == ["zeta", "alpha"]


def test_ignore_eos_and_min_new_tokens_end_with_the_grammar(engine):
    """A complete grammar ends the request even when EOS is ignored or min_new_tokens is unmet."""
    for extra in (dict(ignore_eos=True), dict(min_new_tokens=50)):
        for sampled in (False, True):
            params = case_params("regex", r"(yes|no)", sampled, 3, **extra)
            r, = engine.generate([PROMPT], params)
            assert r.finish_reason == "stop"
            assert re.fullmatch(r"(yes|no)", r.text), r.text
            if extra.get("ignore_eos"):
                assert r.matched_stop is None
            assert r.completion_tokens <= 4


def test_length_limit_still_applies(engine):
    r, = engine.generate([PROMPT], dict(regex=r"[a-z]{20,30}", max_new_tokens=3, temperature=0.0))
    assert r.finish_reason == "length" and r.completion_tokens == 3


def test_mixed_batch_with_unconstrained_requests(engine):
    free = dict(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    alone, = engine.generate([PROMPT], free)
    results = engine.generate([PROMPT] * 3, [free, dict(regex=r"\d{3}", max_new_tokens=8, temperature=0.0), free])
    assert results[0].output_ids == alone.output_ids == results[2].output_ids
    assert re.fullmatch(r"\d{3}", results[1].text)


# -- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, spec", [
    ("regex", "(ab"), ("regex", "[z-a]"), ("json_schema", "{not json"), ("json_schema", {"type": "foo"}),
    ("ebnf", "root ::= "), ("ebnf", "root ::= undefined_rule"),
])
def test_invalid_grammar_is_a_request_error(engine, kind, spec):
    with pytest.raises(RequestError) as info:
        engine.add_request(PROMPT, {kind: spec})
    assert info.value.param == kind
    assert kind in str(info.value)
    with pytest.raises(RequestError):  # generate checks every prompt before queueing any
        engine.generate([PROMPT, PROMPT], [dict(max_new_tokens=2), {kind: spec}])
    assert not engine.has_unfinished()


def test_sampling_params_checks():
    with pytest.raises(ValueError, match="regex and json_schema"):
        SamplingParams(regex="a", json_schema={"type": "string"})
    with pytest.raises(ValueError, match="regex"):
        SamplingParams(regex=3)
    with pytest.raises(ValueError, match="ebnf"):
        SamplingParams(ebnf="")
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema=[1])
    assert SamplingParams(json_schema='{"type": "string"}').has_grammar
    assert not SamplingParams().has_grammar


# -- retraction and chunked prefill --------------------------------------------------------------------


def _run_steps(engine: Engine, prompts, params) -> dict:
    rids = [engine.add_request(p, params) for p in prompts]
    results = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                results[d.rid] = d.result
        engine.check_integrity()
    return [results[r] for r in rids]


def test_grammar_survives_retraction():
    from _engine_helpers import shared_prefix_prompts

    prompts = shared_prefix_prompts(8, prefix_len=24, seed=5)
    regex = r"(\d,){25,30}"  # ~60 tokens each (the digits and commas are single tokens)
    params = dict(regex=regex, max_new_tokens=64, temperature=0.0)
    big = Engine(tiny_model_path(), num_threads=1, kv_cache_tokens=4096)
    expected = big.generate(prompts, params)
    small = Engine(tiny_model_path(), num_threads=1, kv_cache_tokens=256, page_size=4)
    got = _run_steps(small, prompts, params)
    assert small.stats()["num_retractions"] >= 1
    for exp, r in zip(expected, got):
        assert r.finish_reason == "stop" and re.fullmatch(regex, r.text), r.text
        assert r.output_ids == exp.output_ids


def test_grammar_with_chunked_prefill():
    prompt = list(range(3, 3 + 300))
    schema = SCHEMAS[0]
    params = dict(json_schema=schema, max_new_tokens=MAX_NEW, temperature=0.0)
    whole = Engine(tiny_model_path(), num_threads=1, kv_cache_tokens=4096)
    expected, = whole.generate([prompt], params)
    chunked = Engine(tiny_model_path(), num_threads=1, kv_cache_tokens=4096, chunked_prefill_size=32)
    got = _run_steps(chunked, [prompt, PROMPT], params)
    assert got[0].output_ids == expected.output_ids
    for r in got:
        assert r.finish_reason == "stop"
        validate(json.loads(r.text, strict=False), schema)


# -- the mask in the sampler ---------------------------------------------------------------------------


def test_json_ban_row_clears_exactly_the_control_character_tokens():
    from radixserve.scheduler.grammar import _ban_row

    vocab = [b"a", b"\x00", b"b\nc", b"\x1f", b" ", b'"'] + [b"x"] * 30 + [b"\t"]
    row = _ban_row(len(vocab), vocab)
    bits = [(int(row[i // 32]) >> (i % 32)) & 1 for i in range(len(vocab))]
    assert bits == [0 if any(b < 0x20 for b in t) else 1 for t in vocab]


def test_unpack_bitmask_matches_xgrammar():
    import torch
    import xgrammar as xgr

    from radixserve.kernels.sampling import unpack_bitmask

    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 16), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, 512, generator=gen)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask)
    ours = logits.masked_fill(~unpack_bitmask(bitmask, 512), float("-inf"))
    assert torch.equal(ours, ref)
    wide = unpack_bitmask(bitmask, 600)  # a model vocabulary wider than the mask: the padding ids are off
    assert wide.shape == (5, 600) and not wide[:, 512:].any()


def test_sampler_respects_the_mask():
    import torch

    from radixserve.kernels.forward_io import SeqInput
    from radixserve.kernels.sampling import sample_next_tokens

    vocab = 100
    allowed = [7, 41, 99]
    bitmask = torch.zeros(4, 4, dtype=torch.int32)
    for t in allowed:
        bitmask[:, t // 32] |= 1 << (t % 32)
    seqs = [SeqInput(input_ids=[1], prefix_len=0, row=i, new_slots=[], slot_offset=0, sample=True,
                     sampling=SamplingParams(**p).row_sampling(), sampling_seed=i,
                     token_bitmask=bitmask[i] if i < 3 else None)
            for i, p in enumerate([dict(temperature=0.0), dict(temperature=1.0, seed=1),
                                   dict(temperature=2.0, top_p=0.5, top_k=5, min_new_tokens=4),
                                   dict(temperature=0.0)])]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        logits = torch.randn(4, vocab, generator=gen)
        logits[:, 3] = 50.0  # the unconstrained favourite (and the EOS id)
        tokens, _ = sample_next_tokens(logits, seqs)
        assert all(t in allowed for t in tokens[:3]), tokens
        assert tokens[3] == 3


# -- HTTP ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    return main_server()


def _post(server, path: str, body: dict):
    import httpx

    return httpx.post(server.url + path, json=body, timeout=120)


def _chat(fmt: dict, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Give me JSON."}], "max_tokens": MAX_NEW,
            "response_format": fmt, **extra}


def test_http_chat_response_format_json_schema(server):
    schema = SCHEMAS[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for extra in (dict(temperature=0.0), dict(temperature=1.0, seed=5, n=2)):
        r = _post(server, "/v1/chat/completions", _chat(fmt, **extra))
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop"
            validate(json.loads(choice["message"]["content"], strict=False), schema)


def test_http_chat_streamed_json_schema(server):
    import httpx

    schema = SCHEMAS[5]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    text, finish = "", None
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json=_chat(fmt, stream=True, temperature=0.8, seed=2)) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
    assert finish == "stop"
    validate(json.loads(text, strict=False), schema)


def test_http_chat_json_object(server):
    r = _post(server, "/v1/chat/completions", _chat({"type": "json_object"}, temperature=0.0, max_tokens=200))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # any JSON may be long; when it ended, it parses
        json.loads(choice["message"]["content"], strict=False)
    else:
        assert choice["finish_reason"] == "length"
    r = _post(server, "/v1/chat/completions", _chat({"type": "text"}, max_tokens=2))
    assert r.status_code == 200


@pytest.mark.parametrize("fmt", [
    {"type": "xml"}, "json", {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
])
def test_http_bad_response_format_is_400(server, fmt):
    r = _post(server, "/v1/chat/completions", _chat(fmt))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"


def test_http_native_generate_grammars(server):
    cases = [("regex", REGEXES[0]), ("json_schema", json.dumps(SCHEMAS[1])), ("ebnf", EBNF)]
    for kind, spec in cases:
        body = {"text": PROMPT, "sampling_params": {kind: spec, "max_new_tokens": MAX_NEW, "temperature": 0.0}}
        r = _post(server, "/generate", body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        check_output(out["text"], kind, json.loads(spec) if kind == "json_schema" else spec)


@pytest.mark.parametrize("kind, spec", [("regex", "(ab"), ("json_schema", "{bad"), ("ebnf", "root ::= ")])
def test_http_native_invalid_grammar_is_400(server, kind, spec):
    r = _post(server, "/generate", {"text": PROMPT, "sampling_params": {kind: spec}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"sampling_params.{kind}"
    r = _post(server, "/generate", {"text": PROMPT, "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}})
    assert r.status_code == 400
