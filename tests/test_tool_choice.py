"""tool_choice required / named, strict tools, logit_bias and the refused constrained-decoding fields (issue 11).

Real HTTP against the tiny random-weight model of tests/_http_server.py (main_server's checkpoint, with a
1024-token context): it never writes a tool call on its
own, so every valid call below is the grammar's doing (frontend/tool_grammar.py, compiled by xgrammar in
the engine). The tools' schemas are bounded (enums, integer ranges, short strings), so a forced call ends.
"""
from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("xgrammar")

from _http_server import tiny_model_path, tools_server  # noqa: E402
from radixserve.frontend.tool_parser import TOOL_CALL_SYNTAX, parse_tool_calls  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 6},
            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "book", "description": "book a table",
        "parameters": {"type": "object", "properties": {
            "people": {"type": "integer", "minimum": 1, "maximum": 12},
            "slot": {"type": "object", "properties": {
                "day": {"enum": ["mon", "tue", "wed"]},
                "hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["day", "hour"]},
            "vip": {"type": "boolean"}}, "required": ["people", "slot", "vip"]}}},
    {"type": "function", "function": {
        "name": "tag", "description": "tags",
        "parameters": {"type": "object", "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2}},
            "required": ["tags"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Call a tool."}]
MAX_TOKENS = 200  # above any one call's length in tokens
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 1.0, "seed": 12}


def validate(value, schema, where="$"):
    """The JSON-schema subset of TOOLS (xgrammar is strict: no extra properties)."""
    if "enum" in schema:
        assert value in schema["enum"], (where, value)
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind in types:
        assert isinstance(value, types[kind]), (where, value)
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (where, value)
        assert schema["minimum"] <= value <= schema["maximum"], (where, value)
    if kind == "string":
        assert len(value) <= schema.get("maxLength", 10**9), (where, value)
    if kind == "array":
        assert schema["minItems"] <= len(value) <= schema["maxItems"], (where, value)
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{where}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        assert set(value) <= set(props) and set(schema.get("required", [])) <= set(value), (where, value)
        for key, item in value.items():
            validate(item, props[key], f"{where}.{key}")


def check_calls(calls, names=None):
    assert calls, "no tool call"
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert name in SCHEMAS and (names is None or name in names), name
        validate(json.loads(call["function"]["arguments"], strict=False), SCHEMAS[name])


@pytest.fixture(scope="module")
def server():
    # main_server()'s checkpoint with the model's whole context: three tools in the prompt are ~780 tokens.
    return tools_server()


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120)


def _chat(server, **fields):
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, **fields}
    return _post(server, "/v1/chat/completions", body)


def _stream_chat(server, **fields):
    """(content, tool calls assembled from the chunks, finish_reason)."""
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, "stream": True,
            **fields}
    content, calls, finish = "", {}, None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                calls[call["index"]] = call
            finish = choice.get("finish_reason") or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_syntax_is_shared_with_the_parser():
    text = TOOL_CALL_SYNTAX.render("book", '{"people": 2}') + TOOL_CALL_SYNTAX.separator \
        + TOOL_CALL_SYNTAX.render("tag", '{"tags": ["a"]}')
    content, calls = parse_tool_calls(text)
    assert content is None and [c.name for c in calls] == ["book", "tag"]
    assert json.loads(calls[0].arguments) == {"people": 2}


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_required_returns_valid_calls(server, sampling):
    r = _chat(server, tool_choice="required", **sampling)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert not choice["message"]["content"]
    check_calls(choice["message"]["tool_calls"])


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_required_without_parallel_is_exactly_one_call(server, sampling):
    for extra in ({}, {"n": 2}) if sampling is SAMPLED else ({},):
        r = _chat(server, tool_choice="required", parallel_tool_calls=False, **sampling, **extra)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "tool_calls", choice
            assert len(choice["message"]["tool_calls"]) == 1
            check_calls(choice["message"]["tool_calls"])


@pytest.mark.parametrize("name", [t["function"]["name"] for t in TOOLS])
def test_named_function_is_called(server, name):
    choice_spec = {"type": "function", "function": {"name": name}}
    for sampling in (GREEDY, SAMPLED):
        r = _chat(server, tool_choice=choice_spec, **sampling)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1
        check_calls(calls, names=[name])


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_streamed_forced_calls(server, sampling):
    content, calls, finish = _stream_chat(server, tool_choice="required", parallel_tool_calls=False, **sampling)
    assert finish == "tool_calls" and not content.strip()
    assert len(calls) == 1 and calls[0]["index"] == 0
    check_calls(calls)
    named = {"type": "function", "function": {"name": "book"}}
    content, calls, finish = _stream_chat(server, tool_choice=named, **sampling)
    assert finish == "tool_calls" and len(calls) == 1
    check_calls(calls, names=["book"])
    # Streamed and not give the same call (greedy and seeded sampling are deterministic).
    r = _chat(server, tool_choice=named, **sampling)
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] \
        == calls[0]["function"]["arguments"]


def test_tool_choice_none_never_calls(server):
    r = _chat(server, tool_choice="none", max_tokens=8, temperature=0.0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] != "tool_calls"


def test_openai_sdk_forced_calls(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    validate(json.loads(calls[0].function.arguments, strict=False), SCHEMAS[calls[0].function.name])
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    names, args, finish = [], "", None
    for chunk in stream:
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                names.append(call.function.name)
                args += call.function.arguments or ""
            finish = c.finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    validate(json.loads(args, strict=False), SCHEMAS["get_weather"])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.param == "tool_choice"


def test_strict_tool_under_auto_constrains_a_begun_call(server):
    """tool_choice auto + strict: free text is free, but a call, once begun, matches the schema. The random
    model rarely begins one, so logit_bias pushes the call tag's token."""
    tools = [dict(TOOLS[1], function=dict(TOOLS[1]["function"], strict=True))]
    r = _post(server, "/tokenize", {"prompt": TOOL_CALL_SYNTAX.open})
    ids = r.json()["tokens"]
    assert len(ids) == 1, ids  # the checkpoints' tokenizer has the tag as one added token
    r = _chat(server, tools=tools, tool_choice="auto", temperature=0.0, logit_bias={str(ids[0]): 100})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # Pushed, the tag begins call after call until max_tokens cuts one: the finish reason says so, the complete
    # calls are parsed and the cut one is dropped (no raw markup in the content).
    assert choice["finish_reason"] == "length", choice
    check_calls(choice["message"]["tool_calls"], names=["book"])
    assert TOOL_CALL_SYNTAX.open not in (choice["message"]["content"] or ""), choice


@pytest.mark.parametrize("tool_choice, fields, needle", [
    ({"type": "function", "function": {"name": "nope"}}, {}, "nope"),
    ({"type": "function"}, {}, "tool_choice"),
    ({"type": "tool", "function": {"name": "book"}}, {}, "tool_choice"),
    ({"function": {"name": 3}}, {}, "tool_choice"),
    ("sometimes", {}, "sometimes"),
    ("required", {"tools": None}, "needs tools"),
    ({"type": "function", "function": {"name": "book"}}, {"tools": []}, "needs tools"),
])
def test_bad_tool_choice_is_400(server, tool_choice, fields, needle):
    r = _chat(server, tool_choice=tool_choice, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tool_choice" and needle in error["message"], error


def test_forced_call_with_response_format_is_400(server):
    r = _chat(server, tool_choice="required", response_format={"type": "json_object"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_bad_tool_schema_is_400_naming_tools(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 5, "maximum": 1}}}}}]
    r = _chat(server, tools=tools, tool_choice="required")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"


# -- logit_bias ---------------------------------------------------------------------------------------------


def _completion_ids(server, **fields):
    body = {"model": "tiny", "prompt": "The weather in Paris is", "max_tokens": 6, "temperature": 0.0,
            "return_token_ids": True, "ignore_eos": True, **fields}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_sampler_adds_logit_bias_before_the_masks():
    """In-process: +bias moves the argmax, a grammar's mask still wins, ids past the logits are ignored."""
    import torch

    from radixserve.kernels.forward_io import SeqInput
    from radixserve.kernels.sampling import sample_next_tokens
    from radixserve.scheduler import SamplingParams

    def seq(bias, row, bitmask=None, temperature=0.0):
        return SeqInput(input_ids=[1], prefix_len=0, row=row, new_slots=[0], slot_offset=0, sample=True,
                        new_row=True, sampling=SamplingParams(temperature=temperature, logit_bias=bias).row_sampling(),
                        sampling_seed=row, token_bitmask=bitmask)

    logits = torch.zeros(4, 64)
    logits[:, 7] = 5.0
    no_five = torch.full((2,), -1, dtype=torch.int32)
    no_five[0] &= ~(1 << 5)
    seqs = [seq({5: 6.0, 9999: 100.0}, 0), seq({5: 100.0}, 1, bitmask=no_five), seq(None, 2),
            seq({7: -100.0, 3: 1.0}, 3, temperature=1.0)]
    tokens, _ = sample_next_tokens(logits, seqs)
    assert tokens[:3] == [5, 7, 7] and tokens[3] != 7


def test_engine_refuses_logit_bias_outside_the_vocabulary():
    from radixserve.scheduler import Engine
    from radixserve.scheduler.errors import RequestError

    engine = Engine(tiny_model_path(), num_threads=1, kv_cache_tokens=1024)
    try:
        with pytest.raises(RequestError) as err:
            engine.add_request("hi", {"max_new_tokens": 2, "logit_bias": {10**6: 1.0}})
        assert err.value.param == "logit_bias"
        forced = engine.generate("hi", {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                                        "logit_bias": {"65": 100}})[0]
        assert forced.output_ids == [65, 65, 65]
    finally:
        engine.shutdown()


def test_logit_bias_forces_and_bans(server):
    plain = _completion_ids(server)
    assert len(plain) == 6
    forced = _post(server, "/tokenize", {"prompt": "x"}).json()["tokens"][0]  # an ordinary token, not EOS
    assert _completion_ids(server, logit_bias={str(forced): 100}) == [forced] * 6
    banned = _completion_ids(server, logit_bias={str(t): -100 for t in plain})
    assert not set(banned) & set(plain), (plain, banned)
    sampled = _completion_ids(server, temperature=1.0, seed=3, logit_bias={str(forced): 100})
    assert sampled == [forced] * 6
    # chat too, streamed and not
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0.0, "return_token_ids": True,
            "logit_bias": {str(forced): 100}}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [forced] * 4
    text = ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=dict(body, stream=True), timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    assert text == r.json()["choices"][0]["message"]["content"]


def test_logit_bias_bans_eos(server):
    """-100 on every EOS id: a chat answer runs to max_tokens."""
    eos = [t for t in _post(server, "/tokenize", {"prompt": "<|im_end|><|endoftext|>"}).json()["tokens"]]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "seed": 1,
            "logit_bias": {str(t): -100 for t in eos}}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("bias, needle", [
    ({"100000": 1}, "outside the vocabulary"),
    ({"1": 101}, "between -100 and 100"),
    ({"1": "x"}, "between -100 and 100"),
    ({"one": 1}, "token ids"),
    ({"-1": 1}, "token ids"),
    ([1, 2], "object"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_logit_bias_is_400(server, path, bias, needle):
    body = {"model": "tiny", "max_tokens": 2, "logit_bias": bias}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES})
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logit_bias" and needle in error["message"], error


# -- refused: other servers' constrained decoding ---------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("structured_outputs", {"json": {"type": "object"}}),
    ("guided_json", {"type": "object"}),
    ("guided_regex", "a+"),
    ("guided_choice", ["a", "b"]),
    ("guided_grammar", 'root ::= "a"'),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_other_servers_constraint_fields_are_400(server, path, field, value):
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES})
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter", error


def test_structural_tag_response_format_is_400(server):
    fmt = {"type": "structural_tag", "structures": [], "triggers": []}
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "response_format": fmt}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "structural_tag" in r.json()["error"]["message"]
    r = _post(server, "/generate", {"text": "x", "sampling_params": {"structural_tag": "{}"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.structural_tag"


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_concate_and_append_request_is_a_clear_error(server, method):
    r = httpx.request(method, server.url + "/concate_and_append_request", json={}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "not supported" in error["message"]
