"""SGLang-native endpoints (/generate and friends) over a real server subprocess."""
import json
import threading
import uuid

import httpx
import pytest

from _http_server import SCRIPTS, main_server, scripted_server
from radixserve.bench.soak_checks import held_by_requests


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
    assert held_by_requests(info["stats"]) == 0


# -- what SGLang's frontend sends; stop_regex / no_stop_trim; n > 1 -----------------------------------

# SglSamplingParams.to_srt_kwargs() plus what RuntimeEndpoint.generate adds (sglang 0.5.23), nulls included.
SGLANG_SAMPLING = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 4,
                   "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [],
                   "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                   "presence_penalty": 0.0, "ignore_eos": True, "regex": None, "json_schema": None}


def test_generate_accepts_what_sglang_sends(http):
    text = _unique("SGLang sends")
    plain = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                           "ignore_eos": True}}).json()
    full = http.post("/generate", json={"text": text, "sampling_params": SGLANG_SAMPLING}).json()
    assert full["output_ids"] == plain["output_ids"] and full["text"] == plain["text"]
    nulls = dict({k: None for k in SGLANG_SAMPLING}, max_new_tokens=2, ebnf=None, no_stop_trim=None,
                 min_p=None, seed=None)
    out = http.post("/generate", json={"text": text, "sampling_params": nulls, "return_logprob": None,
                                       "logprob_start_len": None, "top_logprobs_num": None,
                                       "return_text_in_logprobs": None, "stream": None})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] <= 2
    extra = dict(SGLANG_SAMPLING, spaces_between_special_tokens=False, no_stop_trim=True, skip_special_tokens=False)
    assert http.post("/generate", json={"text": text, "sampling_params": extra}).status_code == 200


@pytest.mark.parametrize("sampling, param", [
    ({"bogus": 1}, "sampling_params.bogus"),
    ({"bogus": None}, "sampling_params.bogus"),
    ({"stop_regex": "(unclosed"}, "sampling_params.stop_regex"),
    ({"stop_regex": ["ok", ""]}, "sampling_params.stop_regex"),
    ({"no_stop_trim": "no"}, "sampling_params.no_stop_trim"),
    ({"n": 17}, "sampling_params.n"),
])
def test_generate_bad_sampling_params_name_the_field(http, sampling, param):
    r = http.post("/generate", json={"text": "hi", "sampling_params": sampling})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert param.split(".")[-1] in r.json()["error"]["message"]


def _gen(http, text, **sampling):
    body = {"text": text, "sampling_params": dict({"max_new_tokens": 6, "ignore_eos": True}, **sampling)}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_n_returns_n_results_with_seeds_base_plus_i(http):
    text = _unique("Choices")
    many = _gen(http, text, n=3, seed=41, temperature=1.0)
    assert isinstance(many, list) and len(many) == 3
    assert len({r["meta_info"]["id"] for r in many}) == 3
    for i, r in enumerate(many):
        assert r["output_ids"] == _gen(http, text, seed=41 + i, temperature=1.0)["output_ids"]
        assert r["meta_info"]["completion_tokens"] == 6
    assert len({tuple(r["output_ids"]) for r in many}) > 1  # different seeds, (almost surely) different tokens


def test_generate_n_batch_is_prompt_major(http):
    texts = [_unique("First prompt"), _unique("Second prompt, longer than the first one")]
    r = http.post("/generate", json={"text": texts, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True,
                                                                         "n": 2, "temperature": 0}}).json()
    assert len(r) == 4
    singles = [_gen(http, t, max_new_tokens=3, temperature=0) for t in texts]
    assert [x["meta_info"]["prompt_tokens"] for x in r] == [singles[0]["meta_info"]["prompt_tokens"]] * 2 + \
        [singles[1]["meta_info"]["prompt_tokens"]] * 2
    assert [x["output_ids"] for x in r] == [singles[0]["output_ids"]] * 2 + [singles[1]["output_ids"]] * 2


def test_generate_n_streamed_tags_each_event_with_its_index(http):
    body = {"text": _unique("Stream choices"), "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "n": 2,
                                                                     "seed": 7, "temperature": 1.0}}
    plain = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json=dict(body, stream=True)) as response:
        events = _sse(response)
    assert {e["index"] for e in events} == {0, 1}
    for i in (0, 1):
        mine = [e for e in events if e["index"] == i]
        assert all(b["text"].startswith(a["text"]) for a, b in zip(mine, mine[1:]))
        assert mine[-1]["output_ids"] == plain[i]["output_ids"] and mine[-1]["text"] == plain[i]["text"]
        assert mine[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


@pytest.fixture(scope="module")
def scripted():
    with scripted_server().client() as client:
        yield client


STORY = SCRIPTS["story"]  # "once upon a time there was a tiny model that served many clients at once"


def _story(http, stream=False, **sampling):
    body = {"text": "Tell me a story", "sampling_params": dict({"max_new_tokens": 64, "temperature": 0}, **sampling),
            "stream": stream}
    if not stream:
        return http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json=body) as response:
        return _sse(response)


def test_stop_regex_ends_trims_and_reports_the_pattern(scripted):
    assert _story(scripted)["text"] == STORY  # the script, then EOS
    cut = _story(scripted, stop_regex=r"t\w+y ")
    assert cut["text"] == STORY[:STORY.index("tiny")]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"t\w+y "}
    kept = _story(scripted, stop_regex=[r"clients?", r"t\w+y "], no_stop_trim=True)
    assert kept["text"] == STORY[:STORY.index("tiny") + len("tiny ")]
    assert kept["meta_info"]["finish_reason"]["matched"] == r"t\w+y "
    stop_kept = _story(scripted, stop="time", no_stop_trim=True)
    assert stop_kept["text"] == STORY[:STORY.index("time") + 4]
    assert stop_kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": "time"}
    unmatched = _story(scripted, stop_regex=r"\d+")
    assert unmatched["text"] == STORY and unmatched["meta_info"]["finish_reason"]["type"] == "stop"


def test_stop_regex_streamed_never_shows_trimmed_text(scripted):
    for sampling, expected in (({"stop_regex": r"t\w+y "}, STORY[:STORY.index("tiny")]),
                               ({"stop_regex": r"m\w+l th", "no_stop_trim": True},
                                STORY[:STORY.index("model") + len("model th")]),
                               ({"stop_regex": r"served \d"}, STORY)):
        events = _story(scripted, stream=True, **sampling)
        texts = [e["text"] for e in events]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, never retracted
        assert texts[-1] == expected
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    # The hold-back: while "served " could still become "served <digit>", it is not shown.
    events = _story(scripted, stream=True, stop_regex=r"served \d")
    shown = [e["text"] for e in events[:-1]]
    assert not any(t.endswith("served") or t.endswith("served ") for t in shown)
