"""Unit tests of the HTTP layer's pure parts: request parsing, tool-call parsing, SSE, metrics, CLI."""
import json

import orjson
import pytest

from radixserve.frontend.cli import build_parser
from radixserve.frontend.flags import config_from_args
from radixserve.frontend.config import ServerConfig
from radixserve.frontend.errors import APIError
from radixserve.frontend.logprobs import CompletionLogprobs, TokenTexts, native_logprobs, prompt_entries
from radixserve.frontend.metrics import ServerMetrics
from radixserve.frontend.native_protocol import parse_generate_request
from radixserve.frontend.protocol import parse_chat_request, parse_completion_request
from radixserve.frontend.sse import sse_event
from radixserve.frontend.tool_parser import StreamingToolParser, parse_tool_calls
from radixserve.kernels.forward_io import TokenLogprob
from radixserve.scheduler.config import EngineConfig

USER = [{"role": "user", "content": "hi"}]


def _error(fn, *args):
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


# -- OpenAI parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "n": 17}, "n"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": 2.5}, "max_tokens"),
    ({"messages": USER, "stop": ["", "x"]}, "stop"),
    ({"messages": USER, "stop": 3}, "stop"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": USER, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": USER, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
     "response_format"),
    ({"messages": USER, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"messages": USER, "stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_chat_rejections_name_the_parameter(body, param):
    err = _error(parse_chat_request, body, 16)
    assert err.status == 400
    assert err.param == param, err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_chat_request_fields():
    req = parse_chat_request({
        "model": "m", "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}],
        "n": 3, "seed": 7, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 2, "stop": "END",
        "top_k": 0, "min_p": 0.1, "stream": True, "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "user": "ignored",
    }, 16)
    c = req.common
    assert (c.model, c.n, c.seed, c.max_tokens, c.logprobs, c.stream, c.include_usage) == ("m", 3, 7, 9, 2, True, True)
    assert c.sampling["stop"] == ["END"] and c.sampling["top_k"] == -1 and c.sampling["min_p"] == 0.1
    assert req.messages[0] == {"role": "system", "content": "ab"}
    assert req.messages[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert req.messages[3]["tool_call_id"] == "c1"
    assert req.tools[0]["function"]["name"] == "f"
    none_req = parse_chat_request({"messages": USER, "tools": req.tools, "tool_choice": "none"}, 16)
    assert none_req.tools is None and none_req.common.logprobs is None and none_req.common.max_tokens is None


def test_completion_prompt_forms_and_defaults():
    assert parse_completion_request({"prompt": "a"}, 4).prompts == ["a"]
    assert parse_completion_request({"prompt": ["a", "b"]}, 4).prompts == ["a", "b"]
    assert parse_completion_request({"prompt": [1, 2]}, 4).prompts == [[1, 2]]
    assert parse_completion_request({"prompt": [[1], [2, 3]]}, 4).prompts == [[1], [2, 3]]
    req = parse_completion_request({"prompt": "a", "echo": True, "logprobs": 0, "max_tokens": 0}, 4)
    assert req.common.max_tokens == 0 and req.echo and req.common.logprobs == 0
    assert parse_completion_request({"prompt": "a"}, 4).common.max_tokens == 16
    for bad in ([], [[]], [1, "a"], [-1], None, 5, [True]):
        assert _error(parse_completion_request, {"prompt": bad}, 4).param == "prompt"
    assert _error(parse_completion_request, {"prompt": "a", "suffix": "z"}, 4).param == "suffix"
    assert _error(parse_completion_request, {"prompt": "a", "logprobs": 21}, 4).param == "logprobs"


# -- native parsing ---------------------------------------------------------------------------


def test_generate_request_single_and_batch():
    single = parse_generate_request({"text": "hi", "sampling_params": {"max_new_tokens": 3, "top_k": 0,
                                                                       "spaces_between_special_tokens": True,
                                                                       "regex": None}})
    assert not single.is_batch and single.items[0].sampling == {"max_new_tokens": 3, "top_k": -1,
                                                                "spaces_between_special_tokens": True}
    assert single.items[0].n == 1
    assert single.items[0].logprob_start_len == -1 and not single.items[0].return_logprob
    batch = parse_generate_request({"input_ids": [[1, 2], [3]], "sampling_params": [{"temperature": 0}, {}],
                                    "return_logprob": True, "logprob_start_len": [0, 0], "rid": ["a", "b"],
                                    "top_logprobs_num": 2, "return_text_in_logprobs": True, "stream": True})
    assert batch.is_batch and batch.stream and [i.prompt for i in batch.items] == [[1, 2], [3]]
    assert [i.rid for i in batch.items] == ["a", "b"] and batch.items[1].top_logprobs_num == 2
    assert batch.items[0].sampling == {"temperature": 0}


def test_generate_request_sglang_sampling_params():
    """What SGLang's SglSamplingParams.to_srt_kwargs() sends (RuntimeEndpoint.generate), nulls included."""
    sent = {"skip_special_tokens": True, "spaces_between_special_tokens": False, "max_new_tokens": 8,
            "min_new_tokens": 0, "n": 3, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "ignore_eos": False, "regex": None, "json_schema": None, "ebnf": None, "no_stop_trim": True}
    item = parse_generate_request({"text": "hi", "sampling_params": sent}, max_n=4).items[0]
    assert item.n == 3 and "regex" not in item.sampling and "n" not in item.sampling
    assert item.sampling["no_stop_trim"] is True and item.sampling["spaces_between_special_tokens"] is False
    nulls = parse_generate_request({"text": "hi", "sampling_params": {k: None for k in sent}}).items[0]
    assert nulls.sampling == {} and nulls.n == 1
    one = parse_generate_request({"text": "hi", "sampling_params": {"stop_regex": r"\d+"}}).items[0]
    assert one.sampling["stop_regex"] == r"\d+"


@pytest.mark.parametrize("body, param", [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": 5}, "text"),
    ({"input_ids": [1, -2]}, "input_ids"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ({"text": "a", "sampling_params": {"regex": 5}}, "sampling_params.regex"),
    ({"text": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "sampling_params.regex"),
    ({"text": "a", "sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": "a", "sampling_params": {"bogus": None}}, "sampling_params.bogus"),
    ({"text": "a", "sampling_params": {"stop_regex": "("}}, "sampling_params.stop_regex"),
    ({"text": "a", "sampling_params": {"stop_regex": ["a", 3]}}, "sampling_params.stop_regex"),
    ({"text": "a", "sampling_params": {"stop_regex": "x*"}}, "sampling_params.stop_regex"),
    ({"text": "a", "sampling_params": {"stop_regex": ["a"] * 65}}, "sampling_params.stop_regex"),
    ({"text": "a", "sampling_params": {"no_stop_trim": "yes"}}, "sampling_params.no_stop_trim"),
    ({"text": "a", "sampling_params": {"spaces_between_special_tokens": 1}},
     "sampling_params.spaces_between_special_tokens"),
    ({"text": "a", "sampling_params": {"n": 5}}, "sampling_params.n"),
    ({"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"n": "2"}]}, "sampling_params[1].n"),
])
def test_generate_rejections(body, param):
    err = _error(lambda b: parse_generate_request(b, max_n=4), body)
    assert err.status == 400 and err.param == param, err.message


# -- tool calls -------------------------------------------------------------------------------


def test_parse_tool_calls_whole_text():
    text = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n' \
           '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].id.startswith("call_")
    assert parse_tool_calls("plain text ") == ("plain text ", [])
    bad = "<tool_call>not json</tool_call>"
    assert parse_tool_calls(bad) == (bad, [])
    assert parse_tool_calls("a <tool_call>{\"name\": \"f\"") == ("a <tool_call>{\"name\": \"f\"", [])


@pytest.mark.parametrize("split", [1, 2, 3, 5, 7, 11])
def test_streaming_tool_parser_matches_whole_text(split):
    text = 'Hi <tool<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}</tool_call> and <tool_call>{"name": "g"}' \
           '</tool_call> tail <tool_'
    parser = StreamingToolParser()
    events = []
    for i in range(0, len(text), split):
        events += parser.feed(text[i:i + split])
    events += parser.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [v for k, v in events if k == "tool_call"]
    whole_content, whole_calls = parse_tool_calls(text)
    assert content.strip() == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert [c.name for c in calls] == ["f", "g"] and parser.num_calls == 2


def test_streaming_tool_parser_releases_plain_text_early():
    parser = StreamingToolParser()
    assert parser.feed("hello <") == [("content", "hello")]  # the space waits: a tool call may follow
    assert parser.feed("b>") == [("content", " <b>")]


# -- wire formats -----------------------------------------------------------------------------


def test_sse_event_format():
    assert sse_event({"a": "é"}) == b'data: {"a":"\xc3\xa9"}\n\n'


@pytest.mark.parametrize("text", ["a\x85b", "\u2028", "x\u2029\u2028\x85y", "\r\n\x0b\x1c"])
def test_sse_event_is_one_line_for_unicode_line_readers(text):
    # A model may emit any character; httpx's iter_lines (like str.splitlines) also breaks at
    # U+0085, U+2028, U+2029. The event must still be one `data:` line that parses back.
    from httpx._decoders import LineDecoder

    lines = [x for x in LineDecoder().decode(sse_event({"text": text}, "delta").decode()) if x]
    assert lines[0] == "event: delta" and len(lines) == 2, lines
    assert json.loads(lines[1].removeprefix("data: ")) == {"text": text}


def test_logprob_payloads():
    texts = TokenTexts(lambda t: {1: "ab", 2: "c", 3: "d"}[t])
    lp = [TokenLogprob(2, -0.5, [(2, -0.5), (3, -1.0)]), TokenLogprob(3, -0.25, [(3, -0.25), (2, -2.0)])]
    ids, entries = prompt_entries([1, 2, 3], 0, lp)
    assert ids == [1, 2, 3] and entries[0] is None and entries[1:] == lp
    out = CompletionLogprobs(texts).build(ids, entries)
    assert out == {"tokens": ["ab", "c", "d"], "token_logprobs": [None, -0.5, -0.25],
                   "top_logprobs": [None, {"c": -0.5, "d": -1.0}, {"d": -0.25, "c": -2.0}], "text_offset": [0, 2, 3]}
    values, tops = native_logprobs(ids, entries, texts, 1)
    assert values == [[None, 1, "ab"], [-0.5, 2, "c"], [-0.25, 3, "d"]]
    assert tops == [None, [[-0.5, 2, "c"]], [[-0.25, 3, "d"]]]
    assert native_logprobs([2], [lp[0]], None, 0) == ([[-0.5, 2, None]], [[]])
    assert prompt_entries([1, 2, 3], 2, lp[1:])[0] == [3]


def test_completion_logprob_tokens_join_to_the_text_across_split_characters():
    """Byte tokens 5 and 6 make one character (UTF-8 of "\u00d9"): alone each decodes to U+FFFD. The
    tokens before the completing one carry "", the completing one the whole character, so the token
    strings join to the text and text_offset counts real characters, within a call and across the
    calls of a stream; a character still split at the end is emitted as decoded."""
    raw = {1: b"ab", 5: b"\xc3", 6: b"\x99", 7: b" c"}
    texts = TokenTexts(lambda t: raw[t].decode("utf-8", "replace"),
                       decode_many=lambda ids: b"".join(raw[t] for t in ids).decode("utf-8", "replace"))
    lp = TokenLogprob(7, -0.1, [(7, -0.1)])
    out = CompletionLogprobs(texts).build([1, 5, 6, 7], [None, lp, lp, lp])
    assert out["tokens"] == ["ab", "", "\u00d9", " c"] and "".join(out["tokens"]) == "ab\u00d9 c"
    assert out["text_offset"] == [0, 2, 2, 3]
    stream = CompletionLogprobs(texts)
    first, second = stream.build([1, 5], [None, lp], final=False), stream.build([6, 7], [lp, lp])
    assert first["tokens"] + second["tokens"] == ["ab", "", "\u00d9", " c"]
    assert second["text_offset"] == [2, 3]
    assert CompletionLogprobs(texts).build([1, 5], [None, lp])["tokens"] == ["ab", "\ufffd"]  # cut mid-character


def test_metrics_text_format():
    metrics = ServerMetrics()
    metrics.observe_result(0.02, 0.5, 5, "stop")
    metrics.observe_result(None, None, 0, "abort")
    metrics.observe_response(200)
    text = metrics.render({"num_running": 2, "num_waiting": 1, "total_slots": 100, "free_slots": 60,
                           "cache_hit_rate": 0.25, "num_prompt_tokens": 40}, num_in_flight=3)
    lines = text.splitlines()
    assert "radixserve_num_running_reqs 2" in lines and "radixserve_kv_slots_used 40" in lines
    assert "radixserve_cache_hit_rate 0.25" in lines and "radixserve_prompt_tokens_total 40" in lines
    assert "# TYPE radixserve_time_to_first_token_seconds histogram" in lines
    assert 'radixserve_time_to_first_token_seconds_bucket{le="0.025"} 1' in lines
    assert 'radixserve_time_to_first_token_seconds_bucket{le="0.01"} 0' in lines
    assert "radixserve_time_per_output_token_seconds_count 1" in lines
    assert 'radixserve_requests_total{finish_reason="abort"} 1' in lines
    assert 'radixserve_http_responses_total{code="200"} 1' in lines
    for line in lines:  # every sample line is "name[{labels}] number"
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


# -- CLI / config -----------------------------------------------------------------------------


def test_cli_defaults_come_from_server_config():
    args = build_parser().parse_args(["serve"])
    assert config_from_args(args) == ServerConfig()
    args = build_parser().parse_args(["serve", "--model", "/m", "--port", "0", "--api-key", "k", "--page-size", "4",
                                      "--max-queued-requests", "1", "--disable-radix-cache", "--graceful-timeout", "3",
                                      "--schedule-policy", "lpm"])
    cfg = config_from_args(args)
    assert (cfg.model, cfg.port, cfg.api_key, cfg.engine.page_size, cfg.max_queued_requests) == ("/m", 0, "k", 4, 1)
    assert cfg.engine.disable_radix_cache and cfg.graceful_timeout_s == 3.0 and cfg.engine.schedule_policy == "lpm"
    assert cfg.engine_kwargs()["page_size"] == 4 and cfg.public_dict()["api_key"] == "***"
    assert cfg.engine.model_path == "/m"
    with pytest.raises(ValueError, match="page_size"):
        ServerConfig(engine=EngineConfig(page_size=0))
    with pytest.raises(ValueError, match="max_n"):
        ServerConfig(max_n=0)


def test_error_body_shape():
    err = APIError(429, "busy", code="queue_full", headers={"Retry-After": "1"})
    resp = err.response()
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert orjson.loads(resp.body) == {"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                                                 "code": "queue_full"}}


def test_served_model_name_defaults():
    assert ServerConfig().model_name() == "radixserve-demo"  # the demo's cache path is no name to type
    assert ServerConfig(model="/ckpt/qwen").model_name() == "qwen"  # the directory's name
    assert ServerConfig(model="./m/").model_name() == ServerConfig(model="./m").model_name() == "m"
    assert ServerConfig(model="/ckpt/qwen", served_model_name="qwen").model_name() == "qwen"


def test_the_choices_of_one_prompt_reach_the_engine_as_one_request():
    """n = 3 choices plus one single job: two engine requests (the prompt sent once per prompt), whose choices the
    engine names and seeds as the frontend's jobs are named and seeded."""
    import asyncio
    import random
    from types import SimpleNamespace

    from radixserve.frontend.engine_client import EngineClient
    from radixserve.frontend.state import ServerState
    from radixserve.scheduler.sampling_params import choice_rids, choice_seed

    calls = []

    class Engine:
        info = SimpleNamespace(max_running_requests=8, context_length=64, vocab_size=32, total_slots=64,
                               page_size=1)
        dead = False

        async def add(self, rid, prompt_ids, params, queue, index, n=1):
            calls.append((rid, prompt_ids, params.seed, index, n, params.stream_interval))

    config = ServerConfig(stream_interval=3)
    client = EngineClient(Engine(), config, ServerMetrics())
    state = ServerState(engine=None, config=config, client=client, metrics=None, model_name="m", texts=None,
                        created=0, responses=None, rng=random.Random(0))
    prompt = [5, 6, 7]
    jobs = state.make_jobs(prompt, {"max_new_tokens": 4}, 3, "chat-1", 2**63 - 2, {})
    jobs += state.make_jobs([8, 9], {"max_new_tokens": 4}, 1, "chat-2", None, {})
    assert [j.rid for j in jobs] == choice_rids("chat-1", 3) + ["chat-2"]
    assert [j.params.seed for j in jobs[:3]] == [2**63 - 2, 2**63 - 1, -(2**63)]  # wrapped, as the engine does
    assert [choice_seed(2**63 - 2, i) for i in range(3)] == [j.params.seed for j in jobs[:3]]

    async def submit(stream):
        return await client.submit(jobs, client.reserve(len(jobs)), stream=stream)

    asyncio.run(submit(True))
    assert [(rid, n, index) for rid, _, _, index, n, _ in calls] == [("chat-1", 3, 0), ("chat-2", 1, 3)]
    assert calls[0][1] is prompt and calls[0][2] == 2**63 - 2  # the base seed; choice i adds i
    # A stream's deltas come every --stream-interval tokens; a response read whole wants only the final one.
    asyncio.run(submit(False))
    assert [c[-1] for c in calls] == [3, 3, 0, 0]


def test_priority_is_read_where_each_api_puts_it_and_a_client_cannot_name_a_tenant():
    """/generate: top-level `priority` (SGLang's GenerateReqInput); chat: `priority` (vLLM's extension). The tenant
    comes from the API key (scheduler/fair_share.py), so sampling_params.tenant is an unknown parameter."""
    item = parse_generate_request({"text": "hi", "priority": -3}).items[0]
    assert item.sampling["priority"] == -3
    assert _error(parse_generate_request, {"text": "hi", "sampling_params": {"tenant": "other"}}).param \
        == "sampling_params.tenant"
    assert _error(parse_generate_request, {"text": "hi", "sampling_params": {"priority": 1}}).param \
        == "sampling_params.priority"
    assert _error(parse_generate_request, {"text": "hi", "priority": "high"}).param == "priority"
    assert parse_chat_request({"messages": USER, "priority": 7}, 4).common.sampling["priority"] == 7
    assert _error(parse_chat_request, {"messages": USER, "priority": 2**40}, 4).param == "priority"
