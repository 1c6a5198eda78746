"""Seeded, reproducible token-id workloads for the cache and scheduling benchmarks (issue 4).

A workload is a sequence of rounds. Round r's prompts may contain the outputs the engine generated
in earlier rounds (a conversation's next turn carries the previous answer), so a workload builds a
round from the outputs seen so far: `make_round(round_idx, outputs_by_key)`. With greedy decoding
and the same engine, every run of a workload sends the same tokens.

Arrivals are simulated in engine steps, not wall time: a round arrives when the previous round has
finished (`Workload.arrival_step(r)` returns None) or at a fixed engine step.

Token ids are drawn from [10, 4000): the bench models have a vocab of 4096 and the low ids are
where tokenizers keep their special tokens.
"""
from __future__ import annotations

import abc
import random
from dataclasses import dataclass
from typing import Callable, Mapping

TOKEN_LO, TOKEN_HI = 10, 4000
SIZES = ("full", "reduced", "tiny", "real")
# "real": issue 35's shapes for real-shape models (model L), 64 output tokens a request; a workload
# without its own "real" entry uses its "full" one.


@dataclass(frozen=True)
class WorkRequest:
    key: str  # unique within the workload; later rounds look up this request's output by it
    prompt_ids: list[int]
    max_new_tokens: int
    cache_salt: str | None = None


@dataclass(frozen=True)
class Round:
    requests: list[WorkRequest]


class Workload(abc.ABC):
    """Base class: subclasses set `name`, `num_rounds` and implement `make_round`.

    A round is built only when it arrives, so it can use the outputs of every request that has
    finished by then (`outputs` maps WorkRequest.key to output ids).
    """

    name: str = "workload"
    num_rounds: int = 1

    @abc.abstractmethod
    def make_round(self, round_idx: int, outputs: Mapping[str, list[int]]) -> Round:
        """The requests of round `round_idx`, built from the outputs seen so far."""

    def arrival_step(self, round_idx: int) -> int | None:
        """Engine step at which round `round_idx` arrives; None = once every earlier request
        has finished. Fixed steps must not decrease from one round to the next."""
        return None

    def describe(self) -> dict:
        return {"name": self.name, "num_rounds": self.num_rounds, **getattr(self, "params", {})}


def _draw(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(length)]


class SharedSystemPrompt(Workload):
    """gsp: G groups × P prompts sharing a group system prompt of Ls + a question of Lq; shuffled."""

    def __init__(self, num_groups: int = 8, per_group: int = 8, system_len: int = 1024,
                 question_len: int = 64, output_len: int = 32, seed: int = 0, name: str = "gsp") -> None:
        _check_positive(num_groups=num_groups, per_group=per_group, system_len=system_len,
                        question_len=question_len, output_len=output_len)
        self.name = name
        self.params = dict(num_groups=num_groups, per_group=per_group, system_len=system_len,
                           question_len=question_len, output_len=output_len, seed=seed)
        rng = random.Random(seed)
        requests = []
        for g in range(num_groups):
            system_ids = _draw(rng, system_len)
            for p in range(per_group):
                prompt_ids = system_ids + _draw(rng, question_len)
                requests.append(WorkRequest(f"g{g}/p{p}", prompt_ids, output_len))
        rng.shuffle(requests)
        self._requests = requests

    def make_round(self, round_idx: int, outputs: Mapping[str, list[int]]) -> Round:
        return Round(list(self._requests))


class FewShot(SharedSystemPrompt):
    """fewshot: one long prefix of examples + many short questions, short outputs."""

    def __init__(self, prefix_len: int = 1500, num_questions: int = 64, question_len: int = 50,
                 output_len: int = 8, seed: int = 0, name: str = "fewshot") -> None:
        super().__init__(num_groups=1, per_group=num_questions, system_len=prefix_len,
                         question_len=question_len, output_len=output_len, seed=seed, name=name)
        self.params = dict(prefix_len=prefix_len, num_questions=num_questions,
                           question_len=question_len, output_len=output_len, seed=seed)


class _Chains(Workload):
    """Independent chains (conversations, agents) that grow by one round at a time:
    prompt_t = prompt_{t-1} + output_{t-1} + appended_t."""

    def __init__(self, first_prompts: list[list[int]], appended: list[list[list[int]]],
                 output_len: int, prefix: str) -> None:
        self._first = first_prompts
        self._appended = appended  # [chain][turn - 1] tokens appended after the previous output
        self._output_len = output_len
        self._prefix = prefix
        self._prompts: dict[str, list[int]] = {}
        self.num_rounds = 1 + (len(appended[0]) if appended else 0)

    def make_round(self, round_idx: int, outputs: Mapping[str, list[int]]) -> Round:
        requests = []
        for c, first in enumerate(self._first):
            key = f"{self._prefix}{c}/t{round_idx}"
            if round_idx == 0:
                prompt_ids = list(first)
            else:
                prev_key = f"{self._prefix}{c}/t{round_idx - 1}"
                prompt_ids = (self._prompts[prev_key] + list(outputs[prev_key])
                              + self._appended[c][round_idx - 1])
            self._prompts[key] = prompt_ids
            requests.append(WorkRequest(key, prompt_ids, self._output_len))
        return Round(requests)


class MultiTurn(_Chains):
    """multiturn: C conversations × T turns; each turn = previous prompt + previous output + a user
    message of Lu tokens; sent round by round."""

    def __init__(self, num_convs: int = 8, num_turns: int = 4, user_len: int = 128,
                 output_len: int = 32, seed: int = 0) -> None:
        _check_positive(num_convs=num_convs, num_turns=num_turns, user_len=user_len, output_len=output_len)
        rng = random.Random(seed)
        first = [_draw(rng, user_len) for _ in range(num_convs)]
        appended = [[_draw(rng, user_len) for _ in range(num_turns - 1)] for _ in range(num_convs)]
        super().__init__(first, appended, output_len, prefix="c")
        self.name = "multiturn"
        self.params = dict(num_convs=num_convs, num_turns=num_turns, user_len=user_len,
                           output_len=output_len, seed=seed)


class ReAct(_Chains):
    """react: A agents × S steps sharing one agent system prompt (tool descriptions); each step the
    model writes a thought/action (its output) and a tool result of varying length is appended."""

    def __init__(self, num_agents: int = 8, num_steps: int = 6, system_len: int = 512,
                 task_len: int = 64, tool_len: tuple[int, int] = (32, 192), output_len: int = 32,
                 seed: int = 0) -> None:
        _check_positive(num_agents=num_agents, num_steps=num_steps, system_len=system_len,
                        task_len=task_len, output_len=output_len)
        rng = random.Random(seed)
        system_ids = _draw(rng, system_len)
        first = [system_ids + _draw(rng, task_len) for _ in range(num_agents)]
        appended = [[_draw(rng, rng.randint(*tool_len)) for _ in range(num_steps - 1)]
                    for _ in range(num_agents)]
        super().__init__(first, appended, output_len, prefix="a")
        self.name = "react"
        self.params = dict(num_agents=num_agents, num_steps=num_steps, system_len=system_len,
                           task_len=task_len, tool_len=list(tool_len), output_len=output_len, seed=seed)


class TreeOfThought(Workload):
    """tot: a question forks B ways at each of D levels. A node's prompt = its parent's prompt +
    the parent's output + a branch instruction; level 1 forks the bare question."""

    def __init__(self, branching: int = 3, depth: int = 3, question_len: int = 256,
                 branch_len: int = 16, output_len: int = 32, num_trees: int = 1, seed: int = 0) -> None:
        _check_positive(branching=branching, depth=depth, question_len=question_len,
                        branch_len=branch_len, output_len=output_len, num_trees=num_trees)
        self.name = "tot"
        self.num_rounds = depth
        self.params = dict(branching=branching, depth=depth, question_len=question_len,
                           branch_len=branch_len, output_len=output_len, num_trees=num_trees, seed=seed)
        self._rng = random.Random(seed)
        self._branching = branching
        self._branch_len = branch_len
        self._output_len = output_len
        # Level-0 "nodes": the questions themselves, with no output.
        self._prompts: dict[str, list[int]] = {f"q{t}": _draw(self._rng, question_len) for t in range(num_trees)}
        self._frontier = list(self._prompts)

    def make_round(self, round_idx: int, outputs: Mapping[str, list[int]]) -> Round:
        requests = []
        next_frontier = []
        for parent in self._frontier:
            base = self._prompts[parent] + list(outputs.get(parent, []))
            for b in range(self._branching):
                key = f"{parent}.{b}"
                prompt_ids = base + _draw(self._rng, self._branch_len)
                self._prompts[key] = prompt_ids
                next_frontier.append(key)
                requests.append(WorkRequest(key, prompt_ids, self._output_len))
        self._frontier = next_frontier
        return Round(requests)


class HotPrefixStream(Workload):
    """hotstream: a steady stream (one request every `gap` engine steps) in which a request is, with
    probability 1/hot_every (seeded), a question on one hot few-shot prefix, and otherwise a one-off
    long prompt. A burst of one-offs pushes the hot prefix out under pure LRU; reuse-weighted
    eviction can keep it once it has been hit. Used to compare eviction policies (issue 4)."""

    def __init__(self, num_requests: int = 96, hot_every: int = 4, prefix_len: int = 1024,
                 question_len: int = 32, oneoff_len: int = 768, output_len: int = 8, gap: int = 2,
                 seed: int = 0) -> None:
        _check_positive(num_requests=num_requests, hot_every=hot_every, prefix_len=prefix_len,
                        question_len=question_len, oneoff_len=oneoff_len, output_len=output_len, gap=gap)
        self.name = "hotstream"
        self.num_rounds = num_requests
        self.params = dict(num_requests=num_requests, hot_every=hot_every, prefix_len=prefix_len,
                           question_len=question_len, oneoff_len=oneoff_len, output_len=output_len,
                           gap=gap, seed=seed)
        rng = random.Random(seed)
        hot = _draw(rng, prefix_len)
        self._requests = []
        for idx in range(num_requests):
            is_hot = idx == 0 or rng.random() < 1.0 / hot_every
            prompt_ids = hot + _draw(rng, question_len) if is_hot else _draw(rng, oneoff_len)
            self._requests.append(WorkRequest(f"s{idx}", prompt_ids, output_len))
        self._gap = gap

    def make_round(self, round_idx: int, outputs: Mapping[str, list[int]]) -> Round:
        return Round([self._requests[round_idx]])

    def arrival_step(self, round_idx: int) -> int | None:
        return round_idx * self._gap


class MissStream(Workload):
    """starve: every engine step `hot_per_step` requests on one hot prefix arrive, and every
    `miss_every` steps one cache-miss request; with few running slots the queue builds up, so a
    policy that always prefers cache hits would leave the misses waiting (issue 4's starvation
    test). Request keys: h<step>.<i> (hot) and m<step> (miss)."""

    def __init__(self, num_steps: int = 120, hot_per_step: int = 1, miss_every: int = 10,
                 prefix_len: int = 64, question_len: int = 8, miss_len: int = 72, output_len: int = 8,
                 seed: int = 0) -> None:
        _check_positive(num_steps=num_steps, hot_per_step=hot_per_step, miss_every=miss_every,
                        prefix_len=prefix_len, question_len=question_len, miss_len=miss_len,
                        output_len=output_len)
        self.name = "starve"
        self.num_rounds = num_steps
        self.params = dict(num_steps=num_steps, hot_per_step=hot_per_step, miss_every=miss_every,
                           prefix_len=prefix_len, question_len=question_len, miss_len=miss_len,
                           output_len=output_len, seed=seed)
        rng = random.Random(seed)
        hot = _draw(rng, prefix_len)
        self._rounds = []
        for step in range(num_steps):
            requests = [WorkRequest(f"h{step}.{i}", hot + _draw(rng, question_len), output_len)
                        for i in range(hot_per_step)]
            if step % miss_every == miss_every // 2:
                requests.append(WorkRequest(f"m{step}", _draw(rng, miss_len), output_len))
            self._rounds.append(Round(requests))

    def make_round(self, round_idx: int, outputs: Mapping[str, list[int]]) -> Round:
        return self._rounds[round_idx]

    def arrival_step(self, round_idx: int) -> int | None:
        return round_idx


# Sizes: "full" is issue 4's definition; "reduced" fits model M on a 2-core CPU in minutes;
# "tiny" is for CI with a tiny model (hit rates do not depend on the model's size).
_FACTORIES: dict[str, dict[str, Callable[[int], Workload]]] = {
    "gsp": {
        "real": lambda s: SharedSystemPrompt(2, 8, 1024, 64, 64, seed=s),
        "full": lambda s: SharedSystemPrompt(8, 8, 1024, 64, 32, seed=s),
        "reduced": lambda s: SharedSystemPrompt(4, 8, 256, 32, 16, seed=s),
        "tiny": lambda s: SharedSystemPrompt(3, 4, 48, 8, 4, seed=s),
    },
    "gsp1000": {
        "full": lambda s: SharedSystemPrompt(8, 8, 1000, 64, 32, seed=s, name="gsp1000"),
        "reduced": lambda s: SharedSystemPrompt(4, 8, 250, 32, 16, seed=s, name="gsp1000"),
        "tiny": lambda s: SharedSystemPrompt(3, 4, 45, 8, 4, seed=s, name="gsp1000"),
    },
    # Prefix and prompt lengths that are multiples of neither 16 nor 128 (vLLM's block sizes
    # cache whole blocks only; the peer bench compares against them).
    "gsp1000q61": {
        "full": lambda s: SharedSystemPrompt(8, 8, 1000, 61, 32, seed=s, name="gsp1000q61"),
        "reduced": lambda s: SharedSystemPrompt(4, 8, 250, 29, 16, seed=s, name="gsp1000q61"),
        "tiny": lambda s: SharedSystemPrompt(3, 4, 45, 7, 4, seed=s, name="gsp1000q61"),
    },
    "fewshot1499": {
        "full": lambda s: FewShot(1499, 64, 50, 8, seed=s, name="fewshot1499"),
        "reduced": lambda s: FewShot(399, 24, 23, 8, seed=s, name="fewshot1499"),
        "tiny": lambda s: FewShot(95, 16, 7, 4, seed=s, name="fewshot1499"),
    },
    "fewshot": {
        "real": lambda s: FewShot(1500, 64, 50, 64, seed=s),
        "full": lambda s: FewShot(1500, 64, 50, 8, seed=s),
        "reduced": lambda s: FewShot(400, 24, 24, 8, seed=s),
        "tiny": lambda s: FewShot(96, 16, 8, 4, seed=s),
    },
    "multiturn": {
        "real": lambda s: MultiTurn(4, 3, 128, 64, seed=s),
        "full": lambda s: MultiTurn(8, 4, 128, 32, seed=s),
        "reduced": lambda s: MultiTurn(6, 4, 48, 16, seed=s),
        "tiny": lambda s: MultiTurn(4, 3, 16, 4, seed=s),
    },
    "react": {
        "real": lambda s: ReAct(16, 6, 512, 64, (32, 192), 64, seed=s),
        "full": lambda s: ReAct(8, 6, 512, 64, (32, 192), 32, seed=s),
        "reduced": lambda s: ReAct(6, 5, 160, 24, (16, 64), 16, seed=s),
        "tiny": lambda s: ReAct(6, 4, 32, 8, (4, 12), 4, seed=s),
    },
    "tot": {
        "full": lambda s: TreeOfThought(3, 3, 256, 16, 32, num_trees=1, seed=s),
        "reduced": lambda s: TreeOfThought(3, 3, 128, 12, 16, num_trees=1, seed=s),
        "tiny": lambda s: TreeOfThought(3, 3, 24, 4, 4, num_trees=1, seed=s),
    },
    # One long shared prefix read by many requests decoding together (an agent's system prompt and tool
    # blocks): where reading the prefix once per step, not once per request, matters most.
    "gsp_long": {
        "full": lambda s: SharedSystemPrompt(1, 32, 4096, 64, 64, seed=s, name="gsp_long"),
        "reduced": lambda s: SharedSystemPrompt(1, 16, 1024, 32, 16, seed=s, name="gsp_long"),
        "tiny": lambda s: SharedSystemPrompt(1, 8, 96, 8, 4, seed=s, name="gsp_long"),
    },
    "hotstream": {
        "full": lambda s: HotPrefixStream(96, 4, 1024, 32, 768, 8, gap=2, seed=s),
        "reduced": lambda s: HotPrefixStream(60, 4, 384, 16, 256, 4, gap=2, seed=s),
        "tiny": lambda s: HotPrefixStream(36, 4, 96, 8, 64, 4, gap=2, seed=s),
    },
}

NONALIGNED_WORKLOADS = ("gsp1000q61", "fewshot1499")  # for the vLLM peer bench, not the scheduling grid
LONG_PREFIX_WORKLOADS = ("gsp_long",)  # for the peer benches on model L; not the scheduling grid (too long on S/M)
WORKLOAD_NAMES = tuple(name for name in _FACTORIES if name != "hotstream" and name not in NONALIGNED_WORKLOADS
                       and name not in LONG_PREFIX_WORKLOADS)  # the scheduling grid
EVICTION_WORKLOADS = ("hotstream", "multiturn", "react")  # where LRU and reuse-weighted eviction differ


def make_workload(name: str, size: str = "full", seed: int = 0) -> Workload:
    """A fresh workload (workloads keep per-run state: build a new one for every run)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(_FACTORIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    factories = _FACTORIES[name]
    return factories.get(size, factories["full"])(seed)


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
