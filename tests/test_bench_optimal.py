"""Hand-worked examples of the §12 optimal hit rate."""
import pytest

from radixserve.radix.optimal import distinct_tokens, optimal_counts, optimal_hit_rate


def test_single_prompt_computes_everything():
    counts = optimal_counts([[([1, 2, 3, 4, 5], [6, 7])]])
    assert (counts.computed_tokens, counts.prompt_tokens) == (5, 5)
    assert optimal_hit_rate([[([1, 2, 3, 4, 5], [6, 7])]]) == 0.0


def test_identical_prompts_in_one_round_compute_len_plus_one():
    prompt = [1, 2, 3, 4]
    counts = optimal_counts([[(prompt, [9]), (prompt, [9])]])
    assert counts.computed_tokens == 4 + 1
    assert counts.prompt_tokens == 8
    assert counts.hit_rate == pytest.approx(1 - 5 / 8)


def test_three_identical_prompts_each_repeat_computes_one():
    prompt = [5, 6, 7]
    counts = optimal_counts([[(prompt, []), (prompt, []), (prompt, [])]])
    assert counts.computed_tokens == 3 + 1 + 1


def test_next_round_extends_prompt_and_output():
    # Round 1: prompt [1,2,3] generated [4,5]; round 2 sends [1,2,3,4,5,6,7]: only 6 and 7 are new.
    rounds = [[([1, 2, 3], [4, 5])], [([1, 2, 3, 4, 5, 6, 7], [8])]]
    counts = optimal_counts(rounds)
    assert counts.computed_tokens == 3 + 2
    assert counts.prompt_tokens == 3 + 7
    assert optimal_hit_rate(rounds) == pytest.approx(1 - 5 / 10)


def test_outputs_are_not_reusable_within_their_own_round():
    # Same round: the second prompt contains the first one's output, which does not exist yet.
    counts = optimal_counts([[([1, 2], [3]), ([1, 2, 3, 4], [5])]])
    # Shortest first: [1,2] computes 2, then [1,2,3,4] adds 3 and 4.
    assert counts.computed_tokens == 4


def test_prompt_fully_cached_by_earlier_round_computes_one():
    # Round 2's prompt is a prefix of round 1's prompt + output: only its last token is computed.
    rounds = [[([1, 2, 3], [4, 5])], [([1, 2, 3, 4], [6])]]
    assert optimal_counts(rounds).computed_tokens == 3 + 1


def test_partial_overlap_within_a_round():
    # Shared prefix [1,2,3] then diverging tails of 2 and 3 tokens.
    rounds = [[([1, 2, 3, 10, 11], [0]), ([1, 2, 3, 20, 21, 22], [0])]]
    counts = optimal_counts(rounds)
    assert counts.computed_tokens == 3 + 2 + 3
    assert counts.prompt_tokens == 11


def test_best_order_runs_a_prefix_prompt_before_its_extension():
    # [1,2,3] is a prefix of [1,2,3,4]: shorter first costs 3 + 1, never 4 + 1.
    rounds = [[([1, 2, 3, 4], [0]), ([1, 2, 3], [0])]]
    assert optimal_counts(rounds).computed_tokens == 4


def test_partial_overlap_with_an_earlier_round_output():
    # Round 2 shares [1,2,3,4] with round 1's prompt+output, then diverges at the second output token.
    rounds = [[([1, 2, 3], [4, 5])], [([1, 2, 3, 4, 9, 9], [0]), ([7, 8], [0])]]
    counts = optimal_counts(rounds)
    assert counts.computed_tokens == 3 + 2 + 2
    assert counts.prompt_tokens == 3 + 6 + 2


def test_salts_never_share():
    prompt = [1, 2, 3, 4]
    counts = optimal_counts([[(prompt, [], "a"), (prompt, [], "b")]])
    assert counts.computed_tokens == 8
    same = optimal_counts([[(prompt, [], "a"), (prompt, [], "a")]])
    assert same.computed_tokens == 5


def test_shared_system_prompt_closed_form():
    # G groups of P prompts: system Ls shared, question Lq each. computed = G * (Ls + P * Lq).
    num_groups, per_group, sys_len, q_len = 3, 4, 50, 7
    rounds = [[]]
    next_id = 1000
    for g in range(num_groups):
        system = [g * 100 + i for i in range(sys_len)]  # distinct across groups (first token differs)
        for _ in range(per_group):
            question = list(range(next_id, next_id + q_len))
            next_id += q_len
            rounds[0].append((system + question, [1]))
    counts = optimal_counts(rounds)
    assert counts.computed_tokens == num_groups * (sys_len + per_group * q_len)
    assert counts.prompt_tokens == num_groups * per_group * (sys_len + q_len)


def test_distinct_tokens_counts_prompts_and_outputs():
    rounds = [[([1, 2, 3], [4, 5]), ([1, 2, 7], [8])], [([1, 2, 3, 4, 5, 6], [9])]]
    # Trie: 1-2-3-4-5-6-9 (7 nodes) plus 7-8 under 1-2 (2 nodes).
    assert distinct_tokens(rounds) == 9


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError):
        optimal_counts([[([], [1])]])
