"""The bad-input battery's table (tests/test_http_battery.py runs it): one Case per malformed or adversarial
request, with the status it must get and what its OpenAI error must name. Also the small body builders the
other HTTP battery modules use."""
from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from radixserve.frontend.fields import MAX_STOP_STRINGS as MAX_STOP

USER = [{"role": "user", "content": "hi"}]
CHAT, CMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
TOK, DETOK, ABORT = "/tokenize", "/detokenize", "/abort_request"
_UNSET = object()


# -- the table ----------------------------------------------------------------------------


@dataclass
class Case:
    id: str
    path: str
    json: Any = _UNSET
    content: bytes | None = None
    method: str = "POST"
    headers: dict[str, str] | None = None
    status: int | tuple[int, ...] = 400
    param: str | None = None  # the error must name this parameter
    code: str | None = None
    says: str | None = None  # a word the error message must contain (case-insensitive)
    check: Callable[[Any], None] | None = None  # more checks on a 2xx body


def _case(*args: Any, **kwargs: Any) -> Any:
    case = Case(*args, **kwargs)
    return pytest.param(case, id=case.id)


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 2, **fields}


def gen(sampling: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {"text": "hello", "sampling_params": {"max_new_tokens": 2, **(sampling or {})}, **fields}


def msgs(*messages: dict[str, Any]) -> dict[str, Any]:
    return chat(messages=list(messages))


def tool(function: dict[str, Any]) -> dict[str, Any]:
    return chat(tools=[{"type": "function", "function": function}])


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


def _completion_tokens(n: int) -> Callable[[Any], None]:
    def check(body: Any) -> None:
        assert body["usage"]["completion_tokens"] == n, body["usage"]
    return check


def _num_choices(n: int) -> Callable[[Any], None]:
    def check(body: Any) -> None:
        assert len(body["choices"]) == n
    return check


def _batch_of(n: int) -> Callable[[Any], None]:
    def check(body: Any) -> None:
        assert isinstance(body, list) and len(body) == n
    return check


BODIES = [
    _case("chat-empty-body", CHAT, content=b"", says="empty"),
    _case("generate-empty-body", GEN, content=b"", says="empty"),
    _case("completions-not-json", CMPL, content=b"hello there", says="JSON"),
    _case("chat-json-array", CHAT, content=b"[]", says="object"),
    _case("generate-json-number", GEN, content=b"42", says="object"),
    _case("completions-json-string", CMPL, content=b'"prompt"', says="object"),
    _case("chat-json-null", CHAT, content=b"null", says="object"),
    _case("completions-truncated-json", CMPL, content=b'{"prompt": "hel', says="JSON"),
    _case("generate-truncated-json", GEN, content=b'{"text": "x", "sampling_params": {', says="JSON"),
    _case("chat-utf8-bom", CHAT, content=b"\xef\xbb\xbf" + json.dumps(chat()).encode(), says="BOM"),
    _case("completions-trailing-garbage", CMPL, content=json.dumps(cmpl()).encode() + b" }{", says="JSON"),
    _case("completions-two-objects", CMPL, content=json.dumps(cmpl()).encode() * 2, says="JSON"),
    _case("completions-huge-int-max-tokens", CMPL, cmpl(max_tokens=10**30), param="max_tokens"),
    _case("chat-huge-float-temperature", CHAT, chat(temperature=1e308), param="temperature"),
    _case("completions-1e400-literal", CMPL, content=b'{"prompt": "x", "max_tokens": 1e400}', says="JSON"),
    _case("completions-nan-literal", CMPL, content=b'{"prompt": "x", "temperature": NaN}', says="JSON"),
    _case("chat-infinity-literal", CHAT,
          content=b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', says="JSON"),
    _case("generate-minus-infinity-literal", GEN,
          content=b'{"text": "x", "sampling_params": {"temperature": -Infinity}}', says="JSON"),
    _case("completions-nested-10k-arrays", CMPL, content=nested(10_000), says="JSON"),
    _case("generate-nested-10k-objects", GEN, content=b'{"a":' * 10_000 + b"1" + b"}" * 10_000, says="JSON"),
    _case("completions-duplicate-keys-last-wins", CMPL, status=200, check=_completion_tokens(3),
          content=b'{"prompt": "dup", "max_tokens": 1, "ignore_eos": true, "max_tokens": 3}'),
]

TYPES = [
    _case("chat-max-tokens-string", CHAT, chat(max_tokens="16"), param="max_tokens"),
    _case("chat-temperature-string", CHAT, chat(temperature="0.5"), param="temperature"),
    _case("chat-n-bool", CHAT, chat(n=True), param="n"),
    _case("completions-max-tokens-bool", CMPL, cmpl(max_tokens=True), param="max_tokens"),
    _case("chat-stream-string", CHAT, chat(stream="true"), param="stream"),
    _case("chat-logprobs-int", CHAT, chat(logprobs=1), param="logprobs"),
    _case("completions-seed-string", CMPL, cmpl(seed="42"), param="seed"),
    _case("chat-messages-null", CHAT, {"messages": None}, param="messages", code="missing_required_parameter"),
    _case("completions-prompt-null", CMPL, {"prompt": None}, param="prompt", code="missing_required_parameter"),
    _case("chat-null-everywhere", CHAT, status=200,
          json={"messages": USER, "max_tokens": 2, "model": None, "n": None, "stream": None, "stop": None,
                "temperature": None, "top_p": None, "seed": None, "tools": None, "tool_choice": None,
                "logprobs": None, "top_logprobs": None, "stream_options": None, "response_format": None,
                "user": None}),
    _case("generate-null-sampling-params", GEN, {"text": "x", "sampling_params": None, "rid": None}, status=200),
    _case("chat-model-as-list", CHAT, chat(model=["tiny"]), param="model"),
    _case("chat-role-as-list", CHAT, msgs({"role": ["user"], "content": "x"}), param="messages[0].role"),
    _case("chat-stop-list-with-int", CHAT, chat(stop=["a", 5]), param="stop"),
    _case("completions-prompt-mixed-list", CMPL, cmpl(prompt=["a", 5]), param="prompt"),
    _case("completions-prompt-bool-token", CMPL, cmpl(prompt=[1, True]), param="prompt"),
    _case("completions-prompt-float-token", CMPL, cmpl(prompt=[1, 2.5]), param="prompt"),
    _case("completions-prompt-object", CMPL, cmpl(prompt={"text": "x"}), param="prompt"),
    _case("generate-text-mixed-list", GEN, gen(text=["a", 5]), param="text"),
    _case("generate-input-ids-strings", GEN, {"input_ids": ["1", "2"]}, param="input_ids"),
    _case("generate-text-and-input-ids", GEN, {"text": "x", "input_ids": [1]}, param="text"),
    _case("generate-neither-text-nor-ids", GEN, {"sampling_params": {}}, param="text"),
    _case("generate-sampling-params-string", GEN, {"text": "x", "sampling_params": "greedy"},
          param="sampling_params"),
    _case("generate-max-new-tokens-string", GEN, gen({"max_new_tokens": "4"}),
          param="sampling_params.max_new_tokens"),
    _case("generate-stream-string", GEN, gen(stream="yes"), param="stream"),
    _case("generate-return-logprob-int", GEN, gen(return_logprob=1), param="return_logprob"),
    _case("generate-rid-int", GEN, gen(rid=7), param="rid"),
    _case("generate-batch-rid-not-string", GEN, gen(text=["a", "b"], rid=["r1", 5]), param="rid[1]"),
]

RANGES = [
    _case("chat-max-tokens-negative", CHAT, chat(max_tokens=-1), param="max_tokens"),
    _case("chat-max-tokens-zero", CHAT, chat(max_tokens=0), param="max_tokens"),
    _case("chat-max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), param="max_completion_tokens"),
    _case("completions-max-tokens-zero-is-allowed", CMPL, cmpl(max_tokens=0), status=200,
          check=_completion_tokens(0)),
    _case("completions-max-tokens-past-context", CMPL, cmpl(max_tokens=10**6), param="max_tokens",
          code="context_length_exceeded"),
    _case("chat-temperature-negative", CHAT, chat(temperature=-0.5), param="temperature"),
    _case("chat-temperature-101", CHAT, chat(temperature=101), param="temperature"),
    _case("chat-top-p-zero", CHAT, chat(top_p=0), param="top_p"),
    _case("completions-top-p-negative", CMPL, cmpl(top_p=-1), param="top_p"),
    _case("chat-top-k-minus-2", CHAT, chat(top_k=-2), param="top_k"),
    _case("chat-min-p-above-1", CHAT, chat(min_p=1.5), param="min_p"),
    _case("chat-frequency-penalty-3", CHAT, chat(frequency_penalty=3), param="frequency_penalty"),
    _case("completions-repetition-penalty-0", CMPL, cmpl(repetition_penalty=0), param="repetition_penalty"),
    _case("chat-n-zero", CHAT, chat(n=0), param="n"),
    _case("completions-n-over-max", CMPL, cmpl(n=17), param="n"),
    _case("completions-logprobs-21", CMPL, cmpl(logprobs=21), param="logprobs"),
    _case("completions-logprobs-negative", CMPL, cmpl(logprobs=-1), param="logprobs"),
    _case("chat-top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), param="top_logprobs"),
    _case("chat-top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), param="top_logprobs"),
    _case("chat-seed-2-pow-64", CHAT, chat(seed=2**64), param="seed"),
    _case("completions-seed-below-int64", CMPL, cmpl(seed=-(2**63) - 1), param="seed"),
    _case("completions-seed-int64-max-n2-wraps", CMPL, cmpl(seed=2**63 - 1, n=2), status=200, check=_num_choices(2)),
    _case("generate-seed-2-pow-70", GEN, gen({"seed": 2**70}), param="sampling_params.seed"),
    _case("chat-stop-empty-string", CHAT, chat(stop=[""]), param="stop"),
    _case("chat-stop-list-too-long", CHAT, chat(stop=[f"s{i}" for i in range(1000)]), param="stop"),
    _case("completions-stop-list-at-limit", CMPL, cmpl(stop=[f"s{i}" for i in range(MAX_STOP)]), status=200),
    _case("completions-stop-list-one-over", CMPL, cmpl(stop=[f"s{i}" for i in range(MAX_STOP + 1)]), param="stop"),
    _case("generate-stop-list-too-long", GEN, gen({"stop": [f"s{i}" for i in range(1000)]}),
          param="sampling_params.stop"),
    _case("chat-min-tokens-over-max-tokens", CHAT, chat(min_tokens=5, max_tokens=2), param="min_tokens"),
    _case("chat-min-tokens-over-default-max", CHAT, {"messages": USER, "min_tokens": 10_000}, param="min_tokens"),
    _case("completions-best-of-not-n", CMPL, cmpl(best_of=3), param="best_of"),
    _case("generate-max-new-tokens-negative", GEN, gen({"max_new_tokens": -1}),
          param="sampling_params.max_new_tokens"),
    _case("generate-max-new-tokens-past-context", GEN, gen({"max_new_tokens": 2**40}),
          param="sampling_params.max_new_tokens", code="context_length_exceeded"),
    _case("generate-temperature-negative", GEN, gen({"temperature": -1}), param="sampling_params.temperature"),
    _case("generate-sampling-n-2", GEN, gen({"n": 2}), status=200, check=_batch_of(2)),
    _case("generate-sampling-n-past-max-n", GEN, gen({"n": 17}), param="sampling_params.n"),
    _case("generate-stop-regex-invalid", GEN, gen({"stop_regex": "[a-"}), param="sampling_params.stop_regex"),
    _case("generate-stop-regex-list-too-long", GEN, gen({"stop_regex": [f"s{i}" for i in range(1000)]}),
          param="sampling_params.stop_regex"),
    _case("generate-unknown-sampling-null", GEN, gen({"bogus": None}), param="sampling_params.bogus"),
    _case("generate-top-logprobs-num-21", GEN, gen(return_logprob=True, top_logprobs_num=21),
          param="top_logprobs_num"),
    _case("generate-logprob-start-len-minus-2", GEN, gen(return_logprob=True, logprob_start_len=-2),
          param="logprob_start_len"),
    _case("generate-logprob-start-len-past-prompt", GEN, gen(return_logprob=True, logprob_start_len=999),
          param="logprob_start_len"),
    _case("generate-batch-param-list-wrong-length", GEN, gen(text=["a", "b"], return_logprob=[True]),
          param="return_logprob"),
    _case("generate-token-id-past-vocab", GEN, {"input_ids": [1, 512]}, param="input_ids"),
    _case("generate-token-id-negative", GEN, {"input_ids": [1, -1]}, param="input_ids"),
    _case("completions-empty-token-list", CMPL, cmpl(prompt=[]), param="prompt"),
    _case("completions-empty-prompt-string", CMPL, cmpl(prompt=""), param="prompt"),
]

SIZES = [
    _case("completions-body-over-limit", CMPL, cmpl(prompt="x" * 70_000), status=413, says="65536"),
    _case("chat-body-over-limit", CHAT, msgs({"role": "user", "content": "y" * 70_000}), status=413),
    _case("completions-prompt-past-context", CMPL, cmpl(prompt=[7] * 600), code="context_length_exceeded"),
    _case("chat-prompt-past-context", CHAT, {"messages": [{"role": "user", "content": "hello " * 600}]},
          param="messages", code="context_length_exceeded"),
    _case("generate-prompt-past-context", GEN, gen(text="hello " * 600), code="context_length_exceeded"),
    _case("chat-300-messages-past-context", CHAT, {"messages": [{"role": "user", "content": "hi"}] * 300},
          param="messages", code="context_length_exceeded"),
    _case("completions-400-prompts-over-capacity", CMPL, cmpl(prompt=["x"] * 400, max_tokens=1), says="at most"),
    _case("generate-400-prompts-over-capacity", GEN, gen(text=["x"] * 400), says="at most"),
    _case("completions-24-prompts", CMPL, cmpl(prompt=[f"p{i}" for i in range(24)], max_tokens=1), status=200,
          check=_num_choices(24)),
    _case("generate-batch-of-24", GEN, gen(text=[f"p{i}" for i in range(24)], sampling={"max_new_tokens": 1}),
          status=200, check=_batch_of(24)),
    _case("completions-stop-string-10k-chars", CMPL, cmpl(stop=["z" * 10_000], max_tokens=4), status=200),
]

ENCODINGS = [
    _case("completions-invalid-utf8", CMPL, content=b'{"prompt": "\xff\xfe\xfd", "max_tokens": 1}', says="UTF-8"),
    _case("chat-invalid-utf8-in-content", CHAT,
          content=b'{"messages": [{"role": "user", "content": "a\xc3("}], "max_tokens": 1}', says="UTF-8"),
    _case("completions-lone-high-surrogate", CMPL, content=b'{"prompt": "a\\ud800b", "max_tokens": 1}',
          says="surrogate"),
    _case("generate-lone-low-surrogate", GEN, content=b'{"text": "\\udc00", "sampling_params": {}}',
          says="JSON"),
    _case("chat-escaped-nul-is-text", CHAT, msgs({"role": "user", "content": "a\u0000b"}), status=200),
    _case("generate-escaped-nul-is-text", GEN, gen(text="\u0000\u0000"), status=200),
    _case("completions-raw-nul-byte-in-string", CMPL, content=b'{"prompt": "a\x00b", "max_tokens": 1}', says="JSON"),
    _case("completions-utf16-body", CMPL, content=json.dumps(cmpl()).encode("utf-16"), says="JSON"),
    _case("completions-text-plain-content-type", CMPL, content=json.dumps(cmpl()).encode(),
          headers={"Content-Type": "text/plain"}, status=200),
    _case("chat-form-urlencoded-body", CHAT, content=b"messages=hi&max_tokens=2",
          headers={"Content-Type": "application/x-www-form-urlencoded"}, says="JSON"),
    _case("completions-gzip-header-plain-body", CMPL, content=json.dumps(cmpl()).encode(),
          headers={"Content-Encoding": "gzip"}, status=200),
    _case("completions-gzip-body", CMPL, content=gzip.compress(json.dumps(cmpl()).encode()),
          headers={"Content-Encoding": "gzip"}, says="JSON"),
]

MESSAGES = [
    _case("chat-missing-role", CHAT, msgs({"content": "x"}), param="messages[0].role"),
    _case("chat-unknown-role", CHAT, msgs({"role": "wizard", "content": "x"}), param="messages[0].role"),
    _case("chat-function-role", CHAT, msgs({"role": "function", "name": "f", "content": "x"}),
          param="messages[0].role"),
    _case("chat-developer-role-ok", CHAT, msgs({"role": "developer", "content": "be brief"}, USER[0]), status=200),
    _case("chat-missing-content", CHAT, msgs({"role": "user"}), param="messages[0].content"),
    _case("chat-content-number", CHAT, msgs({"role": "user", "content": 5}), param="messages[0].content"),
    _case("chat-content-object", CHAT, msgs({"role": "user", "content": {"text": "x"}}), param="messages[0].content"),
    _case("chat-content-image-part", CHAT,
          msgs({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}),
          param="messages[0].content[0]"),
    _case("chat-content-part-text-number", CHAT, msgs({"role": "user", "content": [{"type": "text", "text": 5}]}),
          param="messages[0].content[0]"),
    _case("chat-content-part-no-text", CHAT, msgs({"role": "user", "content": [{"type": "text"}]}),
          param="messages[0].content[0]"),
    _case("chat-content-part-bare-string", CHAT, msgs({"role": "user", "content": ["x"]}),
          param="messages[0].content[0]"),
    _case("chat-content-parts-ok", CHAT, msgs({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}),
          status=200),
    _case("chat-message-is-string", CHAT, chat(messages=["hi"]), param="messages[0]"),
    _case("chat-messages-object", CHAT, chat(messages={"role": "user", "content": "x"}), param="messages"),
    _case("chat-name-number", CHAT, msgs({"role": "user", "content": "x", "name": 5}), param="messages[0].name"),
    _case("chat-tool-message-without-tool-call-id", CHAT,
          msgs(USER[0], {"role": "assistant", "tool_calls": [
              {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
              {"role": "tool", "content": "42"}),
          param="messages[2].tool_call_id", code="missing_required_parameter"),
    _case("chat-tool-call-id-number", CHAT, msgs(USER[0], {"role": "tool", "content": "42", "tool_call_id": 1}),
          param="messages[1].tool_call_id"),
    _case("chat-tool-calls-on-user", CHAT,
          msgs({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}),
          param="messages[0].tool_calls"),
    _case("chat-tool-calls-not-list", CHAT, msgs(USER[0], {"role": "assistant", "tool_calls": {"name": "f"}}),
          param="messages[1].tool_calls"),
    _case("chat-tool-call-without-name", CHAT, msgs(USER[0], {"role": "assistant", "tool_calls": [{"function": {}}]}),
          param="messages[1].tool_calls[0].function.name"),
    _case("chat-assistant-tool-calls-null-content-ok", CHAT, status=200,
          json=msgs(USER[0], {"role": "assistant", "content": None, "tool_calls": [
              {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
              {"role": "tool", "content": "42", "tool_call_id": "c1"})),
    _case("chat-tools-not-list", CHAT, chat(tools={"type": "function"}), param="tools"),
    _case("chat-tool-without-function", CHAT, chat(tools=[{"type": "function"}]), param="tools[0]"),
    _case("chat-tool-unknown-type", CHAT, chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]),
          param="tools[0]"),
    _case("chat-tool-empty-name", CHAT, tool({"name": ""}), param="tools[0].function.name"),
    _case("chat-tool-parameters-string", CHAT, tool({"name": "f", "parameters": "not a schema"}),
          param="tools[0].function.parameters"),
    _case("chat-tool-properties-list", CHAT, tool({"name": "f", "parameters": {"type": "object", "properties": [1]}}),
          param="tools[0].function.parameters.properties"),
    _case("chat-tool-required-not-strings", CHAT,
          tool({"name": "f", "parameters": {"type": "object", "properties": {}, "required": [1]}}),
          param="tools[0].function.parameters.required"),
    _case("chat-tool-description-number", CHAT, tool({"name": "f", "description": 5}),
          param="tools[0].function.description"),
    _case("chat-tool-schema-ok", CHAT, status=200, json=tool(
        {"name": "get_weather", "description": "the weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})),
    _case("chat-tool-choice-required-without-tools", CHAT, chat(tool_choice="required"), param="tool_choice"),
    _case("chat-tool-choice-number", CHAT, chat(tool_choice=5), param="tool_choice"),
    _case("chat-response-format-unknown-type", CHAT, chat(response_format={"type": "xml"}),
          param="response_format"),
    _case("chat-response-format-bad-schema", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}), param="response_format"),
    _case("chat-response-format-string", CHAT, chat(response_format="json"), param="response_format"),
    _case("chat-logit-bias-out-of-range", CHAT, chat(logit_bias={"1": 500}), param="logit_bias"),
    _case("chat-logit-bias-outside-the-vocabulary", CHAT, chat(logit_bias={"99999999": 5}), param="logit_bias"),
    _case("chat-n2-logit-bias-outside-the-vocabulary", CHAT, chat(n=2, logit_bias={"99999999": 5}),
          param="logit_bias"),
    _case("chat-stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}),
          param="stream_options"),
]

UNKNOWN_FIELDS = [
    _case("chat-unknown-top-level-field-ignored", CHAT, chat(frobnicate=1), status=200),
    _case("completions-unknown-top-level-field-ignored", CMPL, cmpl(frobnicate={"a": 1}), status=200),
    _case("chat-unknown-message-field-ignored", CHAT, msgs({"role": "user", "content": "x", "mood": "sad"}),
          status=200),
    _case("generate-unknown-top-level-field-ignored", GEN, gen(image_data=None, frobnicate=1), status=200),
    _case("generate-unknown-sampling-param", GEN, gen({"frobnicate": 1}), param="sampling_params.frobnicate",
          says="frobnicate"),
    _case("generate-batch-unknown-sampling-param", GEN,
          gen(text=["a", "b"], sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 1, "temp": 0}]),
          param="sampling_params[1].temp"),
    _case("generate-invalid-regex", GEN, gen({"regex": "(a"}), param="sampling_params.regex"),
    _case("generate-structural-tag", GEN, gen({"structural_tag": "{}"}), param="sampling_params.structural_tag",
          code="unsupported_parameter"),
]

ENDPOINTS = [
    _case("models-list", "/v1/models", method="GET", status=200),
    _case("models-list-with-query", "/v1/models?limit=abc&order=%ff", method="GET", status=200),
    _case("model-by-name", "/v1/models/tiny", method="GET", status=200),
    _case("model-unknown", "/v1/models/gpt-17", method="GET", status=404, param="model", code="model_not_found"),
    _case("model-empty-name", "/v1/models/", method="GET", status=404, param="model"),
    _case("model-name-with-slash", "/v1/models/a/b", method="GET", status=404, param="model"),
    _case("model-name-nul", "/v1/models/a%00b", method="GET", status=404, param="model"),
    _case("model-name-10k-chars", "/v1/models/" + "m" * 10_000, method="GET", status=404, param="model"),
    _case("chat-unknown-model", CHAT, chat(model="gpt-17"), status=404, param="model", code="model_not_found"),
    _case("completions-unknown-model", CMPL, cmpl(model="gpt-17"), status=404, param="model"),
    _case("get-model-info", "/get_model_info", method="GET", status=200),
    _case("get-server-info", "/get_server_info", method="GET", status=200),
    _case("metrics", "/metrics", method="GET", status=200),
    _case("health-head", "/health", method="HEAD", status=200),
    _case("health-generate", "/health_generate", method="GET", status=200),
    _case("flush-cache-post-idle", "/flush_cache", status=200),
    _case("flush-cache-get-idle", "/flush_cache", method="GET", status=200),
    _case("chat-trailing-slash-redirects", CHAT + "/", chat(), status=307),
]


TOKENIZE = [
    _case("tokenize-empty-body", TOK, content=b"", says="empty"),
    _case("tokenize-json-array", TOK, content=b'["x"]', says="object"),
    _case("tokenize-prompt-number", TOK, {"prompt": 5}, param="prompt"),
    _case("tokenize-prompt-and-messages", TOK, {"prompt": "x", "messages": USER}),
    _case("tokenize-neither", TOK, {"model": "tiny"}, code="missing_required_parameter"),
    _case("tokenize-add-special-tokens-string", TOK, {"prompt": "x", "add_special_tokens": "yes"},
          param="add_special_tokens"),
    _case("tokenize-unknown-model", TOK, {"prompt": "x", "model": "gpt-17"}, status=404, param="model"),
    _case("tokenize-bad-role", TOK, {"messages": [{"role": "wizard", "content": "x"}]}, param="messages[0].role"),
    _case("tokenize-tool-message-without-id", TOK, {"messages": [{"role": "tool", "content": "x"}]},
          param="messages[0].tool_call_id"),
    _case("tokenize-lone-surrogate", TOK, content=b'{"prompt": "\\udfff"}', says="JSON"),
    _case("tokenize-body-over-limit", TOK, {"prompt": "t" * 70_000}, status=413),
    _case("tokenize-nul-text", TOK, {"prompt": "a\u0000b", "return_token_strs": True}, status=200),
    _case("tokenize-prompt-longer-than-context-is-counted", TOK, {"prompt": "hello " * 600}, status=200,
          check=lambda body: body["count"] > body["max_model_len"]),
    _case("detokenize-missing-tokens", DETOK, {}, param="tokens", code="missing_required_parameter"),
    _case("detokenize-tokens-string", DETOK, {"tokens": "1 2 3"}, param="tokens"),
    _case("detokenize-token-past-vocab", DETOK, {"tokens": [1, 512]}, param="tokens"),
    _case("detokenize-negative-token", DETOK, {"tokens": [-1]}, param="tokens"),
    _case("detokenize-float-token", DETOK, {"tokens": [1.5]}, param="tokens"),
    _case("detokenize-bool-token", DETOK, {"tokens": [True]}, param="tokens"),
    _case("detokenize-token-2-pow-70", DETOK, {"tokens": [2**70]}, param="tokens"),
    _case("detokenize-empty-list", DETOK, {"tokens": []}, status=200),
    _case("detokenize-unknown-model", DETOK, {"tokens": [1], "model": "gpt-17"}, status=404, param="model"),
    _case("abort-unknown-rid-is-200", ABORT, {"rid": "no-such-request"}, status=200),
    _case("abort-rid-number", ABORT, {"rid": 5}, param="rid"),
    _case("abort-empty-object", ABORT, {}, param="rid"),
    _case("abort-json-array", ABORT, content=b"[]"),
    _case("abort-all-string", ABORT, {"abort_all": "yes"}, param="abort_all"),
    _case("abort-all-when-idle", ABORT, {"abort_all": True}, status=200),
]

WRONG_METHODS = [
    _case(f"{method.lower()}-on-{path.strip('/').replace('/', '-')}", path, method=method, status=405)
    for method, path in [
        ("GET", CHAT), ("PUT", CHAT), ("GET", CMPL), ("DELETE", CMPL), ("GET", GEN), ("POST", "/v1/models"),
        ("DELETE", "/v1/models/tiny"), ("POST", "/get_model_info"), ("PUT", "/get_server_info"),
        ("DELETE", "/flush_cache"), ("POST", "/metrics"), ("POST", "/health"), ("POST", "/health_generate"),
        ("PATCH", GEN), ("OPTIONS", CHAT), ("GET", TOK), ("GET", DETOK), ("GET", ABORT),
    ]
]

UNKNOWN_PATHS = [
    _case(f"unknown-path-{name}", path, method=method, status=404)
    for name, method, path in [
        ("root", "GET", "/"), ("v2-chat", "POST", "/v2/chat/completions"), ("v1-chat", "POST", "/v1/chat"),
        ("embeddings", "POST", "/v1/embeddings"), ("generate-suffix", "POST", "/generate/more"),
        ("double-slash", "GET", "//v1/models"), ("percent-ff", "GET", "/%ff"), ("v1", "GET", "/v1"),
    ]
]


ALL_CASES = (BODIES + TYPES + RANGES + SIZES + ENCODINGS + MESSAGES + UNKNOWN_FIELDS + ENDPOINTS + TOKENIZE
             + WRONG_METHODS + UNKNOWN_PATHS)
