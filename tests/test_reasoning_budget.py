"""The engine's reasoning budget (scheduler/reasoning_budget.py) on the scripted thinking model: the reasoning is cut
at N tokens, the end tag is forced, the answer follows, and the KV accounting holds."""
from __future__ import annotations

import pytest

from _http_server import THINK_ANSWER, THINK_REASONING, THINK_SCRIPT, scripted_model_path
from radixserve.bench.soak_checks import idle_violations
from radixserve.frontend.reasoning import FORCED_CLOSE, OPEN_TAG, ReasoningSplitter, resolve_syntax
from radixserve.scheduler import Engine, SamplingParams

PROMPT = "<|im_start|>user\nPlease count to four.<|im_end|>\n<|im_start|>assistant\n"
QWEN3 = resolve_syntax("qwen3", None)


@pytest.fixture(scope="module")
def engine():
    with Engine(scripted_model_path(), kv_cache_tokens=2048, num_threads=1) as eng:
        yield eng


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=64, temperature=0.0, **kw)


def _split(text: str) -> tuple[str, str]:
    s = ReasoningSplitter(QWEN3, False)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


def test_no_budget_is_the_script(engine):
    [r] = engine.generate(PROMPT, _params())
    assert r.text == THINK_SCRIPT and r.finish_reason == "stop"
    assert _split(r.text) == (THINK_REASONING, THINK_ANSWER)


@pytest.mark.parametrize("budget", [6, 9, 14])
def test_budget_forces_the_end_tag_and_the_answer_follows(engine, budget):
    plain = engine.generate(PROMPT, _params())[0]
    end_ids = engine.tokenizer.encode(FORCED_CLOSE, add_special_tokens=False)
    [r] = engine.generate(PROMPT, _params(reasoning_budget=budget, reasoning_end=FORCED_CLOSE,
                                          reasoning_open=OPEN_TAG))
    # The first `budget` tokens are the model's, then the forced end tag, then the model's answer.
    assert r.output_ids[:budget] == plain.output_ids[:budget]
    assert r.output_ids[budget:budget + len(end_ids)] == end_ids
    reasoning, answer = _split(r.text)
    assert answer == THINK_ANSWER and r.finish_reason == "stop"
    assert THINK_REASONING.startswith(reasoning) and len(reasoning) < len(THINK_REASONING)
    engine.check_integrity()
    assert idle_violations(engine.stats()) == []


def test_budget_is_not_applied_once_the_model_closed_or_never_opened(engine):
    big = engine.generate(PROMPT, _params(reasoning_budget=40, reasoning_end=FORCED_CLOSE, reasoning_open=OPEN_TAG))
    assert big[0].text == THINK_SCRIPT  # closed on its own within the budget
    never = engine.generate(PROMPT, _params(reasoning_budget=2, reasoning_end=FORCED_CLOSE, reasoning_open="<reason>"))
    assert never[0].text == THINK_SCRIPT  # the output did not open with the tag: no reasoning to cut


def test_budget_from_the_first_token_when_the_prompt_opened_the_block(engine):
    [r] = engine.generate(PROMPT, _params(reasoning_budget=3, reasoning_end=FORCED_CLOSE))
    end_ids = engine.tokenizer.encode(FORCED_CLOSE, add_special_tokens=False)
    assert r.output_ids[3:3 + len(end_ids)] == end_ids and r.text.endswith(THINK_ANSWER)


def test_forced_tokens_count_against_max_tokens_and_carry_logprobs(engine):
    [r] = engine.generate(PROMPT, _params(reasoning_budget=6, reasoning_end=FORCED_CLOSE, reasoning_open=OPEN_TAG,
                                          logprobs=2))
    assert len(r.logprobs) == len(r.output_ids)
    assert [lp.logprob for lp in r.logprobs[6:8]] == [0.0, 0.0]
    [cut] = engine.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0, reasoning_budget=6,
                                                   reasoning_end=FORCED_CLOSE, reasoning_open=OPEN_TAG))
    assert len(cut.output_ids) == 8 and cut.finish_reason == "length"
    engine.check_integrity()
    assert idle_violations(engine.stats()) == []


@pytest.mark.parametrize("kw, match", [
    (dict(reasoning_budget=0, reasoning_end="</think>"), "reasoning_budget"),
    (dict(reasoning_budget=5), "reasoning_end"),
    (dict(reasoning_budget=5, reasoning_end="  "), "reasoning_end"),
    (dict(reasoning_budget="5", reasoning_end="</think>"), "reasoning_budget"),
])
def test_bad_budget_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_a_grammar_waits_for_the_answer(engine):
    """A response format constrains the answer only: held while the output reasons, it takes up after </think>."""
    pattern = r"\s*It is four\."
    [held] = engine.generate(PROMPT, _params(regex=pattern, reasoning_end=FORCED_CLOSE))
    assert held.text == THINK_SCRIPT and _split(held.text) == (THINK_REASONING, THINK_ANSWER)
    [strict] = engine.generate(PROMPT, _params(regex=pattern))  # without the gate the grammar forbids <think>
    assert strict.text.strip() == THINK_ANSWER
    [cut] = engine.generate(PROMPT, _params(regex=pattern, reasoning_end=FORCED_CLOSE, reasoning_budget=9))
    assert _split(cut.text)[1] == THINK_ANSWER and len(_split(cut.text)[0]) < len(THINK_REASONING)
    engine.check_integrity()
    assert idle_violations(engine.stats()) == []
