"""Engine behaviour: cached_tokens accounting, retraction, seeded sampling, stops, abort, errors."""
from __future__ import annotations

import asyncio

import pytest

from _engine_helpers import make_checkpoint, shared_prefix_prompts
from radixserve.scheduler import Engine, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, "behaviour", arch="llama")


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 40])
def test_repeat_reports_cached_tokens(ckpt, page_size, prompt_len):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024, page_size=page_size)
    prompt = shared_prefix_prompts(1, prefix_len=prompt_len)[0][:prompt_len]
    params = dict(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    first, = engine.generate([prompt], params)
    second, = engine.generate([prompt], params)
    assert first.cached_tokens == 0
    assert second.cached_tokens == ((prompt_len - 1) // page_size) * page_size
    assert second.output_ids == first.output_ids
    engine.check_integrity()


def test_retraction_keeps_outputs(ckpt):
    prompts = shared_prefix_prompts(8, prefix_len=24, seed=3)
    params = dict(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    big = Engine(ckpt, num_threads=1, kv_cache_tokens=4096)
    expected = [r.output_ids for r in big.generate(prompts, params)]

    small = Engine(ckpt, num_threads=1, kv_cache_tokens=160, page_size=4)  # a few requests' worth
    rids = [small.add_request(p, params) for p in prompts]
    results, streamed = {}, {r: [] for r in rids}
    while small.has_unfinished():
        for d in small.step():
            streamed[d.rid].extend(d.token_ids)
            if d.finished:
                results[d.rid] = d.result
        small.check_integrity()
    assert small.stats()["num_retractions"] >= 1
    for rid, exp in zip(rids, expected):
        assert results[rid].output_ids == exp
        assert streamed[rid] == exp  # streamed tokens are never repeated or lost
    stats = small.stats()
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
    assert small.flush_cache()
    assert small.stats()["free_slots"] == small.stats()["total_slots"]


def test_seed_independent_of_batch_mates(ckpt):
    prompt = shared_prefix_prompts(1, prefix_len=12)[0]
    params = dict(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = Engine(ckpt, num_threads=1, kv_cache_tokens=1024).generate([prompt], params)[0].output_ids
    mates = shared_prefix_prompts(5, prefix_len=20, seed=9)
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024)
    batch = engine.generate(mates + [prompt], [dict(max_new_tokens=12, temperature=1.0, ignore_eos=True)] * 5 + [params])
    assert batch[-1].output_ids == alone
    # A different seed gives different tokens (the test can fail).
    other = Engine(ckpt, num_threads=1, kv_cache_tokens=1024).generate([prompt], dict(params, seed=99))[0].output_ids
    assert other != alone


def test_temperature_zero_and_top_k_one_are_greedy(ckpt):
    prompt = shared_prefix_prompts(1, prefix_len=10)[0]
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024)
    greedy = engine.generate([prompt], dict(max_new_tokens=10, temperature=0.0, ignore_eos=True))[0].output_ids
    topk1 = engine.generate([prompt], dict(max_new_tokens=10, temperature=1.5, top_k=1, ignore_eos=True))[0].output_ids
    assert greedy == topk1


def test_stop_token_ids_and_strings(ckpt):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024)
    prompt = shared_prefix_prompts(1, prefix_len=10)[0]
    free = engine.generate([prompt], dict(max_new_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop_id = free.output_ids[5]
    res = engine.generate([prompt], dict(max_new_tokens=20, temperature=0.0, ignore_eos=True,
                                          stop_token_ids=[stop_id]))[0]
    first = free.output_ids.index(stop_id)
    assert res.finish_reason == "stop" and res.matched_stop == stop_id
    assert res.output_ids == free.output_ids[:first + 1]
    text = free.text
    stop_str = text[len(text) // 2: len(text) // 2 + 3]
    if stop_str.strip():
        res = engine.generate([prompt], dict(max_new_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop_str]))[0]
        assert res.finish_reason == "stop" and res.matched_stop == stop_str
        assert res.text == text[:text.index(stop_str)]


def test_prefix_only_request_caches_prompt(ckpt):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024)
    prompt = shared_prefix_prompts(1, prefix_len=30)[0]
    res = engine.generate([prompt], dict(max_new_tokens=0))[0]
    assert res.completion_tokens == 0 and res.finish_reason == "length"
    again = engine.generate([prompt + [11, 12]], dict(max_new_tokens=2, temperature=0.0))[0]
    assert again.cached_tokens == len(prompt)


def test_prompt_logprobs_match_across_chunks(ckpt):
    prompt = shared_prefix_prompts(1, prefix_len=30)[0]
    params = dict(max_new_tokens=1, temperature=0.0, logprob_start_len=3, logprobs=2)
    whole = Engine(ckpt, num_threads=1, kv_cache_tokens=1024).generate([prompt], params)[0]
    chunked_engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024, chunked_prefill_size=7)
    chunked_engine.generate([prompt[:20]], dict(max_new_tokens=1))  # a cached prefix past the start
    chunked = chunked_engine.generate([prompt], params)[0]
    assert len(whole.prompt_logprobs) == len(prompt) - 3
    assert [lp.token_id for lp in whole.prompt_logprobs] == prompt[3:]
    for a, b in zip(whole.prompt_logprobs, chunked.prompt_logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4


def test_bad_input_is_a_clear_error(ckpt):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=256, context_length=128)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 2, 10**6])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="context length"):
        engine.add_request([5] * 100, dict(max_new_tokens=50))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([5], dict(temperature=-1))
    with pytest.raises(ValueError, match="unknown engine option"):
        Engine(ckpt, num_threads=1, kv_cache_token=5)
    assert not engine.has_unfinished()


def test_stream_abort_frees_kv(ckpt):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024)
    prompt = shared_prefix_prompts(1, prefix_len=20)[0]

    async def consume(n_deltas: int):
        got = []
        async for delta in engine.generate_stream(prompt, dict(max_new_tokens=200, ignore_eos=True)):
            got.append(delta)
            if len(got) == n_deltas:
                break  # the consumer goes away: the request must be aborted
        return got

    got = asyncio.run(consume(3))
    assert len(got) == 3 and not got[-1].finished
    full = asyncio.run(_collect(engine, prompt))
    assert full[-1].finished and full[-1].result.completion_tokens == 5
    for _ in range(200):
        s = engine.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            break
        asyncio.run(asyncio.sleep(0.01))
    s = engine.stats()
    assert s["free_slots"] + s["evictable_slots"] == s["total_slots"] and s["locked_slots"] == 0
    engine.shutdown()


async def _collect(engine, prompt):
    return [d async for d in engine.generate_stream(prompt, SamplingParams(max_new_tokens=5, ignore_eos=True))]


def test_failed_step_still_ends_every_request(ckpt):
    """A step that raises must hand out a final delta for every request it touched: one that
    finished earlier in that step, and one aborted by the caller before it (else a stream hangs)."""
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024)
    prompts = shared_prefix_prompts(3, prefix_len=12)
    greedy = dict(temperature=0.0, ignore_eos=True)
    aborted = engine.add_request(prompts[2], dict(greedy, max_new_tokens=50))
    engine.step()
    engine.abort(aborted)
    short = engine.add_request(prompts[0], dict(greedy, max_new_tokens=1))
    long = engine.add_request(prompts[1], dict(greedy, max_new_tokens=20))
    original = engine._after_item

    def fail_after_a_finish(item):
        original(item)
        if item.req.finished:
            raise RuntimeError("injected failure")

    engine._after_item = fail_after_a_finish
    finals = {d.rid: d.result for d in engine.step() if d.finished}
    engine._after_item = original
    assert set(finals) == {aborted, short, long}
    assert finals[short].finish_reason == "length" and len(finals[short].output_ids) == 1
    assert finals[long].finish_reason == "abort" and "internal error" in finals[long].error
    assert finals[aborted].finish_reason == "abort"
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.generate([prompts[0]], dict(greedy, max_new_tokens=1))[0].output_ids == finals[short].output_ids


class _Id(int):
    """An int subclass (as an IntEnum member would be)."""


@pytest.mark.parametrize("prompt, message", [
    ([1, True, 3], "list of token ids"), ([1, 2.0], "list of token ids"), ([1, "2"], "list of token ids"),
    ([1, [2]], "list of token ids"), (b"\x01\x02", "list of token ids"), ([1, -1], "token id -1 is outside"),
    ([3, 512, 4], "token id 512 is outside the vocabulary \\[0, 512\\)"), ((), "empty"),
])
def test_token_id_prompts_are_checked_whole(ckpt, prompt, message):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=256)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt)
    assert not engine.has_unfinished()


def test_token_ids_of_int_subclasses_and_tuples_are_plain_ints(ckpt):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=256)
    greedy = dict(max_new_tokens=2, temperature=0.0)
    plain = engine.generate([[5, 6, 511]], greedy)[0]
    for prompt in ([_Id(5), 6, _Id(511)], (5, 6, 511)):
        res = engine.generate([prompt], greedy)[0]
        assert res.output_ids == plain.output_ids and res.cached_tokens > 0


def test_generate_with_one_bad_prompt_queues_nothing(ckpt):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=256)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[5, 6, 7], [1, 10**6]], dict(max_new_tokens=2))
    assert not engine.has_unfinished()
    assert engine.step() == []


def test_generate_returns_its_own_results_beside_requests_added_before(ckpt):
    """A request added with add_request that finishes during generate() is not mistaken for one of its results."""
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024)
    params = dict(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request([5, 6, 7], params, rid="before")
    result, = engine.generate([[8, 9, 10]], dict(params, max_new_tokens=6))
    assert len(result.output_ids) == 6
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_rid_stays_taken_until_its_final_delta_is_dispatched(ckpt):
    """Between a step finishing a request and the loop dispatching its final delta, the rid must
    not be reusable: the old final delta would end the new request's stream."""
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=256)
    got = []
    engine.add_request([5, 6, 7], dict(max_new_tokens=1), rid="r", on_delta=got.append)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()  # finishes "r"; nothing dispatches, as in the window before the loop does
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6, 7], dict(max_new_tokens=1), rid="r")
    engine._loop._dispatch(deltas)
    assert got and got[-1].finished
    engine.add_request([5, 6, 7], dict(max_new_tokens=1), rid="r")  # free once dispatched


def test_n_choices_are_one_request_sharing_the_prompt(ckpt):
    """add_choices: one validation and one token list for n choices, named and seeded as separate requests with
    seed + i would be, the prompt computed once and the tree matched once per step for all of them."""
    prompt = shared_prefix_prompts(1, prefix_len=40, seed=5)[0]
    params = dict(max_new_tokens=8, temperature=1.0, seed=77, ignore_eos=True)
    alone = Engine(ckpt, num_threads=1, kv_cache_tokens=1024)
    expected = [alone.generate([prompt], dict(params, seed=77 + i))[0].output_ids for i in range(3)]

    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024, chunked_prefill_size=4096)
    matches, hints = [], []
    real_match, real_hint = engine.kv.tree.match_prefix, engine.kv.hint
    walks = {"now": matches}
    engine.kv.tree.match_prefix = lambda *a, **k: walks["now"].append(engine.step_index) or real_match(*a, **k)

    def hint(waiting):  # the queue's eviction hints walk apart from admission, once per stay in the queue
        walks["now"] = hints
        real_hint(waiting)
        walks["now"] = matches
    engine.kv.hint = hint
    rids = engine.add_choices(prompt, params, n=3, rid="x")
    assert rids == ["x-0", "x-1", "x-2"]
    reqs = [engine.planner.waiting[i] for i in range(3)]
    assert all(r.prompt_ids is reqs[0].prompt_ids for r in reqs)  # one list, not three copies
    results = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                results[d.rid] = d.result
    assert [results[r].output_ids for r in rids] == expected
    prompt_pages = len(prompt) - 1
    assert sorted(results[r].cached_tokens for r in rids) == [0, prompt_pages, prompt_pages]  # computed once
    assert matches and len(matches) == len(set(matches))  # never two walks for the choices in one step
    assert hints == [0]  # one hint walk for the three choices

    engine.add_request([5, 6, 7], dict(params, max_new_tokens=1), rid="z-1")
    with pytest.raises(ValueError, match="'z-1' is already in use"):
        engine.add_choices(prompt, params, n=2, rid="z")  # all or none: z-0 is not queued either
    assert not engine.has_request("z-0")
    with pytest.raises(ValueError, match="n must be"):
        engine.add_choices(prompt, params, n=0)
    engine.abort("z-1")
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_penalties_survive_retraction_and_row_reuse(ckpt):
    """Penalised, seeded requests: with retractions (rows handed back and out again, penalty statistics fed whole
    again) the outputs equal those of a pool where no request is ever retracted."""
    prompts = shared_prefix_prompts(8, prefix_len=24, seed=4)
    params = [dict(max_new_tokens=30, temperature=0.9, seed=100 + i, ignore_eos=True, repetition_penalty=1.4,
                   frequency_penalty=0.3 * (i % 3), presence_penalty=0.2 * (i % 2)) for i in range(8)]
    big = Engine(ckpt, num_threads=1, kv_cache_tokens=4096)
    expected = [big.generate([p], q)[0].output_ids for p, q in zip(prompts, params)]
    small = Engine(ckpt, num_threads=1, kv_cache_tokens=160, page_size=4, max_running_requests=4)
    rids = [small.add_request(p, q) for p, q in zip(prompts, params)]
    results = {}
    while small.has_unfinished():
        for d in small.step():
            if d.finished:
                results[d.rid] = d.result.output_ids
    assert small.stats()["num_retractions"] >= 1
    assert [results[r] for r in rids] == expected
    assert small.runner.penalties.num_updated_rows > small.runner.penalties.num_rebuilt_rows > 8
