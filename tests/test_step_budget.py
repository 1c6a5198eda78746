"""scheduler/step_budget.StepBudget: the whole chunk for one tenant; a decode step's worth of prompt while tenants
share the engine, never below the first request's prompt; back to the chunk once the other tenant has been gone
SHARED_WINDOW_STEPS steps."""
from radixserve.scheduler.step_budget import SHARED_WINDOW_STEPS, StepBudget


def _budget() -> StepBudget:
    budget = StepBudget(chunked_prefill_size=512, page_size=1)
    budget.observe(prefill_tokens=0, forward_s=0.040)  # a 40 ms decode-only step
    budget.observe(prefill_tokens=64, forward_s=0.200)  # steps with prefill are not averaged
    return budget


def test_one_tenant_does_not_share():
    assert not _budget().shared(0, ["a"])


def test_shared_steps_take_one_decode_steps_worth_but_the_first_prompts_whole():
    budget = _budget()
    assert budget.decode_step_s == 0.040 and budget.shared(0, ["a", "b"])
    assert budget.tokens(head_uncached=8, prefill_s_per_token=2e-3) == 20  # 40 ms / 2 ms
    assert budget.tokens(head_uncached=64, prefill_s_per_token=2e-3) == 64  # the leading prompts in one step
    assert budget.tokens(head_uncached=4096, prefill_s_per_token=2e-3) == 512  # never above the chunk
    assert budget.num_shared_steps == 3


def test_while_another_tenant_waits_a_step_computes_only_the_leading_prompts():
    """The light tenant's request leads and the heavy tenant's wait behind it: its step is a decode step plus its
    8 tokens, not plus 12 of the heavy tenant's as well; with nobody waiting (0) the timed budget still runs."""
    budget = _budget()
    assert budget.tokens(head_uncached=8, prefill_s_per_token=2e-3, others_wait=True) == 8
    assert budget.tokens(head_uncached=4096, prefill_s_per_token=2e-3, others_wait=True) == 512
    assert budget.tokens(head_uncached=0, prefill_s_per_token=2e-3, others_wait=True) == 20


def test_a_tenant_that_left_still_shares_for_a_window():
    budget = _budget()
    assert budget.shared(0, ["a", "b"])
    assert budget.shared(SHARED_WINDOW_STEPS, ["a"])  # b may come back any moment
    assert not budget.shared(SHARED_WINDOW_STEPS + 1, ["a"])


def test_nothing_measured_yet_means_no_shared_budget():
    budget = StepBudget(chunked_prefill_size=512, page_size=1)
    assert not budget.shared(0, ["a", "b"])
