"""The optimal prefix-cache hit rate of a workload (ARCHITECTURE §12).

Model: page size 1, an infinite cache, and the best order within each round of requests that are
available together. A round's prompts must compute every token they add to the trie of everything
that came before (earlier rounds' prompts *and* their generated outputs, plus this round's prompts
already processed), and a prompt whose full sequence is already in that trie still computes one
token: its last token's logits are needed to sample.

Best order within a round: shortest prompt first. The tokens a round adds (the union of its
prompts) do not depend on the order; the only order-dependent cost is the "+1" of a prompt that is
fully contained in the trie when it runs. Going shortest first, a prompt can only be contained in
an earlier prompt of the same round if the two are identical, which no order avoids.

Achieved / optimal > 1 means a bug in the engine's accounting or in this function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

# One request of a round: (prompt_ids, output_ids) or (prompt_ids, output_ids, cache_salt).
RoundItem = tuple


@dataclass(frozen=True)
class OptimalCounts:
    computed_tokens: int  # prompt tokens that must be computed even with the best order
    prompt_tokens: int  # all prompt tokens sent

    @property
    def hit_rate(self) -> float:
        if self.prompt_tokens == 0:
            return 0.0
        return 1.0 - self.computed_tokens / self.prompt_tokens


@dataclass(frozen=True)
class Computed:
    """What one request computes under the §12 optimum: prompt positions [start, prompt_len), then its outputs."""

    start: int
    prompt_len: int
    output_len: int


def computed_spans(rounds: Iterable[Sequence[RoundItem]]) -> list[list[Computed]]:
    """Per round, per request (in the best order: shortest prompt first), the positions it must compute.

    rounds: a list of rounds, each a list of (prompt_ids, output_ids[, cache_salt]). Requests with
    different salts never share (a separate trie per salt).
    """
    tries: dict[object, _Trie] = {}
    spans = []
    for round_items in rounds:
        items = [_unpack(item) for item in round_items]
        spans.append([])
        for prompt_ids, output_ids, salt in sorted(items, key=lambda it: len(it[0])):
            if len(prompt_ids) == 0:
                raise ValueError("a prompt must hold at least one token")
            num_added = tries.setdefault(salt, _Trie()).insert(prompt_ids)
            # A prompt fully in the trie still computes its last token.
            start = len(prompt_ids) - max(num_added, 1)
            spans[-1].append(Computed(start, len(prompt_ids), len(output_ids)))
        # Outputs become reusable only from the next round on (they do not exist before the
        # round runs).
        for prompt_ids, output_ids, salt in items:
            tries[salt].insert(list(prompt_ids) + list(output_ids))
    return spans


def optimal_counts(rounds: Iterable[Sequence[RoundItem]]) -> OptimalCounts:
    """Computed and total prompt tokens of `rounds` under the §12 optimum (see computed_spans)."""
    spans = [c for round_spans in computed_spans(rounds) for c in round_spans]
    return OptimalCounts(computed_tokens=sum(c.prompt_len - c.start for c in spans),
                         prompt_tokens=sum(c.prompt_len for c in spans))


def optimal_hit_rate(rounds: Iterable[Sequence[RoundItem]]) -> float:
    """1 − computed / prompt tokens under the §12 optimum (0.0 for an empty workload)."""
    return optimal_counts(rounds).hit_rate


def distinct_tokens(rounds: Iterable[Sequence[RoundItem]]) -> int:
    """Number of distinct token positions (trie nodes) over all prompts and outputs.

    This is the KV a cache would need to hold the whole workload at once (§12 budgets).
    """
    tries: dict[object, _Trie] = {}
    for round_items in rounds:
        for item in round_items:
            prompt_ids, output_ids, salt = _unpack(item)
            tries.setdefault(salt, _Trie()).insert(list(prompt_ids) + list(output_ids))
    return sum(trie.num_nodes for trie in tries.values())


class _Trie:
    """A token trie of nested dicts; only node counts matter here."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}
        self.num_nodes = 0

    def insert(self, token_ids: Sequence[int]) -> int:
        """Insert a sequence; return how many new nodes it added."""
        node = self.root
        num_added = 0
        for token_id in token_ids:
            child = node.get(token_id)
            if child is None:
                child = {}
                node[token_id] = child
                num_added += 1
            node = child
        self.num_nodes += num_added
        return num_added


def _unpack(item: RoundItem) -> tuple[Sequence[int], Sequence[int], object]:
    if len(item) == 2:
        prompt_ids, output_ids = item
        return prompt_ids, output_ids, None
    if len(item) == 3:
        return item[0], item[1], item[2]
    raise ValueError("a round item is (prompt_ids, output_ids) or (prompt_ids, output_ids, cache_salt)")
