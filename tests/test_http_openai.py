"""The OpenAI-compatible endpoints over a real server subprocess, driven by the official openai client."""
import asyncio
import os
import uuid

import openai
import pytest

from _http_server import main_server, tiny_model_path
from radixserve.bench.soak_checks import held_by_requests

MODEL = "tiny"


@pytest.fixture(scope="module")
def server():
    return main_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _unique(text: str) -> str:
    return f"{text} {uuid.uuid4().hex[:8]}"  # a prompt no earlier test cached


def _chat(content: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}]


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_nonstream_and_stream_agree(client):
    messages = _chat(_unique("Tell me a story"))
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert 0 <= full.usage.prompt_tokens_details.cached_tokens < full.usage.prompt_tokens  # the last token is computed
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content
    assert finishes == [choice.finish_reason]  # exactly one finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # The same prompt again: its prefix comes from the radix cache (page size 1: all but the last token).
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1


def test_chat_default_max_tokens_is_the_server_cap(client):
    # min_tokens bans EOS up to the cap, so the default (--max-tokens-default 32) is what ends the reply.
    out = client.chat.completions.create(model=MODEL, messages=_chat(_unique("Go on")), temperature=0,
                                         extra_body={"min_tokens": 32})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 32


def test_completion_defaults_to_16_tokens(client):
    out = client.completions.create(model=MODEL, prompt=_unique("Count"), temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_n_choices_use_seed_plus_index(client):
    prompt = _unique("Sample")
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, extra_body={"return_token_ids": True,
                                                                                        "ignore_eos": True})
    two = client.completions.create(n=2, seed=1234, **kwargs)
    again = client.completions.create(n=2, seed=1234, **kwargs)
    second = client.completions.create(n=1, seed=1235, **kwargs)
    ids = [c.model_extra["token_ids"] for c in two.choices]
    assert [c.index for c in two.choices] == [0, 1]
    assert ids == [c.model_extra["token_ids"] for c in again.choices]  # seeded: reproducible
    assert ids[1] == second.choices[0].model_extra["token_ids"]  # choice i samples with seed + i
    assert ids[0] != ids[1]
    assert two.usage.completion_tokens == 16 and two.usage.prompt_tokens == second.usage.prompt_tokens


def test_stop_string_is_honoured_and_trimmed(client):
    prompt = _unique("Once")
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip()), None)
    assert stop is not None, f"no usable stop string in {text!r}"
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == cut.choices[0].text
    assert [p.choices[0].finish_reason for p in pieces if p.choices[0].finish_reason] == ["stop"]


def test_chat_logprobs(client):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(tiny_model_path(), "tokenizer.json"))
    out = client.chat.completions.create(model=MODEL, messages=_chat(_unique("Hi")), max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    content = out.choices[0].logprobs.content
    ids = out.choices[0].model_extra["token_ids"]
    assert len(content) == len(ids) == out.usage.completion_tokens == 6
    assert out.choices[0].message.content == tokenizer.decode(ids, skip_special_tokens=True)
    for token_id, entry in zip(ids, content):
        assert entry.token == tokenizer.decode([token_id], skip_special_tokens=False)  # special tokens by name
        if "\ufffd" not in entry.token:
            assert bytes(entry.bytes) == entry.token.encode("utf-8")
        tops = entry.top_logprobs
        assert len(tops) == 3 and entry.logprob <= 0
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy picks the top token


def test_completion_echo_and_logprobs(client):
    prompt = _unique("Hello there")
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                              logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in streamed) == choice.text
    assert streamed[0].choices[0].logprobs.tokens == lp.tokens[:out.usage.prompt_tokens]
    # max_tokens=0 with echo scores a prompt without generating
    score = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert score.choices[0].text == prompt and score.usage.completion_tokens == 0
    assert score.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:out.usage.prompt_tokens],
                                                                         abs=1e-4)


def test_token_id_prompts_match_text_prompts(client):
    prompt = _unique("Ids please")
    by_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"return_token_ids": True})
    ids = by_text.model_extra["prompt_token_ids"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, stream=True,
                                         extra_body={"return_token_ids": True})
    assert [t for c in streamed for t in c.choices[0].model_extra.get("token_ids", [])] == \
        by_text.choices[0].model_extra["token_ids"]
    batch = client.completions.create(model=MODEL, prompt=[ids, ids[:-1]], max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens == 2 * len(ids) - 1


def test_async_client_concurrent_streams(server):
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i: int) -> str:
            stream = await client.chat.completions.create(model=MODEL, messages=_chat(f"question {i}"),
                                                          max_tokens=8, temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        results = await asyncio.gather(*(one(i % 4) for i in range(8)))
        await client.close()
        return results

    results = asyncio.run(run())
    assert results[:4] == results[4:]  # greedy: the same question gives the same answer under batching
    assert held_by_requests(server.wait_idle()["stats"]) == 0


def test_extensions_cache_salt_and_stop_token_ids(client):
    prompt = _unique("Salted prompt")
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    first = client.completions.create(extra_body={"cache_salt": "tenant-a", "return_token_ids": True,
                                                  "ignore_eos": True}, **kwargs)
    other = client.completions.create(extra_body={"cache_salt": "tenant-b"}, **kwargs)
    same = client.completions.create(extra_body={"cache_salt": "tenant-a"}, **kwargs)
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # salts never share cache entries
    assert same.usage.prompt_tokens_details.cached_tokens == same.usage.prompt_tokens - 1
    ids = first.choices[0].model_extra["token_ids"]
    stop_id = ids[2]
    cut = client.completions.create(extra_body={"stop_token_ids": [stop_id], "return_token_ids": True,
                                                "ignore_eos": True}, **kwargs)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["token_ids"] == ids[:ids.index(stop_id) + 1]
    assert cut.choices[0].model_extra["matched_stop"] == stop_id


def test_chat_n2_stream_has_one_finish_per_choice(client):
    messages = _chat(_unique("Two answers"))
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.8, seed=9,
                                          n=2, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.8,
                                                 seed=9, n=2, stream=True, extra_body={"ignore_eos": True}))
    for choice in full.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert full.usage.completion_tokens == 12
