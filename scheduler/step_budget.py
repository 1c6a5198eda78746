"""How many prompt tokens a step computes (ARCHITECTURE §5; issue 41).

One tenant alone: `chunked_prefill_size`, as before. While tenants share the engine (fair share on, and a tenant
other than this step's had work within the last SHARED_WINDOW_STEPS steps), a step's prefill is cut to what takes
about as long as a decode step (measured: the moving averages of decode-only steps and of the prefill cost per
token), but never below the uncached prompts of the leading requests in admission order (the first, and while
other tenants wait too, the ones of its tenant before any other's: a light tenant's pair), so their first tokens
come from one step; while other tenants wait, no more than those either (and only their tenant's chunked prompts
go on), so that step is short too. A light tenant's request waits for the step in flight, then for its own (the
two steps issue 41's target allows): both are short now, where a heavy tenant's 512-token chunk made either take
up to 8x a decode step on model L with one thread (light p99 TTFT 877 ms, alone + 2 steps 486 ms). The cost is
the weights read once more per step in prefill-bound stretches, only while tenants share.
"""
from __future__ import annotations

from typing import Iterable

SHARED_WINDOW_STEPS = 256  # a tenant with work this many steps ago still shares the engine
DECODE_EMA = 0.1  # weight of the newest decode-only step in its moving average


class StepBudget:
    def __init__(self, chunked_prefill_size: int, page_size: int) -> None:
        self.chunked_prefill_size = chunked_prefill_size
        self.page_size = page_size
        self.decode_step_s: float | None = None  # moving average of decode-only forwards
        self._active: dict[str, int] = {}  # tenant -> the last step it had work
        self.num_shared_steps = 0  # steps planned with the shared budget

    def observe(self, prefill_tokens: int, forward_s: float) -> None:
        """A step's forward time; decode-only steps are averaged."""
        if prefill_tokens == 0 and forward_s > 0:
            last = self.decode_step_s
            self.decode_step_s = forward_s if last is None else last + DECODE_EMA * (forward_s - last)

    def shared(self, step: int, tenants: Iterable[str]) -> bool:
        """Whether tenants share the engine at `step`; `tenants`: those with requests running or waiting."""
        for tenant in tenants:
            self._active[tenant] = step
        if len(self._active) > 1:
            for tenant, last in list(self._active.items()):
                if step - last > SHARED_WINDOW_STEPS:
                    del self._active[tenant]
        return len(self._active) > 1 and self.decode_step_s is not None

    def tokens(self, head_uncached: int, prefill_s_per_token: float, others_wait: bool = False) -> int:
        """A shared step's prefill budget; `head_uncached`: the tokens the leading requests compute (0: none waits;
        chunked prompts under way count as leading).
        `others_wait`: another tenant's requests wait behind the leading ones, so the step computes the leading
        ones' prompts and nothing more: a light tenant's own step is a decode step plus its prompt, not plus a decode
        step's worth of the heavy tenant's prompts too (those go on in the next step)."""
        if prefill_s_per_token <= 0 or self.decode_step_s is None:  # nothing to divide yet (`shared` says so too)
            return self.chunked_prefill_size
        self.num_shared_steps += 1
        timed = 0 if others_wait and head_uncached > 0 else int(self.decode_step_s / prefill_s_per_token)
        return min(self.chunked_prefill_size, max(timed, head_uncached, self.page_size))
