"""Sampling: greedy equivalences, seeded determinism, support filters, penalties, logprobs."""
from __future__ import annotations

import sys

import pytest
import torch

from kernels_fixtures import drive, make_checkpoint, make_prompts
from kernels_fixtures import single_thread  # noqa: F401  (fixture)
from radixserve.kernels import ModelRunner, SeqInput
from radixserve.kernels.forward_io import GREEDY, PenaltyTokens, RowSampling
from radixserve.kernels.sampling import adjust_logits, sample_next_tokens
from radixserve.kernels.sampling_noise import gumbel_noise
from radixserve.scheduler.req import Req
from radixserve.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")
VOCAB = 50


def _seq(params: SamplingParams | RowSampling | None, seed: int = 0, output_ids=(), prompt_ids=(), banned=(), top=0):
    sampling = params.row_sampling() if isinstance(params, SamplingParams) else params or GREEDY
    feed = PenaltyTokens(True, tuple(prompt_ids), tuple(output_ids)) if sampling.penalised else None
    return SeqInput(input_ids=[1], prefix_len=0, row=0, new_slots=[0], slot_offset=0, new_row=True, sample=True,
                    sampling=sampling, sampling_seed=seed, sample_index=len(output_ids), penalty_tokens=feed,
                    banned_ids=tuple(banned), num_top_logprobs=top)


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(probs: list[float], params: SamplingParams, num_seeds: int) -> torch.Tensor:
    """Tokens drawn for one logits row under `num_seeds` different seeds (one batch)."""
    row = torch.log(torch.tensor(probs))
    seqs = [_seq(params, seed=s) for s in range(num_seeds)]
    tokens, _ = sample_next_tokens(row.expand(num_seeds, -1).clone(), seqs)
    return torch.tensor(tokens)


def test_temperature_zero_and_top_k_one_are_argmax():
    logits = _logits(6)
    seqs = [_seq(SamplingParams(temperature=0.0), seed=i) for i in range(3)]
    seqs += [_seq(SamplingParams(temperature=1.5, top_k=1), seed=i) for i in range(3)]
    tokens, _ = sample_next_tokens(logits, seqs)
    assert tokens == logits.argmax(dim=-1).tolist()
    tokens_none, _ = sample_next_tokens(logits, [_seq(None) for _ in range(6)])
    assert tokens_none == logits.argmax(dim=-1).tolist()


def test_seeded_tokens_do_not_depend_on_batch_mates():
    logits = _logits(5, seed=1)
    target = _seq(SamplingParams(temperature=1.0, top_p=0.9), seed=1234, output_ids=[5, 6, 7])
    alone, _ = sample_next_tokens(logits[2:3], [target])
    mates = [_seq(SamplingParams(temperature=0.7), seed=s) for s in (1, 2, 3, 4)]
    mixed, _ = sample_next_tokens(logits, mates[:2] + [target] + mates[2:])
    assert mixed[2] == alone[0]
    # The randomness moves with the output position and the seed.
    rows = logits[2:3].expand(40, -1).clone()
    by_position = [_seq(target.sampling, seed=1234, output_ids=[0] * n) for n in range(20)]
    by_seed = [_seq(target.sampling, seed=s, output_ids=[5, 6, 7]) for s in range(20)]
    tokens, _ = sample_next_tokens(rows, by_position + by_seed)
    assert len(set(tokens[:20])) > 1 and len(set(tokens[20:])) > 1


def test_noise_is_a_pure_function_of_seed_and_position():
    a = gumbel_noise([7, -3, 2**63 - 1], [0, 5, 9], VOCAB, "cpu")
    b = gumbel_noise([2**63 - 1, 7], [9, 0], VOCAB, "cpu")
    assert torch.equal(a[2], b[0]) and torch.equal(a[0], b[1])
    assert not torch.equal(a[0], gumbel_noise([7], [1], VOCAB, "cpu")[0])
    assert torch.isfinite(a).all()


def test_sampling_follows_the_distribution():
    probs = [0.5, 0.3, 0.15, 0.05]
    tokens = _draws(probs, SamplingParams(temperature=1.0), 4000)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, torch.tensor(probs), atol=0.03), freq


@pytest.mark.parametrize("params, support", [
    (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
    (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),  # mass before token 2 is 0.8 >= 0.7
    (SamplingParams(temperature=1.0, min_p=0.4), {0, 1}),  # threshold 0.4 * 0.5 = 0.2
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.9), {0, 1, 2}),
])
def test_filters_restrict_the_support(params, support):
    tokens = set(_draws([0.5, 0.3, 0.15, 0.05], params, 600).tolist())
    assert tokens == support


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, -1.0, 1.5
    seq = _seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt_ids=[3], output_ids=[4, 4])
    out = adjust_logits(logits, [seq])
    expected = logits.clone()
    expected[0, 3], expected[0, 4] = 1.0, -2.0
    assert torch.equal(out, expected)
    assert sample_next_tokens(logits, [seq])[0] == [5]  # token 3 lost its lead


def test_frequency_and_presence_penalties_use_output_counts():
    logits = _logits(2)
    seq = _seq(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt_ids=[9, 9],
               output_ids=[1, 1, 1, 2])
    untouched = _seq(SamplingParams())
    out = adjust_logits(logits, [seq, untouched])
    delta = out - logits
    assert delta[0, 1].item() == pytest.approx(-(3 * 0.5 + 0.25))
    assert delta[0, 2].item() == pytest.approx(-(0.5 + 0.25))
    assert delta[0, 9].item() == 0.0  # prompt tokens do not count
    assert torch.count_nonzero(delta[0]) == 2 and torch.count_nonzero(delta[1]) == 0


def test_min_new_tokens_masks_eos_and_stop_tokens():
    """The scheduler's rule (Req.banned_ids) and the sampler's mask together."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 2], logits[0, 7], logits[0, 8] = 9.0, 8.0, 1.0  # EOS, stop token, plain
    params = SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[7], ignore_eos=True)
    early_req = Req(rid="a", prompt_ids=[1], params=params, seed=0, arrival_step=0, arrival_time=0.0,
                    output_ids=[1, 1])
    done_req = Req(rid="b", prompt_ids=[1], params=params, seed=0, arrival_step=0, arrival_time=0.0,
                   output_ids=[1, 1, 1])
    early = _seq(params, output_ids=[1, 1], banned=early_req.banned_ids((2,)))
    done = _seq(params, output_ids=[1, 1, 1], banned=done_req.banned_ids((2,)))
    assert early.banned_ids == (2, 7) and done.banned_ids == ()
    early_req.grammar = object()  # a grammar decides when its stop token may come
    assert early_req.banned_ids((2,)) == ()
    tokens, _ = sample_next_tokens(logits.expand(2, -1).clone(), [early, done])
    assert tokens == [8, 2]
    masked = adjust_logits(logits, [early])
    assert torch.isinf(masked[0, [2, 7]]).all() and masked[0, 8] == 1.0


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = _logits(3, seed=4)
    params = SamplingParams(temperature=0.8, logprobs=3, repetition_penalty=1.5)
    seqs = [_seq(params, seed=1, top=3, prompt_ids=[1, 2, 3]), _seq(SamplingParams(temperature=0.0)),
            _seq(SamplingParams(temperature=0.0, logprobs=0))]
    tokens, logprobs = sample_next_tokens(logits, seqs)
    ref = torch.log_softmax(logits, dim=-1)
    assert logprobs[1] is None
    for row in (0, 2):
        lp = logprobs[row]
        assert lp.token_id == tokens[row]
        assert lp.logprob == pytest.approx(ref[row, tokens[row]].item(), abs=1e-6)
    values, ids = ref[0].topk(3)
    assert [t for t, _ in logprobs[0].top] == ids.tolist()
    assert [v for _, v in logprobs[0].top] == pytest.approx(values.tolist(), abs=1e-6)
    assert logprobs[2].top == []


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama_sampling"), "llama", seed=5)


def test_runner_seeded_sampling_ignores_batch_mates_and_chunking(llama_path):
    runner = ModelRunner(llama_path, num_slots=512, attention_backend="torch", device="cpu")
    prompts = make_prompts(3, shared_len=6, tail_lens=[10, 4, 15], vocab=256, seed=9)
    params = [SamplingParams(temperature=1.0, top_p=0.95), SamplingParams(temperature=0.7, top_k=20),
              SamplingParams(temperature=1.2, min_p=0.05)]
    seeds = [101, 202, 303]
    together, _ = drive(runner, [list(p) for p in prompts], [len(p) for p in prompts], 12, forced=False,
                        sampling=params, seeds=seeds, chunk=5)
    alone, _ = drive(runner, [list(prompts[1])], [len(prompts[1])], 12, forced=False,
                     sampling=[params[1]], seeds=[seeds[1]], chunk=64, slot_seed=1)
    assert alone[0].output == together[1].output
    other_seed, _ = drive(runner, [list(prompts[1])], [len(prompts[1])], 12, forced=False,
                          sampling=[params[1]], seeds=[999], slot_seed=2)
    assert other_seed[0].output != together[1].output


def test_runner_prompt_logprobs_cover_chunks_without_gaps(llama_path):
    from kernels_fixtures import hf_logits, load_hf
    runner = ModelRunner(llama_path, num_slots=64, attention_backend="torch", device="cpu")
    prompt = make_prompts(1, shared_len=0, tail_lens=[17], vocab=256, seed=2)[0]
    start, cut = 3, 9
    slots = list(range(40, 40 + len(prompt)))
    chunks = [(0, prompt[:cut]), (cut, prompt[cut:])]
    got = []
    for prefix, ids in chunks:
        seq = SeqInput(input_ids=ids, prefix_len=prefix, row=0, new_slots=slots[prefix:prefix + len(ids)],
                       slot_offset=prefix, new_row=prefix == 0,
                       sample=prefix + len(ids) == len(prompt), sampling=GREEDY,
                       prompt_logprob_start=start, num_top_logprobs=2,
                       lookahead_id=prompt[prefix + len(ids)] if prefix + len(ids) < len(prompt) else None)
        got.extend(runner.forward([seq])[0].prompt_logprobs)
    ref = torch.log_softmax(hf_logits(load_hf(llama_path), prompt), dim=-1)
    assert [lp.token_id for lp in got] == prompt[start:]
    for pos, lp in zip(range(start, len(prompt)), got):
        assert lp.logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[pos - 1].topk(2).indices.tolist()


def test_bf16_logits_sample_as_their_float32_values():
    logits = _logits(6, seed=3).bfloat16()
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=7, top_p=0.8),
             SamplingParams(temperature=1.2, repetition_penalty=1.4, frequency_penalty=0.3),
             SamplingParams(temperature=0.0, logprobs=2, presence_penalty=0.5)]
    seqs = [_seq(kinds[i % 4], seed=i, output_ids=[1, 2, 2], prompt_ids=[4, 5], top=2) for i in range(6)]
    tokens, logprobs = sample_next_tokens(logits, seqs, native=True)
    assert (tokens, logprobs) == sample_next_tokens(logits.float(), seqs, native=True)
    assert torch.equal(adjust_logits(logits, seqs), adjust_logits(logits.float(), seqs))


def test_large_batches_run_in_blocks_with_the_same_tokens(monkeypatch):
    from radixserve.kernels import sampling
    logits = _logits(7, seed=5)
    kinds = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.8, top_p=0.7),
             SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.3)]
    seqs = [_seq(kinds[i % 3], seed=i, output_ids=[i], prompt_ids=[3], top=1) for i in range(7)]
    whole = sample_next_tokens(logits, seqs)
    calls = []
    block = sampling._sample_block
    monkeypatch.setattr(sampling, "_sample_block", lambda lg, *a: calls.append(lg.shape[0]) or block(lg, *a))
    monkeypatch.setattr(sampling, "_BLOCK_LOGITS", 3 * VOCAB)
    assert sample_next_tokens(logits, seqs) == whole and calls == [3, 3, 1]
    greedy = [_seq(SamplingParams(temperature=0.0)) for _ in range(7)]  # a plain argmax: no blocks
    assert sample_next_tokens(logits, greedy)[0] == logits.argmax(dim=-1).tolist() and calls[3:] == [7]


@pytest.mark.parametrize("xgrammar_kernel", [True, False])
def test_grammar_masks_on_some_rows_and_past_the_mask_width(xgrammar_kernel, monkeypatch):
    from radixserve.kernels.sampling import unpack_bitmask
    if not xgrammar_kernel:
        monkeypatch.setitem(sys.modules, "xgrammar", None)  # import fails: the unpacking path
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 70, generator=gen)
    masks = torch.randint(-2**31, 2**31 - 1, (4, 2), generator=gen, dtype=torch.int64).to(torch.int32)  # 64 ids
    seqs = [_seq(SamplingParams(temperature=0.0)) for _ in range(4)]
    for i in (0, 2):
        seqs[i].token_bitmask = masks[i]
    out = adjust_logits(logits, seqs)
    expected = logits.clone()
    expected[[0, 2]] = logits[[0, 2]].masked_fill(~unpack_bitmask(masks[[0, 2]], 70), float("-inf"))
    assert torch.equal(out, expected) and torch.isinf(out[[0, 2], 64:]).all()
    assert torch.equal(out[[1, 3]], logits[[1, 3]])
