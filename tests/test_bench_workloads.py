"""Bench workloads: seeded, reproducible, shaped as issue 4 defines them."""
import pytest

from radixserve.bench.harness import decode_room, estimate_distinct_tokens, kv_budget
from radixserve.radix.optimal import optimal_counts
from radixserve.bench.workloads import SIZES, TOKEN_HI, TOKEN_LO, WORKLOAD_NAMES, make_workload


def drive(workload, output_of=lambda req: [11] * req.max_new_tokens):
    outputs, rounds = {}, []
    for idx in range(workload.num_rounds):
        items = []
        for req in workload.make_round(idx, outputs).requests:
            outputs[req.key] = output_of(req)
            items.append((req.prompt_ids, outputs[req.key]))
        rounds.append(items)
    return rounds


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
@pytest.mark.parametrize("size", SIZES)
def test_workloads_are_reproducible_and_in_range(name, size):
    first = drive(make_workload(name, size, seed=3))
    again = drive(make_workload(name, size, seed=3))
    other = drive(make_workload(name, size, seed=4))
    assert first == again
    assert first != other
    for items in first:
        for prompt, _ in items:
            assert all(TOKEN_LO <= t < TOKEN_HI for t in prompt)


def test_full_sizes_match_issue_4():
    gsp = drive(make_workload("gsp", "full"))
    assert len(gsp) == 1 and len(gsp[0]) == 64
    assert {len(p) for p, _ in gsp[0]} == {1024 + 64}
    assert len(drive(make_workload("gsp1000", "full"))[0][0][0]) == 1064
    few = drive(make_workload("fewshot", "full"))[0]
    assert len(few) == 64 and {len(p) for p, _ in few} == {1550} and {len(o) for _, o in few} == {8}
    multi = drive(make_workload("multiturn", "full"))
    assert [len(r) for r in multi] == [8] * 4
    assert [len(multi[t][0][0]) for t in range(4)] == [128, 128 + 32 + 128, 2 * 160 + 128, 3 * 160 + 128]
    react = drive(make_workload("react", "full"))
    assert [len(r) for r in react] == [8] * 6
    tot = drive(make_workload("tot", "full"))
    assert [len(r) for r in tot] == [3, 9, 27]


def test_next_round_carries_the_actual_outputs():
    workload = make_workload("multiturn", "tiny")
    rounds = drive(workload, output_of=lambda req: [3000 + len(req.prompt_ids) % 7] * req.max_new_tokens)
    prompt0, out0 = rounds[0][0]
    prompt1, _ = rounds[1][0]
    assert prompt1[:len(prompt0) + len(out0)] == prompt0 + out0


def test_gsp_is_shuffled_and_tot_children_extend_their_parent():
    gsp = drive(make_workload("gsp", "tiny"))[0]
    heads = [tuple(p[:10]) for p, _ in gsp]
    runs = sum(1 for a, b in zip(heads, heads[1:]) if a != b)
    assert runs > len(set(heads)) - 1  # groups interleave
    tot = drive(make_workload("tot", "tiny"))
    parent, parent_out = tot[0][0]
    children = [p for p, _ in tot[1] if p[:len(parent) + len(parent_out)] == parent + parent_out]
    assert len(children) == 3


def test_budget_helpers():
    rounds = drive(make_workload("gsp", "tiny"))
    assert decode_room(rounds, max_running_requests=5) == 5 * 4
    distinct = estimate_distinct_tokens(lambda: make_workload("gsp", "tiny"))
    counts = optimal_counts(rounds)
    assert distinct == counts.computed_tokens + 4 * len(rounds[0])  # computed prompts + outputs
    assert kv_budget(distinct, 0.5, 20) == round(0.5 * distinct) + 20
    assert kv_budget(100, 0.25, 3, page_size=16) == 32


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("chat", "full")
    with pytest.raises(ValueError, match="unknown size"):
        make_workload("gsp", "huge")
