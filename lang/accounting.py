"""Cache accounting of programs that ran: achieved hit rate vs the optimal one (ARCHITECTURE §12)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from ..radix.optimal import optimal_hit_rate
from .backend import Backend, RequestRecord
from .state import ProgramState


@dataclass(frozen=True)
class CacheReport:
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float  # Σ cached_tokens / Σ prompt_tokens, from the backend's results
    optimal_hit_rate: float  # §12 optimum of the same prompts, one round per call position

    @property
    def ratio(self) -> float:
        return self.hit_rate / self.optimal_hit_rate if self.optimal_hit_rate else 0.0

    def __str__(self) -> str:
        return (f"{self.num_requests} requests, {self.prompt_tokens} prompt tokens, {self.cached_tokens} cached: "
                f"hit rate {self.hit_rate:.1%}, optimal {self.optimal_hit_rate:.1%} "
                f"(achieved/optimal {self.ratio:.1%})")


def request_rounds(states: Sequence[ProgramState], backend: Backend,
                   first_rounds: Sequence[Sequence[RequestRecord]] = ()) -> list[list[tuple[list[int], list[int]]]]:
    """Rounds of (prompt_ids, output_ids): the k-th backend call of every state is round k
    (the calls that programs running side by side make together); `first_rounds` go before.

    Raises ValueError if the client's tokenization disagrees with the engine's prompt_tokens.
    """
    by_call: dict[int, list[RequestRecord]] = defaultdict(list)
    for state in states:
        for record in state.requests:
            by_call[record.call_idx].append(record)
    ordered = [list(r) for r in first_rounds] + [by_call[k] for k in sorted(by_call)]
    return [[_ids(backend, record) for record in round_records] for round_records in ordered]


def cache_report(states: Sequence[ProgramState], backend: Backend,
                 first_rounds: Sequence[Sequence[RequestRecord]] = ()) -> CacheReport:
    records = [r for rnd in first_rounds for r in rnd] + [r for s in states for r in s.requests]
    prompt_tokens = sum(r.output.prompt_tokens for r in records)
    cached_tokens = sum(r.output.cached_tokens for r in records)
    return CacheReport(num_requests=len(records), prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                       hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
                       optimal_hit_rate=optimal_hit_rate(request_rounds(states, backend, first_rounds)))


def _ids(backend: Backend, record: RequestRecord) -> tuple[list[int], list[int]]:
    prompt_ids = backend.encode(record.prompt)
    if len(prompt_ids) != record.output.prompt_tokens:
        raise ValueError(f"the client tokenizes a prompt into {len(prompt_ids)} tokens but the engine reported "
                         f"{record.output.prompt_tokens}; hit rates would not be comparable")
    return prompt_ids, list(record.output.output_ids)
