"""A salt that starts after the system prompt, over HTTP (issue 41 item 4; frontend/salt_policy.py): the server's
--tenant-salt after-system policy and the client's cache_salt_after. Counts: another tenant repeating a private
conversation gets its shared system prompt from the cache and not one token after it."""
from __future__ import annotations

import json
import os
import tempfile

import openai
import pytest

from _http_server import shared_server, tiny_model_path

SYSTEM = {"role": "system", "content": "You are a careful assistant for the ACME support desk. " * 12}
PRIVATE = [SYSTEM, {"role": "user", "content": "My account number is 12345 and my order is late."}]


@pytest.fixture(scope="module")
def server():
    path = os.path.join(tempfile.mkdtemp(prefix="radixserve-salt-"), "keys.json")
    with open(path, "w") as f:
        json.dump({"sk-acme": {"tenant": "acme"}, "sk-globex": {"tenant": "globex"}}, f)
    return shared_server("salt", ["--model", tiny_model_path(), "--context-length", "1024", "--kv-cache-tokens",
                                  "8192", "--served-model-name", "tiny", "--api-keys", path,
                                  "--tenant-salt", "after-system"])


def _chat(server, key: str, messages, **extra) -> tuple[int, int]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                         extra_body=extra or None)
    return out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens


def test_tenants_share_the_system_prompt_and_nothing_after_it(server):
    system_only = _chat(server, "sk-acme", [SYSTEM, {"role": "user", "content": "hi"}])[1]
    prompt, first = _chat(server, "sk-acme", PRIVATE)
    assert first > 0  # the system prompt, cached by the first request
    _, probe = _chat(server, "sk-globex", PRIVATE)  # another tenant, the very same conversation
    # The shared system part only: less than acme's own earlier request shared with this one (the user turn's
    # header after the system prompt is acme's), nothing of acme's private turn.
    assert 0 < probe < first < prompt - 10
    _, again = _chat(server, "sk-acme", PRIVATE)  # the same tenant again: all of it
    assert again >= prompt - 1
    _, own = _chat(server, "sk-globex", PRIVATE)  # and globex its own copy
    assert own >= prompt - 1
    assert system_only == 0


def test_a_clients_own_salt_after_the_system_prompt_keeps_it_private_within_the_tenant(server):
    extra = {"cache_salt": "user-7", "cache_salt_after": "system"}
    prompt, _ = _chat(server, "sk-acme", PRIVATE + [{"role": "user", "content": "again"}], **extra)
    _, same = _chat(server, "sk-acme", PRIVATE + [{"role": "user", "content": "again"}], **extra)
    _, other = _chat(server, "sk-acme", PRIVATE + [{"role": "user", "content": "again"}], cache_salt="user-8",
                     cache_salt_after="system")
    assert same >= prompt - 1 > other > 0


@pytest.mark.parametrize("extra, param", [({"cache_salt_after": 3}, "cache_salt_after"),
                                          ({"cache_salt": "x", "cache_salt_after": -1}, "cache_salt_after"),
                                          ({"cache_salt": "x", "cache_salt_after": "middle"}, "cache_salt_after")])
def test_bad_salt_boundaries_are_a_400_naming_the_field(server, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(server, "sk-acme", PRIVATE, **extra)
    assert info.value.body["param"] == param


def test_completions_have_no_system_part(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-acme", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello", max_tokens=1,
                                  extra_body={"cache_salt": "x", "cache_salt_after": "system"})
    assert info.value.body["param"] == "cache_salt_after"
