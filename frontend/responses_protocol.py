"""POST /v1/responses bodies: validated into a ResponsesRequest, whose generation part is a ChatRequest.

A Responses request is a chat request in other clothes: its input items become chat messages
(function_call -> an assistant message's tool_calls, function_call_output -> a tool message), its flat
function tools become chat tools, `text.format` becomes `response_format`, `max_output_tokens` becomes
`max_tokens`. The translated body then goes through the one chat parser (frontend/protocol.py), so
sampling ranges, tool grammars and response formats are checked in one place; its refusals are renamed
back to this API's parameters.

What the official clients send and means nothing here (`include` values other than output logprobs,
`service_tier`, `safety_identifier`, `stream_options`, `prompt_cache_retention`, ...) is accepted and
ignored; what cannot be honoured (built-in tools, `background`, `conversation`, prompt templates) is a 400,
never silence. `reasoning.effort` becomes chat's `reasoning_effort` (frontend/reasoning_options.py); `reasoning`
input items (what the openai SDK and the Agents SDK send back) become the reasoning of the assistant turn they
belong to, which the chat template renders as it renders reasoning (or drops).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import APIError, bad_request
from .fields import FieldReader
from .protocol import ChatRequest, parse_chat_request

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
REASONING_SUMMARIES = ("auto", "concise", "detailed")
MAX_METADATA = 16  # OpenAI's bound: 16 pairs, keys <= 64 and values <= 512 characters
# Refused when present (not null): what they ask for has no meaning this server can honour.
REFUSED_FIELDS = {
    "background": "background mode is not supported; run the request in the foreground",
    "conversation": "the Conversations API is not supported; chain responses with previous_response_id",
    "prompt": "prompt templates are not supported; send input (and instructions)",
    "max_tool_calls": "max_tool_calls is not supported",
}
# Extensions this server also reads on chat requests (SGLang / vLLM sampling knobs).
PASSTHROUGH_FIELDS = ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed",
                      "stop", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens", "cache_salt",
                      "logit_bias", "session_id", "priority", "thinking_token_budget",
                      "cache_salt_after")
# Parameter names of the chat request -> this API's (for the refusals of the shared parser).
RENAMED_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
                  "tools": "tools", "logprobs": "include", "reasoning_effort": "reasoning.effort"}


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ChatRequest  # the generation: messages (instructions first), tools, sampling
    input_items: list[dict[str, Any]]  # this turn's input as items, each with an id
    conversation: list[dict[str, Any]]  # this turn's input as chat messages (no instructions)
    instructions: str | None
    tools: list[dict[str, Any]]  # as sent (Responses shape), echoed in the response
    tool_choice: Any
    text_format: dict[str, Any]
    previous_response_id: str | None
    store: bool
    truncation: str
    echo: dict[str, Any]  # fields the response object repeats as given


def parse_responses_request(body: Any, structured: bool = True) -> ResponsesRequest:
    """`structured`: as parse_chat_request's (the engine can compile grammars)."""
    reader = FieldReader(body)
    _refuse(reader)
    effort, summary = _reasoning(reader)
    items = parse_input_items(reader.raw("input"))
    instructions = reader.str("instructions")
    tools = _tools(reader)
    tool_choice = reader.raw("tool_choice", "auto")
    text_format = _text_format(reader)
    truncation = reader.choice("truncation", ("disabled", "auto"), "disabled")
    conversation = items_to_messages(items)
    include = _include(reader)
    chat_body: dict[str, Any] = {
        "model": reader.str("model"),
        "messages": conversation or [{"role": "user", "content": ""}],  # the real history is joined later
        "tools": [_chat_tool(t) for t in tools] or None, "tool_choice": _chat_tool_choice(tool_choice),
        "parallel_tool_calls": reader.raw("parallel_tool_calls"), "max_tokens": reader.raw("max_output_tokens"),
        "temperature": reader.raw("temperature"), "top_p": reader.raw("top_p"), "stream": reader.raw("stream"),
        "response_format": _response_format(text_format), "reasoning_effort": effort,
    }
    top_logprobs = reader.int("top_logprobs", 0, lo=0, hi=20)
    if LOGPROBS_INCLUDE in include:
        chat_body.update(logprobs=True, top_logprobs=top_logprobs)
    chat_body.update({k: body[k] for k in PASSTHROUGH_FIELDS if k in body})
    chat = _renamed_errors(chat_body, structured)
    echo = {
        "instructions": instructions, "max_output_tokens": chat.common.max_tokens,
        "parallel_tool_calls": reader.bool("parallel_tool_calls", True),
        "temperature": reader.number("temperature", 1.0), "top_p": reader.number("top_p", 1.0),
        "metadata": _metadata(reader), "user": reader.str("user"), "prompt_cache_key": reader.str("prompt_cache_key"),
        "safety_identifier": reader.str("safety_identifier"), "service_tier": reader.str("service_tier", "auto"),
        "top_logprobs": top_logprobs, "truncation": truncation, "tool_choice": tool_choice, "tools": tools,
        "text": {"format": text_format}, "reasoning": {"effort": effort, "summary": summary},
    }
    return ResponsesRequest(chat=chat, input_items=items, conversation=conversation, instructions=instructions,
                            tools=tools, tool_choice=tool_choice, text_format=text_format,
                            previous_response_id=reader.str("previous_response_id"),
                            store=reader.bool("store", True), truncation=truncation, echo=echo)


def _refuse(reader: FieldReader) -> None:
    for name, why in REFUSED_FIELDS.items():
        value = reader.raw(name)
        if value is not None and value is not False:
            raise bad_request(why, name, code="unsupported_parameter")


def _reasoning(reader: FieldReader) -> tuple[str | None, str | None]:
    """reasoning.effort (checked by the chat parser as reasoning_effort) and reasoning.summary (or its older name
    generate_summary): with a summary asked for, a reasoning item's summary is its whole reasoning text."""
    reasoning = reader.obj("reasoning")
    if reasoning is None:
        return None, None
    summary = reasoning.str("summary") or reasoning.str("generate_summary")
    if summary is not None and summary not in REASONING_SUMMARIES:
        raise bad_request(f"reasoning.summary must be one of {', '.join(REASONING_SUMMARIES)}, got {summary!r}",
                          "reasoning.summary")
    return reasoning.raw("effort"), summary


def _include(reader: FieldReader) -> list[str]:
    raw = reader.raw("include", [])
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise bad_request("include must be an array of strings", "include")
    return raw  # values other than output logprobs name outputs this server never makes


def _metadata(reader: FieldReader) -> dict[str, str]:
    raw = reader.raw("metadata", {})
    if not isinstance(raw, dict) or len(raw) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in raw.items()):
        raise bad_request(f"metadata must be an object of at most {MAX_METADATA} string pairs (keys up to 64, "
                          "values up to 512 characters)", "metadata")
    return raw


# -- input items ---------------------------------------------------------------------------------


def parse_input_items(raw: Any) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as normalized items, each with an id."""
    if raw is None:
        raise bad_request("input is required", "input", code="missing_required_parameter")
    if isinstance(raw, str):
        return [_message_item("user", [{"type": "input_text", "text": raw}])]
    if not isinstance(raw, list):
        raise bad_request("input must be a string or an array of input items", "input")
    return [_input_item(item, f"input[{i}]") for i, item in enumerate(raw)]


def _input_item(raw: Any, where: str) -> dict[str, Any]:
    reader = FieldReader(raw, prefix=where + ".")
    kind = reader.str("type", "message")
    if kind == "message":
        role = reader.raw("role")
        if role not in MESSAGE_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", f"{where}.role")
        part_type = "output_text" if role == "assistant" else "input_text"
        parts = _text_parts(reader.raw("content"), f"{where}.content", part_type)
        return _message_item(role, parts, reader.str("id"))
    if kind == "function_call":
        arguments = reader.str("arguments")
        if arguments is None:
            raise bad_request(f"{where}.arguments is required (a JSON string)", f"{where}.arguments")
        return {"type": "function_call", "id": reader.str("id") or new_item_id("fc"),
                "call_id": _required_str(reader, "call_id"), "name": _required_str(reader, "name"),
                "arguments": arguments, "status": "completed"}
    if kind == "function_call_output":
        output = reader.raw("output")
        if not isinstance(output, str):
            output = "".join(p["text"] for p in _text_parts(output, f"{where}.output", "input_text"))
        return {"type": "function_call_output", "id": reader.str("id") or new_item_id("fco"),
                "call_id": _required_str(reader, "call_id"), "output": output, "status": "completed"}
    if kind == "reasoning":
        return _reasoning_item(reader, where)
    raise bad_request(f"{where}.type {kind!r} is not supported; send message, function_call, "
                      "function_call_output or reasoning items", f"{where}.type", code="unsupported_parameter")


def _reasoning_item(reader: FieldReader, where: str) -> dict[str, Any]:
    """A reasoning item sent back: its summary and content parts kept as given (encrypted_content, which this
    server never makes, is ignored)."""
    parts = {}
    for key, part_type in (("summary", "summary_text"), ("content", "reasoning_text")):
        raw = reader.raw(key, [])
        if not isinstance(raw, list) or not all(isinstance(p, dict) and p.get("type") == part_type
                                                and isinstance(p.get("text"), str) for p in raw):
            raise bad_request(f"{where}.{key} must be an array of {{\"type\": \"{part_type}\", \"text\": ...}} parts",
                              f"{where}.{key}")
        parts[key] = [{"type": part_type, "text": p["text"]} for p in raw]
    reader.str("encrypted_content")
    return {"type": "reasoning", "id": reader.str("id") or new_item_id("rs"), "summary": parts["summary"],
            "content": parts["content"], "status": "completed"}


def reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its reasoning content, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    return "\n\n".join(p["text"] for p in parts)


def _required_str(reader: FieldReader, key: str) -> str:
    value = reader.str(key)
    if not value:
        raise bad_request(f"{reader.name(key)} is required", reader.name(key), code="missing_required_parameter")
    return value


def _text_parts(content: Any, where: str, part_type: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": part_type, "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text parts", where)
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise bad_request(f"{where}[{i}] must be a text part ({{\"type\": \"input_text\", \"text\": ...}}); "
                              f"{kind or 'that'} content is not supported", f"{where}[{i}]")
        parts.append({"type": part_type, "text": part["text"]})
    return parts


def _message_item(role: str, parts: list[dict[str, Any]], item_id: str | None = None) -> dict[str, Any]:
    if role == "assistant":
        parts = [dict(p, annotations=[]) for p in parts]
    return {"type": "message", "id": item_id or new_item_id("msg"), "role": role, "content": parts,
            "status": "completed"}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as chat messages: consecutive function calls join the assistant message before them, and a reasoning
    item opens the assistant message that its turn's message and calls then fill."""
    messages: list[dict[str, Any]] = []
    for item in items:
        last = messages[-1] if messages else None
        if item["type"] == "reasoning":
            messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning_text(item)})
        elif item["type"] == "message" and item["role"] == "assistant" and last is not None \
                and "reasoning_content" in last and not last["content"] and not last.get("tool_calls"):
            last["content"] = "".join(p["text"] for p in item["content"])
        elif item["type"] == "message":
            text = "".join(p["text"] for p in item["content"])
            messages.append({"role": "system" if item["role"] == "developer" else item["role"], "content": text})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": _arguments(item["arguments"])}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return text  # the template renders the string as given


# -- tools and formats -------------------------------------------------------------------------------


def _tools(reader: FieldReader) -> list[dict[str, Any]]:
    raw = reader.raw("tools", [])
    if not isinstance(raw, list):
        raise bad_request("tools must be an array", "tools")
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported (got type {kind!r}); built-in tools "
                              "such as web search or file search are not", f"tools[{i}].type",
                              code="unsupported_parameter")
    return raw


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") in ("auto", "none", "required"):
        return choice["type"]
    return choice


def _text_format(reader: FieldReader) -> dict[str, Any]:
    text = reader.obj("text")
    fmt = text.raw("format") if text is not None else None
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    return fmt


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _renamed_errors(body: dict[str, Any], structured: bool) -> ChatRequest:
    """The chat parser, its refusals naming this API's parameters."""
    try:
        return parse_chat_request(body, 1, structured)
    except APIError as exc:
        exc.param, exc.message = rename_param(exc.param), rename_message(exc.message)
        raise


def rename_param(param: str | None) -> str | None:
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    base = head.split("[", 1)[0]
    if base == "tools":  # chat tools nest the function; these are flat
        return param.replace(".function", "")
    if base in RENAMED_PARAMS:
        return RENAMED_PARAMS[base] + head[len(base):] + dot + rest
    return param


def rename_message(message: str) -> str:
    message = message.replace("].function.", "].").replace("response_format", "text.format")
    for old, new in RENAMED_PARAMS.items():
        if message.startswith(old + " ") or message.startswith(old + "["):
            return new + message[len(old):]
    return message
