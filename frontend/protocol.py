"""OpenAI request parsing: JSON bodies into validated ChatRequest / CompletionRequest.

Every rejection is an APIError(400) naming the parameter, so clients see what to fix.
Unknown top-level fields are ignored (clients send vendor extras); unsupported features that
would silently change the output (suffix, vLLM's guided_* / structured_outputs) are refused.
``response_format`` becomes the engine's ``json_schema`` and a forced ``tool_choice`` its
``structural_tag`` (frontend/tool_grammar.py; both compiled with xgrammar in the engine);
``logit_bias`` becomes SamplingParams.logit_bias (ids checked against the vocabulary by the handler).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_request
from .fields import (
    OPENAI_SAMPLING_NAMES,
    FieldReader,
    make_sampling_params,
    read_openai_sampling,
)
from .reasoning_options import ReasoningOptions, read_chat_reasoning
from .structured import require as require_structured
from .tool_grammar import calls_grammar
from ..scheduler.sampling_params import JSON_OBJECT

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class CommonOptions:
    """What chat and completions requests share."""

    model: str | None
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None = the endpoint's default
    seed: int | None
    logprobs: int | None  # top-k alternatives per output token; None = no logprobs
    return_token_ids: bool  # extension: prompt_token_ids / choice token_ids in the response
    # Echoed back. One engine's token tree finds all sharing without it; across replicas it is the routing
    # key a client can hand the router (README "Replicas").
    prompt_cache_key: str | None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs (validated)
    max_tokens_param: str = "max_tokens"  # the name the client gave it (chat: or max_completion_tokens)


@dataclass(frozen=True)
class ChatRequest:
    common: CommonOptions
    messages: list[dict[str, Any]]  # roles normalized, content flattened to strings
    tools: list[dict[str, Any]] | None  # None when absent or tool_choice == "none"
    reasoning: ReasoningOptions = ReasoningOptions()  # reasoning_effort, chat_template_kwargs


@dataclass(frozen=True)
class CompletionRequest:
    common: CommonOptions
    prompts: list[str | list[int]]  # one entry per prompt (OpenAI allows a batch)
    echo: bool


def parse_chat_request(body: Any, max_n: int, structured: bool = True) -> ChatRequest:
    """`structured`: the engine can compile grammars (frontend/structured.py says what changes without)."""
    reader = FieldReader(body)
    messages = _parse_messages(reader.raw("messages"))
    max_tokens_param = "max_completion_tokens" if reader.has("max_completion_tokens") else "max_tokens"
    max_tokens = reader.int(max_tokens_param, lo=1)
    logprobs_on = reader.bool("logprobs", False)
    top_logprobs = reader.int("top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    if top_logprobs and not logprobs_on:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    _refuse_unsupported(reader)
    tools, tool_grammar = _parse_tools(reader, structured)
    common = _parse_common(reader, max_n, max_tokens, top_logprobs if logprobs_on else None, tool_grammar,
                           max_tokens_param, structured)
    return ChatRequest(common=common, messages=messages, tools=tools, reasoning=read_chat_reasoning(reader))


def parse_completion_request(body: Any, max_n: int) -> CompletionRequest:
    reader = FieldReader(body)
    prompts = _parse_prompts(reader.raw("prompt", _Missing))
    max_tokens = reader.int("max_tokens", 16, lo=0)
    logprobs = reader.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    echo = reader.bool("echo", False)
    if reader.str("suffix"):
        raise bad_request("suffix is not supported", "suffix", code="unsupported_parameter")
    best_of = reader.int("best_of", None, lo=1)
    _refuse_unsupported(reader)
    common = _parse_common(reader, max_n, max_tokens, logprobs)
    if best_of is not None and best_of != common.n:
        raise bad_request("best_of must equal n (server-side ranking is not supported)", "best_of")
    return CompletionRequest(common=common, prompts=prompts, echo=echo)


class _Missing:
    pass


def _parse_common(reader: FieldReader, max_n: int, max_tokens: int | None, logprobs: int | None,
                  tool_grammar: tuple[dict[str, Any], bool] | None = None,
                  max_tokens_param: str = "max_tokens", structured: bool = True) -> CommonOptions:
    n = reader.int("n", 1, lo=1, hi=max_n)
    stream = reader.bool("stream", False)
    options = reader.obj("stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    include_usage = options.bool("include_usage", False) if options is not None else False
    seed = reader.int("seed", None, lo=-(2**63), hi=2**63 - 1)
    sampling = read_openai_sampling(reader)
    sampling.update(_parse_response_format(reader, structured))
    if tool_grammar is not None:
        tag, forced = tool_grammar
        if "json_schema" not in sampling:
            sampling["structural_tag"] = tag
        elif forced:  # one grammar per request
            raise bad_request("response_format cannot be combined with tool_choice \"required\" or a named "
                              "function (the tool call's format is the response's)", "response_format")
        # else: tool_choice auto with strict tools and a response_format: response_format wins
    bias = _parse_logit_bias(reader)
    if bias:
        sampling["logit_bias"] = bias
    # Validate the whole set once (ranges, min_tokens <= max_tokens) with the client's names.
    probe = dict(sampling, max_new_tokens=max_tokens if max_tokens is not None else sampling["min_new_tokens"],
                 seed=seed, logprobs=logprobs)
    make_sampling_params(probe, OPENAI_SAMPLING_NAMES)
    model = reader.str("model")
    return CommonOptions(model=model, n=n, stream=stream, include_usage=include_usage,
                         max_tokens=max_tokens, seed=seed, logprobs=logprobs,
                         return_token_ids=reader.bool("return_token_ids", False),
                         prompt_cache_key=reader.str("prompt_cache_key"), sampling=sampling,
                         max_tokens_param=max_tokens_param)


# Other servers' constrained-decoding fields: refused, so a client never gets unconstrained output.
UNSUPPORTED_FIELDS = {
    "structured_outputs": "vLLM's structured_outputs",
    "guided_json": "vLLM's guided_json",
    "guided_regex": "vLLM's guided_regex",
    "guided_choice": "vLLM's guided_choice",
    "guided_grammar": "vLLM's guided_grammar",
    "guided_decoding_backend": "vLLM's guided_decoding_backend",
    "guided_whitespace_pattern": "vLLM's guided_whitespace_pattern",
}
MAX_LOGIT_BIAS = 1024  # entries (each costs host work per step)


def _refuse_unsupported(reader: FieldReader) -> None:
    for name, what in UNSUPPORTED_FIELDS.items():
        if reader.has(name):
            raise bad_request(f"{name} ({what}) is not supported; use response_format (json_object or "
                              "json_schema) or tool_choice", name, code="unsupported_parameter")


def _parse_logit_bias(reader: FieldReader) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}. Ids are checked against the vocabulary by the
    engine, which knows it (its refusal is a 400 naming logit_bias)."""
    raw = reader.raw("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request("logit_bias must be an object mapping token ids (as strings) to biases", "logit_bias")
    if len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias has {len(raw)} entries; at most {MAX_LOGIT_BIAS} are allowed", "logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isdigit() and key.isascii()):
            raise bad_request(f"logit_bias keys must be token ids (non-negative integers as strings), got {key!r}",
                              "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias[{key!r}] must be a number between -100 and 100, got {value!r}",
                              "logit_bias")
        out[int(key)] = float(value)
    return out or None


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def _parse_response_format(reader: FieldReader, structured: bool) -> dict[str, Any]:
    """OpenAI's response_format as SamplingParams kwargs: {} (text), or json_schema. The schema
    itself is compiled by the engine; its refusal comes back as a 400 naming response_format."""
    raw = reader.raw("response_format")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad_request("response_format must be an object", "response_format")
    fmt = reader.obj("response_format")
    kind = fmt.raw("type")
    if kind == "structural_tag":
        raise bad_request("response_format type structural_tag (SGLang's) is not supported; use json_schema, "
                          "or tools with tool_choice for tool calls", "response_format", code="unsupported_parameter")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
                          f"got {kind!r}", "response_format")
    if kind == "text":
        return {}
    require_structured(structured, "response_format", f"response_format {kind}")
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT}
    spec = fmt.raw("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with name and schema",
                          "response_format")
    inner = FieldReader(spec, prefix="response_format.json_schema.")
    inner.str("name")
    inner.bool("strict", False)  # xgrammar's schema grammars are always strict
    schema = spec.get("schema")
    if schema is None:
        return {"json_schema": JSON_OBJECT}
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be an object", "response_format")
    return {"json_schema": schema}


def _parse_messages(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        raise bad_request("messages is required", "messages", code="missing_required_parameter")
    if not isinstance(raw, list):
        raise bad_request("messages must be an array", "messages")
    if not raw:
        raise bad_request("messages must not be empty", "messages")
    return [_parse_message(msg, f"messages[{i}]") for i, msg in enumerate(raw)]


def _parse_message(raw: Any, where: str) -> dict[str, Any]:
    reader = FieldReader(raw, prefix=where + ".")
    role = reader.raw("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                          f"{where}.role")
    message: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = _flatten_content(reader.raw("content"), f"{where}.content")
    tool_calls = reader.raw("tool_calls")
    if content is None and not (role == "assistant" and tool_calls):
        raise bad_request(f"{where}.content is required", f"{where}.content")
    message["content"] = content if content is not None else ""
    if tool_calls is not None:
        if role != "assistant":
            raise bad_request(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
        message["tool_calls"] = _parse_message_tool_calls(tool_calls, f"{where}.tool_calls")
    for key in ("name", "tool_call_id"):
        value = reader.str(key)
        if value is not None:
            message[key] = value
    # An earlier turn's reasoning sent back (vLLM's reasoning_content, or reasoning): the template renders it.
    reasoning = reader.str("reasoning_content") or reader.str("reasoning")
    if reasoning and role == "assistant":
        message["reasoning_content"] = reasoning
    if role == "tool" and not message.get("tool_call_id"):
        # Templates pair a tool result with its call by this id (OpenAI requires it too).
        raise bad_request(f"{where}.tool_call_id is required on tool messages", f"{where}.tool_call_id",
                          code="missing_required_parameter")
    return message


def _flatten_content(content: Any, where: str) -> str | None:
    """Content as a string; a list of text parts is joined (other part types are refused)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text parts", where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{i}] must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                              "other content types are not supported", f"{where}[{i}]")
        texts.append(part["text"])
    return "".join(texts)


def _parse_message_tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """Assistant tool calls as templates expect them: arguments decoded to an object when JSON."""
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be an array", where)
    calls = []
    for i, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}[{i}].function.name is required", f"{where}[{i}].function.name")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass  # the template renders the string as given
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": fn["name"], "arguments": arguments}})
    return calls


TOOL_CHOICE_MODES = ("auto", "none", "required")


def _parse_tools(reader: FieldReader, structured: bool
                 ) -> tuple[list[dict[str, Any]] | None, tuple[dict[str, Any], bool] | None]:
    """(tools for the template and the parser, or None; (structural tag, forced) or None).

    tool_choice "none" keeps the tools out of the prompt and never parses calls; "required" and a named
    function force calls (the grammar of frontend/tool_grammar.py); "auto" constrains calls only when a
    tool is strict, and only on a server with structured generation (else strict is best effort)."""
    raw_tools = reader.raw("tools")
    choice = reader.raw("tool_choice", "auto")
    parallel = reader.bool("parallel_tool_calls", True)
    named = _tool_choice_name(choice)
    if raw_tools is None:
        tools_in: list[Any] = []
    elif not isinstance(raw_tools, list):
        raise bad_request("tools must be an array", "tools")
    else:
        tools_in = raw_tools
    tools = []
    for i, tool in enumerate(tools_in):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name is required", f"tools[{i}].function.name")
        check_function_schema(fn, f"tools[{i}].function")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad_request(f"tools[{i}].function.strict must be a boolean", f"tools[{i}].function.strict")
        tools.append({"type": "function", "function": fn})
    if choice == "none" or not tools:
        if choice == "required" or named is not None:
            raise bad_request(f"tool_choice {'required' if named is None else repr(named)} needs tools, and none "
                              "were given", "tool_choice")
        return None, None
    if named is not None and named not in {t["function"]["name"] for t in tools}:
        known = ", ".join(t["function"]["name"] for t in tools)
        raise bad_request(f"tool_choice names the function {named!r}, which is not in tools ({known})", "tool_choice")
    what = 'tool_choice "required"' if named is None else f"tool_choice naming the function {named!r}"
    return tools, calls_grammar(tools, named, choice == "required", parallel, structured, what)


def _tool_choice_name(choice: Any) -> str | None:
    """The function a tool_choice object names (None for the string modes); a bad value is a 400."""
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise bad_request(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                              f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}",
                              "tool_choice")
        return None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request("tool_choice must be \"auto\", \"none\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return fn["name"]


def check_function_schema(fn: dict[str, Any], where: str, key: str = "parameters") -> None:
    """The shape templates rely on: a string description, the `key` field (OpenAI's parameters, Anthropic's
    input_schema) a JSON Schema object (its properties an object, its required list names). The schema itself is
    not enforced."""
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", f"{where}.description")
    params = fn.get(key)
    where = f"{where}.{key}"
    if params is None:
        return
    if not isinstance(params, dict):
        raise bad_request(f"{where} must be a JSON Schema object", where)
    if "type" in params and not isinstance(params["type"], (str, list)):
        raise bad_request(f"{where}.type must be a string", f"{where}.type")
    if "properties" in params and not isinstance(params["properties"], dict):
        raise bad_request(f"{where}.properties must be an object", f"{where}.properties")
    required = params.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise bad_request(f"{where}.required must be a list of strings", f"{where}.required")


def _parse_prompts(raw: Any) -> list[str | list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of lists of ids."""
    if raw is _Missing:
        raise bad_request("prompt is required", "prompt", code="missing_required_parameter")
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        if all(isinstance(p, str) for p in raw):
            return list(raw)
        if all(_is_token_id(t) for t in raw):
            return [list(raw)]
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in raw):
            return [list(p) for p in raw]
    raise bad_request("prompt must be a string, a list of strings, a non-empty list of token ids "
                      "(non-negative integers) or a list of such lists", "prompt")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
