"""SGLang-native endpoints (/generate and friends) over a real server subprocess."""
import json
import threading
import uuid

import httpx
import pytest

from _http_server import main_server


@pytest.fixture(scope="module")
def server():
    return main_server()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def _unique(text: str) -> str:
    return f"{text} {uuid.uuid4().hex[:8]}"


def _sse(response: httpx.Response) -> list:
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_generate_single_and_batch(http):
    text = _unique("The capital of France is")
    one = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                                         "ignore_eos": True}}).json()
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == len(one["output_ids"]) == 5 and meta["prompt_tokens"] > 0
    assert set(meta) >= {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"}
    ids = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "return_token_ids": True}
                    ).json()["prompt_token_ids"]
    batch = http.post("/generate", json={"input_ids": [ids, ids[:3]], "sampling_params": [
        {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}, {"max_new_tokens": 2, "ignore_eos": True}],
        "rid": ["r-a-" + text[-8:], "r-b-" + text[-8:]]}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["text"] == one["text"] and batch[0]["output_ids"] == one["output_ids"]
    assert batch[0]["meta_info"]["cached_tokens"] == len(ids) - 1
    assert batch[1]["meta_info"]["completion_tokens"] == 2 and batch[1]["meta_info"]["id"].startswith("r-b-")


def test_generate_stream_sends_cumulative_text(http):
    body = {"text": _unique("Stream me"), "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                              "ignore_eos": True}}
    full = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json=dict(body, stream=True)) as response:
        events = _sse(response)
    texts = [e["text"] for e in events]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert texts[-1] == full["text"] and events[-1]["output_ids"] == full["output_ids"]
    assert [e["meta_info"]["finish_reason"] for e in events][:-1] == [None] * (len(events) - 1)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_generate_logprobs_like_runtime_endpoint_select(http):
    """The shapes SGLang's RuntimeEndpoint.select reads: a prefix-only request, then a scored batch."""
    prefix = _unique("Question: is the sky blue? Answer:")
    cached = http.post("/generate", json={"text": prefix, "sampling_params": {"max_new_tokens": 0}}).json()
    assert cached["text"] == "" and cached["meta_info"]["completion_tokens"] == 0
    prompt_len = cached["meta_info"]["prompt_tokens"]
    start = max(prompt_len - 2, 0)
    choices = [" yes", " no"]
    out = http.post("/generate", json={
        "text": [prefix + c for c in choices], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": start,
        "top_logprobs_num": 2}).json()
    for choice, r in zip(choices, out):
        meta = r["meta_info"]
        lps = meta["input_token_logprobs"]
        assert len(lps) == meta["prompt_tokens"] - start
        assert all(isinstance(v, float) and v <= 0 and isinstance(t, int) and isinstance(s, str) for v, t, s in lps)
        assert "".join(s for _, _, s in lps).endswith(choice)
        assert all(len(top) == 2 for top in meta["input_top_logprobs"])
        assert meta["output_token_logprobs"] == [] and meta["cached_tokens"] <= start
    whole = http.post("/generate", json={"text": prefix, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                                         "return_logprob": True, "logprob_start_len": 0}).json()["meta_info"]
    assert whole["input_token_logprobs"][0][0] is None and len(whole["input_token_logprobs"]) == prompt_len
    assert whole["input_token_logprobs"][0][2] is None  # text only with return_text_in_logprobs
    assert len(whole["output_token_logprobs"]) == 2 and whole["output_top_logprobs"] == [[], []]


def test_info_health_and_metrics(http):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] == info["tokenizer_path"]
    server_info = http.get("/get_server_info").json()
    stats = server_info["stats"]
    assert server_info["served_model_name"] == "tiny" and server_info["context_length"] == 512
    assert stats["total_slots"] == 8192 and stats["total_slots"] >= stats["free_slots"]
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    lines = metrics.text.splitlines()
    for name in ("num_running_reqs", "num_waiting_reqs", "kv_slots_used", "kv_slots_total", "cache_hit_rate",
                 "prompt_tokens_total", "cached_tokens_total", "generation_tokens_total", "evicted_tokens_total"):
        assert any(line.startswith(f"radixserve_{name} ") for line in lines), name
    count = next(line for line in lines if line.startswith("radixserve_e2e_request_latency_seconds_count"))
    assert int(count.split()[1]) >= 1
    assert any(line.startswith("radixserve_time_to_first_token_seconds_bucket") for line in lines)


def test_flush_cache_refused_while_running(server, http):
    server.wait_idle()
    body = {"text": _unique("long"), "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    started, asked = threading.Event(), threading.Event()

    def stream() -> None:
        with server.client() as other, other.stream("POST", "/generate", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    started.set()
                    asked.wait(60)
                    break  # leaving the block disconnects: the server aborts the request

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(60)
    refused = http.post("/flush_cache")
    asked.set()
    worker.join()
    assert refused.status_code == 400 and "running" in refused.json()["error"]["message"]
    info = server.wait_idle()
    flushed = http.post("/flush_cache")
    assert flushed.status_code == 200
    stats = http.get("/get_server_info").json()["stats"]
    assert stats["free_slots"] == stats["total_slots"] and stats["evictable_slots"] == 0
    assert info["stats"]["locked_slots"] == 0
