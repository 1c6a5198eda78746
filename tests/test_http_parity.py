"""Chat prompts over HTTP tokenize exactly as transformers' apply_chat_template, and greedy HTTP output
equals the offline Engine on those ids (must-show 2)."""
import httpx
import pytest

from _http_server import main_server, tiny_model_path

TOOLS = [{"type": "function", "function": {
    "name": "get_forecast", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS = [
    ([{"role": "user", "content": "Hello!"}], None),
    ([{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": [{"type": "text", "text": "Plan a trip "}, {"type": "text", "text": "to Rome."}]},
      {"role": "assistant", "content": "Sure. Which month?"},
      {"role": "user", "content": "May, and tell me the forecast."}], TOOLS),
    ([{"role": "user", "content": "Forecast for Oslo?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"id": "call_1", "type": "function", "function": {"name": "get_forecast", "arguments": {"city": "Oslo"}}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "rain, 9C"}], TOOLS),
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def http_outputs():
    server = main_server()
    outputs = []
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for messages, tools in CONVERSATIONS:
            body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            if tools:
                body["tools"] = tools
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            outputs.append(response.json())
    return outputs


def test_chat_prompt_ids_equal_transformers(http_outputs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    for (messages, tools), out in zip(CONVERSATIONS, http_outputs):
        expected = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        expected_ids = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
        assert out["prompt_token_ids"] == expected_ids
        assert out["usage"]["prompt_tokens"] == len(expected_ids)


def test_greedy_http_output_equals_engine_generate(http_outputs):
    from radixserve.scheduler import Engine

    engine = Engine(tiny_model_path(), num_threads=1, context_length=512, kv_cache_tokens=2048)
    try:
        results = engine.generate([out["prompt_token_ids"] for out in http_outputs],
                                  {"max_new_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True})
    finally:
        engine.shutdown()
    for out, result in zip(http_outputs, results):
        choice = out["choices"][0]
        assert choice["token_ids"] == result.output_ids
        # ignore_eos and 12 tokens of a random model: always "length", plain content (no tool call parsed out)
        assert choice["finish_reason"] == result.finish_reason == "length"
        assert choice["message"]["content"] == result.text
