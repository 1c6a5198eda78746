"""Histories that chat templates rewrite (issue 38 item 6; frontend/rewrite_prefetch.py), against a real server: the
scripted thinking model behind a Qwen3-style template that drops an earlier assistant turn's reasoning, so the next
turn's rendering leaves the tokens computed at the <think>. The server prefetches the canonical history in an idle
step, and the next turn hits all of it."""
from __future__ import annotations

import os
import tempfile
import time

import httpx
import openai
import pytest

from _http_server import THINK_ANSWER, scripted_model_path, shared_server
from _tokenizer_variants import qwen3_style_template

ASK = [{"role": "user", "content": "Please count to four."}]
REASONING_PART = ("{%- if message['reasoning_content'] -%}"
                  "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}{%- endif -%}")


@pytest.fixture(scope="module")
def server():
    template = qwen3_style_template()
    assert REASONING_PART in template
    path = os.path.join(tempfile.mkdtemp(prefix="radixserve-rewrite-"), "chat_template.jinja")
    with open(path, "w", encoding="utf-8") as f:
        f.write(template.replace(REASONING_PART, ""))  # earlier turns' reasoning is dropped, as Qwen3's does
    return shared_server("rewriting", ["--model", scripted_model_path(), "--kv-cache-tokens", "8192",
                                       "--max-tokens-default", "128", "--served-model-name", "thinker",
                                       "--chat-template", path, "--reasoning-parser", "qwen3"])


def _stats(server) -> dict:
    return httpx.get(server.url + "/get_server_info", timeout=30).json()["stats"]


def test_the_next_turn_hits_the_history_the_template_rewrote(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = _stats(server)["num_prefix_only_requests"]
    first = client.chat.completions.create(model="thinker", messages=ASK, temperature=0)
    message = first.choices[0].message.model_dump(exclude_none=True)
    assert message["content"] == THINK_ANSWER and message["reasoning_content"]
    deadline = time.monotonic() + 30
    while _stats(server)["num_prefix_only_requests"] == before:  # the prefetch runs once the engine is idle
        assert time.monotonic() < deadline, "no history prefetch ran"
        time.sleep(0.05)
    assert "radixserve_chat_history_rewrites_total 1" in httpx.get(server.url + "/metrics").text
    second = client.chat.completions.create(model="thinker", temperature=0, max_tokens=4, messages=[
        *ASK, {"role": "assistant", "content": message["content"]}, {"role": "user", "content": "Thanks."}])
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Without the prefetch the match would stop where the computed turn had <think> (the first prompt + 1 at most);
    # with it, only the new user message and the generation prompt are computed.
    assert cached > first.usage.prompt_tokens + 3
    assert second.usage.prompt_tokens - cached <= 16


def test_a_turn_the_template_renders_as_computed_prefetches_nothing(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = _stats(server)
    out = client.chat.completions.create(model="thinker", temperature=0, messages=ASK,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content == THINK_ANSWER
    time.sleep(0.5)
    assert _stats(server)["num_prefix_only_requests"] == before["num_prefix_only_requests"]  # no reasoning, no tools
