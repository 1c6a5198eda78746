"""Req (the scheduler's per-request state) and the objects handed back to callers."""
from __future__ import annotations

import enum
import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any

from ..kernels.forward_io import RowSampling, TokenLogprob
from .sampling_params import SamplingParams
from .slot_row import SlotRow

@functools.lru_cache(maxsize=4096)
def salt_tag(salt: str) -> int:
    """The key offset of a salt's private tokens (Req.tree_ids): a 64-bit hash, shifted past every token id."""
    return (int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little") | 1) << 32


# GenerateResult.error of a request its caller aborted (Engine.abort): a normal end, not a failure.
ABORTED = "aborted"


@dataclass
class GenerateResult:
    rid: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None  # from arrival to first admission (None: never admitted)

    @property
    def cut_short(self) -> bool:
        """Ended before the model ended it (max tokens, the context, an abort): its text may stop mid-word."""
        return self.finish_reason != "stop"

    @property
    def failed(self) -> bool:
        """Ended by a failure in the engine (finish_reason "abort" for any other reason than Engine.abort)."""
        return self.finish_reason == "abort" and self.error != ABORTED


@dataclass
class StreamDelta:
    rid: str
    text: str  # new text since the previous delta
    token_ids: list[int]  # new output token ids
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    result: GenerateResult | None = None


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One request. Token lists are plain Python; the KV layout is:

        all_ids:  | prompt_ids ................ | output_ids ....... |
        kv:       | tree_len (owned by the tree, locked) | own slots | (not yet computed)
                  |<---------------- kv_len ------------------->|
        kv_slots: slots of positions [0, kv_len) plus, with page_size > 1, the unused tail of
                  the last allocated page (len(kv_slots) is a multiple of page_size).
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # effective sampling seed (params.seed or one drawn from the engine's RNG)
    arrival_step: int
    arrival_time: float
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING

    # KV state (see the class docstring).
    kv_len: int = 0
    tree_len: int = 0  # leading slots that belong to the radix tree (locked through last_node)
    last_node: Any = None  # locked TreeNode, or None
    hint_node: Any = None  # while waiting: the hinted end of its cached prefix (PrefixKV.hint), or None
    restore_epoch: int = -1  # the tree's epoch when PrefixKV.restore last found nothing of it to read back
    # Its slot list and its row of the runner's request->slot table (changed only through SlotRow's methods).
    slot_row: SlotRow = field(default_factory=SlotRow)

    # Reporting.
    cached_tokens: int | None = None  # from the first admission only (§12)
    num_retractions: int = 0
    first_token_time: float | None = None
    admit_time: float | None = None  # first admission (perf_counter)
    finish_time: float | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    # Structured generation: the xgrammar GrammarMatcher (engine process only), advanced with every
    # sampled token; it survives retraction (output_ids are kept) and is dropped on finish.
    grammar: Any = None
    grammar_ban: Any = None  # a bitmask row ANDed into its mask (GrammarBackend.extra_ban), or None
    # Its reasoning budget's state while the budget may still apply (scheduler/reasoning_budget.py), else None.
    reasoning: Any = None

    # Text state, owned by the engine's output processor.
    detok: Any = None
    text: str = ""  # full decoded output text (trimmed at a matched stop string)
    emitted_len: int = 0  # chars of `text` already handed out in deltas
    emitted_tokens: int = 0  # output ids already handed out in deltas

    def __post_init__(self) -> None:
        self.sampling: RowSampling = self.params.row_sampling()  # what the sampler reads, built once

    def banned_ids(self, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Ids the next token may not be: EOS and the stop ids until min_new_tokens are out (a grammar decides
        that itself, so a constrained request bans none)."""
        p = self.params
        if self.grammar is not None or len(self.output_ids) >= p.min_new_tokens:
            return ()
        return eos_ids + tuple(p.stop_token_ids or ())

    @property
    def kv_slots(self) -> list[int]:
        """Read-only view: the slots of positions [0, kv_len) and those taken ahead."""
        return self.slot_row.slots

    @property
    def row(self) -> int | None:
        return self.slot_row.row

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def tree_salt(self) -> str | None:
        """The radix tree namespace of the request: its salt, unless the salt starts after a shared part (then the
        shared namespace, with the private tokens keyed apart by tree_ids)."""
        p = self.params
        return None if p.cache_salt_after else p.cache_salt

    def tree_ids(self, end: int) -> list[int]:
        """all_ids[:end] as the radix tree keys them. With cache_salt_after = b, positions from b on are keyed as
        token + the salt's 64-bit tag x 2^32 (never a token id of any vocabulary), so only requests with the same
        salt share them, while positions before b match everyone's. Without it: the ids themselves."""
        ids = self.prompt_ids[:end] if end <= len(self.prompt_ids) else self.all_ids[:end]
        start = self.params.cache_salt_after
        if not start or start >= end:
            return ids
        tag = salt_tag(self.params.cache_salt)
        return ids[:start] + [t + tag for t in ids[start:]]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens without KV yet. A decoding request has exactly one: its newest sampled token.

        Prefill and decode are one mechanism: each step computes all_ids[kv_len:kv_len + n]
        and samples when that reaches the end of the sequence.
        """
        return self.seq_len - self.kv_len

    @property
    def is_decoding(self) -> bool:
        return bool(self.output_ids) and self.num_pending == 1

    @property
    def prefix_only(self) -> bool:
        """It only computes and caches its prompt (max_new_tokens 0): a cache warm-up, not a turn of its own."""
        return self.params.max_new_tokens == 0

    @property
    def owned_slots(self) -> int:
        """Slots this request holds outside the tree (in-flight in the accounting identity)."""
        return len(self.kv_slots) - self.tree_len

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def to_result(self) -> GenerateResult:
        want_lp = self.params.logprobs is not None
        e2e = (self.finish_time - self.arrival_time) if self.finish_time else None
        ttft = (self.first_token_time - self.arrival_time) if self.first_token_time else None
        queue = (self.admit_time - self.arrival_time) if self.admit_time else None
        return GenerateResult(
            rid=self.rid, text=self.text, output_ids=list(self.output_ids),
            prompt_tokens=len(self.prompt_ids), cached_tokens=self.cached_tokens or 0,
            completion_tokens=len(self.output_ids), finish_reason=self.finish_reason or "abort",
            matched_stop=self.matched_stop, logprobs=list(self.output_logprobs) if want_lp else None,
            prompt_logprobs=list(self.prompt_logprobs) if self.params.logprob_start_len is not None else None,
            error=self.error, ttft_s=ttft, e2e_s=e2e, queue_s=queue)
