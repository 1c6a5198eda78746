"""POST /tokenize and /detokenize (vLLM's shapes, SGLang's `text` alias) against a real server, and
tokenization off the event loop in every handler that tokenizes."""
import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest

from _http_server import main_server, tiny_model_path
from radixserve.frontend import completions_api, native_api, openai_api, tokenize_api
from radixserve.frontend.errors import APIError
from radixserve.scheduler.tokenizer import Tokenizer

USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def http():
    with main_server().client() as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(tiny_model_path())


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("add_special", [None, True, False])
def test_tokenize_a_prompt(http, tokenizer, add_special):
    body = {"prompt": "hello world, tokenize me", "model": "tiny"}
    if add_special is not None:
        body["add_special_tokens"] = add_special
    out = http.post("/tokenize", json=body).json()
    expected = tokenizer.encode(body["prompt"], add_special_tokens=add_special is not False)
    assert out == {"tokens": expected, "count": len(expected), "max_model_len": 512}


def test_tokenize_returns_token_strings_on_request(http, tokenizer):
    out = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])


def test_tokenize_messages_counts_what_chat_completions_reports(http, tokenizer):
    out = http.post("/tokenize", json={"messages": USER}).json()
    chat = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).json()
    assert out["count"] == chat["usage"]["prompt_tokens"] == len(out["tokens"])
    assert out["tokens"] == tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    bare = http.post("/tokenize", json={"messages": USER, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tokenizer.apply_chat_template(USER, add_generation_prompt=False)
    assert bare["count"] < out["count"]


def test_detokenize_round_trip_with_text_alias(http, tokenizer):
    ids = http.post("/tokenize", json={"prompt": "round trip 世界"}).json()["tokens"]
    out = http.post("/detokenize", json={"tokens": ids, "model": "tiny"}).json()
    assert out == {"prompt": tokenizer.decode(ids, skip_special_tokens=False),
                   "text": tokenizer.decode(ids, skip_special_tokens=False)}
    assert "round trip 世界" in out["prompt"]
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": "", "text": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": USER}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": USER, "add_generation_prompt": 1}, "add_generation_prompt"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": [1, 512]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
])
def test_bad_input_is_400_naming_the_parameter(http, path, body, param):
    error = _error(http.post(path, json=body))
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_unknown_model_is_404(http):
    assert _error(http.post("/tokenize", json={"prompt": "x", "model": "gpt-17"}), 404)["param"] == "model"
    assert _error(http.post("/detokenize", json={"tokens": [1], "model": "gpt-17"}), 404)["param"] == "model"


# -- off the event loop -----------------------------------------------------------------------


def _recording_state(threads: list[str]) -> SimpleNamespace:
    """A ServerState stand-in whose tokenizer calls record their thread and end the request."""

    def record(*args, **kwargs):
        threads.append(threading.current_thread().name)
        raise APIError(400, "stop here")

    tokenizer = SimpleNamespace(encode=record, render_chat=record, apply_chat_template=record,
                                convert_ids_to_tokens=record, decode=record, chat_template=None)
    return SimpleNamespace(config=SimpleNamespace(max_n=4), structured=True, check_model=lambda model: None, encode=record,
                           render_chat=record, new_id=lambda prefix: prefix + "-1",
                           engine=SimpleNamespace(tokenizer=tokenizer),
                           client=SimpleNamespace(vocab_size=512, context_length=512))


@pytest.mark.parametrize("handler, body", [
    (openai_api.chat_completions, {"messages": USER}),
    (completions_api.completions, {"prompt": "hi"}),
    (native_api.generate, {"text": "hi"}),
    (tokenize_api.tokenize, {"prompt": "hi"}),
    (tokenize_api.tokenize, {"messages": USER}),
    (tokenize_api.detokenize, {"tokens": [1, 2]}),
])
def test_tokenization_runs_off_the_event_loop(handler, body):
    threads: list[str] = []

    async def call() -> str:
        with pytest.raises(APIError, match="stop here"):
            await handler(_recording_state(threads), None, body)
        return threading.current_thread().name

    loop_thread = asyncio.run(call())
    assert threads and loop_thread not in threads, threads
