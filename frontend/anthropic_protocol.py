"""Anthropic Messages requests (POST /v1/messages, /v1/messages/count_tokens) parsed into what chat completions runs.

A request becomes the chat template's messages (a `system` string or text blocks first; a user's `tool_result`
blocks become `tool` messages, an assistant's `tool_use` blocks its `tool_calls`, its `thinking` blocks its
`reasoning_content`, which Qwen3-style templates read; `redacted_thinking` blocks are dropped), OpenAI-shaped
tools forced by the same call grammar as chat's `tool_choice` (frontend/tool_grammar.calls_grammar: `any` is
chat's "required", `tool` a named function), and SamplingParams keyword arguments read by chat's own reader
(`temperature`, `top_p`, `top_k` and the extensions, sent in the body) with `stop_sequences` as the stop strings.
Every rejection is a 400 naming the field (rendered in Anthropic's format, frontend/errors.py).

Choices made here:
- `thinking`: every type of the anthropic SDK 2.16 is accepted. `enabled` turns the template's thinking on and caps
  the reasoning at `budget_tokens`, which must be below `max_tokens`; Anthropic's minimum of 1,024 is not
  enforced (local models run with contexts far smaller). `disabled` turns thinking off where the template has the
  switch. `adaptive` and `between_tools` turn it on, capped only by `output_config.effort` when given.
- `output_config.effort` maps onto the reasoning efforts of frontend/reasoning.py (`xhigh` as `high`; `max`: on,
  uncapped); `output_config.format` (a JSON schema) constrains the answer as chat's response_format does.
- `cache_control` is checked wherever it may appear and otherwise ignored: the radix cache keeps every prefix.
- `tool_choice: auto` with `disable_parallel_tool_use` keeps the first call only (`MessagesRequest.single_call`).
- A conversation ending with an assistant message (prefill) is refused, as Anthropic refuses it for models
  without prefill: the chat template renders whole turns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import bad_request
from .fields import MAX_STOP_STRINGS, OPENAI_SAMPLING_NAMES, FieldReader, make_sampling_params, read_openai_sampling
from .protocol import check_function_schema
from .reasoning import effort_settings
from .reasoning_options import ReasoningOptions
from .structured import require as require_structured
from .thinking_signature import verify
from .tool_grammar import calls_grammar

# The engine's parameter names -> this API's (for the engine's refusals), and SamplingParams' -> this API's.
ENGINE_NAMES = {"prompt": "messages", "max_new_tokens": "max_tokens", "json_schema": "output_config.format",
                "structural_tag": "tools"}
SAMPLING_NAMES = dict(OPENAI_SAMPLING_NAMES, stop="stop_sequences", **ENGINE_NAMES)
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": None}  # -> reasoning.py's
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
# Blocks Anthropic defines that this server cannot take (no vision, documents or server-side tools).
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload", "server_tool_use",
                      "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                      "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                      "tool_search_tool_result", "mcp_tool_use", "mcp_tool_result", "tool_reference")
# The blocks each place takes ("text": a system prompt, a system message, a tool_result's content).
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
               "system": ("text",), "text": ("text",)}
CACHE_TTLS = ("5m", "1h")


@dataclass(frozen=True)
class MessagesRequest:
    model: str | None
    max_tokens: int | None  # None only for count_tokens
    stream: bool
    messages: list[dict[str, Any]]  # chat-template messages
    tools: list[dict[str, Any]] | None  # OpenAI-shaped; None when absent or tool_choice none
    sampling: dict[str, Any]  # SamplingParams kwargs (validated)
    seed: int | None
    reasoning: ReasoningOptions  # thinking on / off and its budget
    single_call: bool  # tool_choice auto with disable_parallel_tool_use: at most one tool_use is returned


def parse_messages_request(body: Any, structured: bool, key: bytes, count_only: bool = False) -> MessagesRequest:
    """`key`: the thinking-signature key (a returned thinking block must verify); `count_only`: count_tokens's body
    (no max_tokens, nothing generated)."""
    reader = FieldReader(body)
    max_tokens = None if count_only else _max_tokens(reader)
    check_cache_control(reader, "cache_control")
    messages = _system(reader) + parse_messages(reader.raw("messages"), key)
    tools, grammar, single_call = _parse_tools(reader, structured)
    output = reader.obj("output_config")
    sampling, seed = _sampling(reader, grammar, output, structured, max_tokens)
    metadata = reader.obj("metadata")
    if metadata is not None:
        metadata.str("user_id")
    reasoning = _parse_thinking(reader, output, max_tokens)
    return MessagesRequest(model=reader.str("model"), max_tokens=max_tokens, stream=reader.bool("stream", False),
                           messages=messages, tools=tools, sampling=sampling, seed=seed, reasoning=reasoning,
                           single_call=single_call)


def _max_tokens(reader: FieldReader) -> int:
    if not reader.has("max_tokens"):
        raise bad_request("max_tokens is required", "max_tokens", code="missing_required_parameter")
    return reader.int("max_tokens", lo=0)


def _sampling(reader: FieldReader, grammar: tuple[dict[str, Any], bool] | None, output: FieldReader | None,
              structured: bool, max_tokens: int | None) -> tuple[dict[str, Any], int | None]:
    """(SamplingParams kwargs, seed): chat's sampling fields, stop_sequences, and one grammar (the answer's
    output_config.format, or the tools' call grammar), validated together with the client's names."""
    sampling = read_openai_sampling(reader)
    sampling["stop"] = reader.str_list("stop_sequences", MAX_STOP_STRINGS)
    schema = _output_format(output, structured) if output is not None else None
    if schema is not None:
        sampling["json_schema"] = schema
    if grammar is not None:
        tag, forced = grammar
        if schema is None:
            sampling["structural_tag"] = tag
        elif forced:
            raise bad_request("output_config.format cannot be combined with tool_choice any or tool (the tool call's "
                              "format is the answer's)", "output_config.format")
    seed = reader.int("seed", None, lo=-(2**63), hi=2**63 - 1)
    make_sampling_params(dict(sampling, max_new_tokens=max_tokens or sampling["min_new_tokens"], seed=seed),
                         SAMPLING_NAMES)
    return sampling, seed


def check_cache_control(reader: FieldReader, key: str) -> None:
    """Anthropic's cache breakpoint, `{"type": "ephemeral", "ttl": "5m" | "1h"}`: checked, then left to the radix
    cache, which keeps every prefix anyway."""
    control = reader.obj(key)
    if control is None:
        return
    if control.raw("type") != "ephemeral":
        raise bad_request(f"{control.name('type')} must be \"ephemeral\", got {control.raw('type')!r}",
                          control.name("type"))
    control.choice("ttl", CACHE_TTLS, "5m")


# -- messages ----------------------------------------------------------------------------------


def parse_messages(raw: Any, key: bytes) -> list[dict[str, Any]]:
    if raw is None:
        raise bad_request("messages is required", "messages", code="missing_required_parameter")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", "messages")
    out: list[dict[str, Any]] = []
    tool_ids: set[str] = set()  # the tool_use ids so far, which a tool_result must name
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        reader = FieldReader(message, prefix=where + ".")
        role = reader.raw("role")
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{where}.role must be one of user, assistant, system, got {role!r}", f"{where}.role")
        blocks = _blocks(reader.raw("content"), f"{where}.content", role)
        if role == "assistant":
            out.append(_assistant(blocks, f"{where}.content", key, tool_ids))
        elif role == "system":
            out.append({"role": "system", "content": "".join(b["text"] for b in blocks)})
        else:
            out += _user(blocks, f"{where}.content", tool_ids)
    if raw[-1].get("role") == "assistant":
        raise bad_request("the last message is an assistant message (a prefill), which this server does not "
                          "support: end with a user message", f"messages[{len(raw) - 1}]")
    return out


def _system(reader: FieldReader) -> list[dict[str, Any]]:
    raw = reader.raw("system")
    if raw is None:
        return []
    blocks = _blocks(raw, "system", "text")
    return [{"role": "system", "content": "".join(b["text"] for b in blocks)}]


def _blocks(content: Any, where: str, role: str) -> list[dict[str, Any]]:
    """A message's content as checked blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of content blocks", where)
    return [_block(block, f"{where}[{j}]", role) for j, block in enumerate(content)]


def _block(raw: Any, where: str, role: str) -> dict[str, Any]:
    reader = FieldReader(raw, prefix=where + ".")
    kind = reader.raw("type")
    if kind not in ROLE_BLOCKS[role]:
        if kind in UNSUPPORTED_BLOCKS:
            raise bad_request(f"{where}.type {kind!r}: this server does not support {kind} blocks", f"{where}.type")
        known = ", ".join(ROLE_BLOCKS[role])
        raise bad_request(f"{where}.type must be one of {known} here, got {kind!r}", f"{where}.type")
    check_cache_control(reader, "cache_control")
    required = {"text": ("text",), "thinking": ("thinking", "signature"), "redacted_thinking": ("data",),
                "tool_use": ("id", "name"), "tool_result": ("tool_use_id",)}[kind]
    for key in required:
        named = key in ("id", "name", "tool_use_id")  # these must name something
        if not isinstance(raw.get(key), str) or (named and not raw[key]):
            raise bad_request(f"{where}.{key} is required (a{' non-empty' if named else ''} string)", f"{where}.{key}")
    if kind == "tool_use" and not isinstance(raw.get("input"), dict):
        raise bad_request(f"{where}.input must be an object", f"{where}.input")
    if kind == "tool_result":
        reader.bool("is_error", False)
    return raw


def _assistant(blocks: list[dict[str, Any]], where: str, key: bytes, tool_ids: set[str]) -> dict[str, Any]:
    texts, calls, reasoning = [], [], []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use":
            tool_ids.add(block["id"])
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        elif kind == "thinking":
            if not verify(key, block["thinking"], block["signature"]):
                raise bad_request(f"{where}[{j}].signature does not verify: a thinking block must be sent back "
                                  "unchanged, to the server that made it (or a replica sharing its thinking key)",
                                  f"{where}[{j}].signature")
            reasoning.append(block["thinking"])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n\n".join(reasoning)
    return message


def _user(blocks: list[dict[str, Any]], where: str, tool_ids: set[str]) -> list[dict[str, Any]]:
    """Tool results as `tool` messages, in order, then the user's text (if any) as one user message."""
    out, texts = [], []
    for j, block in enumerate(blocks):
        if block["type"] == "text":
            texts.append(block["text"])
            continue
        if block["tool_use_id"] not in tool_ids:
            raise bad_request(f"{where}[{j}].tool_use_id {block['tool_use_id']!r} matches no tool_use block of an "
                              "earlier assistant message", f"{where}[{j}].tool_use_id")
        text = _tool_result_text(block.get("content"), f"{where}[{j}].content")
        if block.get("is_error"):
            text = "Error: " + text
        out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _tool_result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    blocks = _blocks(content, where, "text")
    return "".join(b["text"] for b in blocks)


# -- tools, output, thinking -------------------------------------------------------------------


def _parse_tools(reader: FieldReader, structured: bool
                 ) -> tuple[list[dict[str, Any]] | None, tuple[dict[str, Any], bool] | None, bool]:
    """(OpenAI-shaped tools or None, (structural tag, forced) or None, single_call)."""
    raw = reader.raw("tools", [])
    if not isinstance(raw, list):
        raise bad_request("tools must be an array", "tools")
    tools = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(raw)]
    choice = reader.obj("tool_choice")
    kind = choice.choice("type", TOOL_CHOICE_TYPES, "auto") if choice is not None else "auto"
    if choice is not None and not reader.raw("tool_choice").get("type"):
        raise bad_request("tool_choice.type is required", "tool_choice.type")
    named = choice.str("name") if kind == "tool" else None
    if kind == "tool" and not named:
        raise bad_request("tool_choice.name is required when tool_choice.type is tool", "tool_choice.name")
    single = choice.bool("disable_parallel_tool_use", False) if choice is not None and kind != "none" else False
    if kind == "none" or not tools:
        if kind in ("any", "tool"):
            raise bad_request(f"tool_choice {kind} needs tools, and none were given", "tool_choice")
        return None, None, False
    if named is not None and named not in {t["function"]["name"] for t in tools}:
        known = ", ".join(t["function"]["name"] for t in tools)
        raise bad_request(f"tool_choice names the tool {named!r}, which is not in tools ({known})", "tool_choice.name")
    what = f"tool_choice {kind}" + (f" naming {named!r}" if named else "")
    grammar = calls_grammar(tools, named, kind == "any", not single, structured, what)
    return tools, grammar, single and kind == "auto"


def _tool(raw: Any, where: str) -> dict[str, Any]:
    reader = FieldReader(raw, prefix=where + ".")
    kind = reader.raw("type", "custom")
    if kind != "custom":
        raise bad_request(f"{where}.type {kind!r}: this server runs no server tools; define the tool with name, "
                          "description and input_schema", f"{where}.type")
    name = reader.str("name")
    if not name:
        raise bad_request(f"{where}.name is required", f"{where}.name")
    if not isinstance(raw.get("input_schema"), dict):
        raise bad_request(f"{where}.input_schema is required (a JSON Schema object)", f"{where}.input_schema")
    check_function_schema(raw, where, "input_schema")
    check_cache_control(reader, "cache_control")
    fn = {"name": name, "description": raw.get("description") or "", "parameters": raw["input_schema"]}
    if reader.bool("strict", False):
        fn["strict"] = True
    return {"type": "function", "function": fn}


def _output_format(output: FieldReader, structured: bool) -> dict[str, Any] | None:
    fmt = output.obj("format")
    if fmt is None:
        return None
    if fmt.raw("type") != "json_schema" or not isinstance(fmt.raw("schema"), dict):
        raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                          "output_config.format")
    require_structured(structured, "output_config.format", "output_config.format")
    return fmt.raw("schema")


def _parse_thinking(reader: FieldReader, output: FieldReader | None, max_tokens: int | None) -> ReasoningOptions:
    effort = output.choice("effort", tuple(EFFORTS), "high") if output is not None and output.has("effort") else None
    enabled, budget = (True, None) if effort == "max" else effort_settings(EFFORTS.get(effort or ""))
    config = reader.obj("thinking")
    if config is None:
        return ReasoningOptions(enabled, budget)
    kind = config.raw("type")
    if kind not in THINKING_TYPES:
        raise bad_request(f"thinking.type must be one of {', '.join(THINKING_TYPES)}, got {kind!r}", "thinking.type")
    config.choice("display", ("summarized", "omitted"), "summarized")
    if kind == "disabled":
        return ReasoningOptions(False, None)
    if kind != "enabled":
        return ReasoningOptions(True, budget)
    if not config.has("budget_tokens"):
        raise bad_request("thinking.budget_tokens is required when thinking.type is enabled", "thinking.budget_tokens",
                          code="missing_required_parameter")
    budget = config.int("budget_tokens", lo=1)
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                          "thinking.budget_tokens")
    return ReasoningOptions(True, budget)
