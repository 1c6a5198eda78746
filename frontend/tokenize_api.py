"""POST /tokenize and /detokenize in vLLM's shapes (plus SGLang's `text` alias).

    /tokenize    {"model"?, "prompt": str, "add_special_tokens"?: true, "return_token_strs"?: false}
                 {"model"?, "messages": [...], "tools"?, "add_generation_prompt"?: true, "add_special_tokens"?: false}
              -> {"tokens": [ids], "count": n, "max_model_len": context length, "token_strs"?: [...]}
    /detokenize  {"model"?, "tokens": [ids]}  ->  {"prompt": text, "text": text}

Messages are read as /v1/chat/completions reads them, so a chat's count is the prompt_tokens that
endpoint reports. The tokenizer runs in a worker thread, never on the event loop.
"""
from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from .errors import bad_request
from .fields import FieldReader
from .protocol import parse_chat_request
from .state import ServerState


async def tokenize(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    reader = FieldReader(body)
    state.check_model(reader.str("model"))
    return_strs = reader.bool("return_token_strs", False)
    if reader.has("messages") == reader.has("prompt"):
        raise bad_request("send either prompt (a string) or messages (a chat), not both or neither",
                          "messages" if reader.has("messages") else "prompt", code="missing_required_parameter")
    if reader.has("messages"):
        chat = parse_chat_request(body, state.config.max_n)
        add_generation_prompt = reader.bool("add_generation_prompt", True)
        add_special = reader.bool("add_special_tokens", False)  # the template writes them (vLLM's default)
        ids = await asyncio.to_thread(_chat_ids, state, chat.messages, chat.tools, add_generation_prompt,
                                      add_special)
    else:
        prompt = reader.str("prompt")
        add_special = reader.bool("add_special_tokens", True)
        ids = await asyncio.to_thread(_text_ids, state, prompt, add_special)
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": state.client.context_length}
    if return_strs:
        out["token_strs"] = await asyncio.to_thread(state.engine.tokenizer.convert_ids_to_tokens, ids)
    return out


async def detokenize(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    reader = FieldReader(body)
    state.check_model(reader.str("model"))
    if not reader.has("tokens"):
        raise bad_request("tokens is required", "tokens", code="missing_required_parameter")
    ids = reader.int_list("tokens")
    vocab = state.client.vocab_size
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    text = await asyncio.to_thread(_decode, state, ids)
    return {"prompt": text, "text": text}


# -- helpers (run in a worker thread) -----------------------------------------------------------


def _text_ids(state: ServerState, prompt: str, add_special_tokens: bool) -> list[int]:
    try:
        return list(state.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    except Exception as exc:  # the tokenizer refusing the text is an input problem
        raise bad_request(f"could not tokenize prompt: {exc}", "prompt") from exc


def _chat_ids(state: ServerState, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              add_generation_prompt: bool, add_special_tokens: bool) -> list[int]:
    tokenizer = state.engine.tokenizer
    try:
        text = tokenizer.render_chat(messages, tools, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # a role order the template refuses, no template, ...
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _decode(state: ServerState, ids: list[int]) -> str:
    try:
        return state.engine.tokenizer.decode(ids, skip_special_tokens=False)
    except Exception as exc:
        raise bad_request(f"could not detokenize tokens: {exc}", "tokens") from exc
