"""Decode own-key stages (``kernels/attention/staging.py``): the CPU backend keeps a decode bucket's
gathered own keys from one step to the next and copies only what changed. Each step's output must
equal the plain reference over the pool, whatever happens between steps: members that finish,
rows taken by new sequences, freed slots rewritten with other keys, slot ids replaced under a
sequence (as ``kv_ops.cache_prefix`` does), steps cut short."""
from __future__ import annotations

import random

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.kernels.attention import torch_ref
from radixserve.kernels.attention.base import SharedPrefix
from radixserve.kernels.attention.metadata import build_metadata
from radixserve.kernels.attention.staging import HEADROOM
from radixserve.kernels.attention.torch_backend import TorchAttentionBackend

ATOL = 1e-5
NUM_SLOTS, ROWS, WIDTH, KV_HEADS, HEAD_DIM, GROUP, LAYERS = 512, 6, 160, 2, 16, 2, 3
WINDOWS = (None, None, 9)  # per layer: the last one slides (its buckets, so its stages, are its own)


class Pool:
    """Two layers of a KV pool, a slot table, and sequences on rows; free slots hold NaN."""

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.k = torch.full((LAYERS, NUM_SLOTS, KV_HEADS, HEAD_DIM), float("nan"))
        self.v = torch.full_like(self.k, float("nan"))
        self.table = torch.zeros((ROWS, WIDTH), dtype=torch.int64)
        self.free = list(range(1, NUM_SLOTS))  # slot 0: where the table's padding points
        self.seqs: dict[int, list[int]] = {}  # row -> slots of its positions (all computed)
        self.next_slots: list[int] = []  # handed out first by take
        self.backend = TorchAttentionBackend()

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            slot = self.next_slots.pop() if self.next_slots else self.free[self.rng.randrange(len(self.free))]
            self.free.remove(slot)
            out.append(slot)
        return out

    def drop(self, slots: list[int]) -> None:
        """Frees the slots no sequence references any more (NaN there, so a read of one shows)."""
        held = {s for seq in self.seqs.values() for s in seq}
        gone = sorted(set(slots) - held)
        self.free.extend(gone)
        self.k[:, gone] = float("nan")
        self.v[:, gone] = float("nan")

    def release(self, row: int) -> None:
        self.drop(self.seqs.pop(row))

    def step(self, rows: list[int], shared: list[SharedPrefix] = (), cut_after_layer: int | None = None,
             q_lens: list[int] | None = None) -> None:
        """One step: each of `rows` computes q_lens[i] new keys (default 1: a decode) on fresh slots;
        the output is checked against the reference layer by layer."""
        q_lens = q_lens or [1] * len(rows)
        new = []
        for row, n in zip(rows, q_lens):
            slots = self.take(n)
            seq = self.seqs.setdefault(row, [])
            self.table[row, len(seq):len(seq) + n] = torch.tensor(slots)
            seq.extend(slots)
            new.extend(slots)
        meta = build_metadata(q_lens=list(q_lens), kv_lens=[len(self.seqs[r]) for r in rows], rows=list(rows),
                              slot_table=self.table, out_slot_ids=torch.tensor(new), shared=list(shared),
                              needs_kv_indices=True)  # the reference reads them
        self.backend.prepare(meta, GROUP, set(WINDOWS))
        shape = (len(new), KV_HEADS, HEAD_DIM)
        for layer in range(LAYERS):
            q = torch.randn((len(new), KV_HEADS * GROUP, HEAD_DIM), generator=self.gen)
            k_new, v_new = torch.randn(shape, generator=self.gen), torch.randn(shape, generator=self.gen)
            out = self.backend.forward(q, k_new, v_new, self.k[layer], self.v[layer], meta, HEAD_DIM ** -0.5,
                                       WINDOWS[layer])
            expected = torch_ref.extend_attention(q, self.k[layer].nan_to_num(0.0), self.v[layer].nan_to_num(0.0),
                                                  meta, HEAD_DIM ** -0.5, WINDOWS[layer])
            assert torch.isfinite(out).all(), "read a freed slot"
            torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
            if cut_after_layer == layer:  # the later layers' attention never runs; their K/V land in the pool
                self.k[layer + 1:, new] = torch.randn((LAYERS - layer - 1, *shape), generator=self.gen)
                self.v[layer + 1:, new] = torch.randn((LAYERS - layer - 1, *shape), generator=self.gen)
                return


def _prefill(pool: Pool, row: int, length: int) -> None:
    """A new sequence's prompt, computed in a step of its own."""
    pool.step([row], q_lens=[length])


def test_consecutive_decode_steps_copy_only_the_new_keys():
    pool = Pool()
    lens = [40, 7, 25]
    for row, n in enumerate(lens):
        _prefill(pool, row, n)
    counters = pool.backend.stages.counters
    pool.step([0, 1, 2])
    plans = len(set(WINDOWS))  # a stage per bucket plan
    assert counters.copied == plans * (sum(lens) + 3) and counters.reused == 0  # the first step stages everything
    restaged = 0
    for _ in range(HEADROOM + 20):  # past the stage's headroom: a larger stage, staged again once
        before = counters.copied
        pool.step([0, 1, 2])
        restaged += counters.copied - before != plans * 3  # else one new key per member
    assert restaged == 1


def test_a_row_taken_over_reuses_no_stale_key():
    """Row 0's sequence finishes; a new one-token sequence on row 0 gets its freed first slot with
    other keys. The stage of rows (0, 1) is the same bucket, the cell holds the same slot id: the
    key computed this step must be copied all the same."""
    pool = Pool(seed=1)
    _prefill(pool, 0, 5)
    _prefill(pool, 1, 9)
    pool.step([0, 1])
    first = pool.seqs[0][0]
    pool.release(0)
    pool.next_slots = [first]
    pool.step([0, 1])  # row 0: one key, on `first`, written by this step
    assert pool.seqs[0] == [first]


def test_slot_ids_replaced_under_a_sequence_are_recopied():
    """kv_ops.cache_prefix swaps a sequence's slots for the tree's after insert: same positions,
    other slots (here with other keys, so a missed copy shows)."""
    pool = Pool(seed=2)
    _prefill(pool, 0, 30)
    _prefill(pool, 1, 12)
    pool.step([0, 1])
    old = pool.seqs[0][3:20]
    repl = pool.take(len(old))
    pool.k[:, repl] = torch.randn((LAYERS, len(repl), KV_HEADS, HEAD_DIM))  # other keys: a missed copy shows
    pool.v[:, repl] = torch.randn((LAYERS, len(repl), KV_HEADS, HEAD_DIM))
    pool.seqs[0][3:20] = repl
    pool.table[0, 3:20] = torch.tensor(repl)
    pool.drop(old)
    pool.step([0, 1])


def test_a_step_cut_short_leaves_no_layer_behind():
    pool = Pool(seed=3)
    _prefill(pool, 0, 20)
    _prefill(pool, 1, 21)
    pool.step([0, 1])
    pool.step([0, 1], cut_after_layer=0)  # layer 1 misses this refresh
    pool.step([0, 1])


def test_budget_zero_gathers_per_layer():
    pool = Pool(seed=4)
    pool.backend.stages.budget_slots = 0
    _prefill(pool, 0, 10)
    _prefill(pool, 1, 3)
    pool.step([0, 1])
    pool.step([0, 1])
    assert pool.backend.stages.counters.copied == 0


class StageMachine(RuleBasedStateMachine):
    """Random decode steps over rows that come and go, with slot reuse and shared prefixes."""

    @initialize(seed=st.integers(0, 2**16))
    def start(self, seed):
        self.pool = Pool(seed)
        self.rng = random.Random(seed)

    @precondition(lambda self: len(self.pool.seqs) < ROWS)
    @rule(length=st.one_of(st.just(0), st.integers(1, 8), st.integers(9, 120)), mixed=st.booleans())
    def admit(self, length, mixed):
        """A new sequence on the lowest free row: its prompt in a step of its own, or beside the
        others' decodes (a mixed step); length 0 = a one-token prompt, computed by its first step."""
        row = min(set(range(ROWS)) - set(self.pool.seqs))
        if not length:
            self.pool.seqs[row] = []
            return
        others = [r for r, s in sorted(self.pool.seqs.items()) if mixed and len(s) + 1 < WIDTH]
        self.pool.step(others + [row], q_lens=[1] * len(others) + [length])

    @precondition(lambda self: self.pool.seqs)
    @rule()
    def finish(self):
        self.pool.release(self.rng.choice(sorted(self.pool.seqs)))

    @precondition(lambda self: any(len(s) > 2 for s in self.pool.seqs.values()))
    @rule()
    def replace_slots(self):
        row = self.rng.choice([r for r, s in self.pool.seqs.items() if len(s) > 2])
        slots = self.pool.seqs[row]
        a = self.rng.randrange(len(slots) - 1)
        b = self.rng.randrange(a + 1, len(slots))
        repl, old = self.pool.take(b - a), slots[a:b]
        self.pool.k[:, repl] = self.pool.k[:, old]  # same keys, other slots (as the tree's)
        self.pool.v[:, repl] = self.pool.v[:, old]
        slots[a:b] = repl
        self.pool.table[row, a:b] = torch.tensor(repl)
        self.pool.drop(old)

    @precondition(lambda self: self.pool.seqs)
    @rule(cut=st.sampled_from([None, None, None, 0]), share=st.booleans())
    def step(self, cut, share):
        rows = [r for r, s in sorted(self.pool.seqs.items()) if len(s) + 1 < WIDTH]
        if not rows:
            return
        shared = []
        if share and len(rows) >= 2:  # the first two rows' common leading slots, read once
            a, b = self.pool.seqs[rows[0]], self.pool.seqs[rows[1]]
            common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            if common:
                shared = [SharedPrefix(0, common, [0, 1])]
        self.pool.step(rows, shared, cut)

    @precondition(lambda self: len(self.pool.seqs) >= 2)
    @rule(length=st.integers(1, 30))
    def fork(self, length):
        """A sequence copying another's leading slots (a radix hit), so shared prefixes exist."""
        src = self.rng.choice(sorted(self.pool.seqs))
        if len(self.pool.seqs) >= ROWS or len(self.pool.seqs[src]) < length:
            return
        row = min(set(range(ROWS)) - set(self.pool.seqs))
        self.pool.seqs[row] = list(self.pool.seqs[src][:length])
        self.pool.table[row, :length] = torch.tensor(self.pool.seqs[row])

    @invariant()
    def stages_bounded(self):
        if hasattr(self, "pool"):
            assert len(self.pool.backend.stages._stages) <= ROWS


TestStageMachine = StageMachine.TestCase
TestStageMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_engine_stage_fraction_zero_turns_stages_off(tmp_path_factory):
    """decode_stage_fraction=0: no stage, the same greedy tokens and logprobs as with stages."""
    from _engine_helpers import drive_staggered, make_checkpoint, shared_prefix_prompts
    from radixserve.scheduler import Engine

    ckpt = make_checkpoint(tmp_path_factory, "staging_engine")
    prompts = shared_prefix_prompts(prefix_len=40)
    params = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for fraction in (0.25, 0.0):
        engine = Engine(ckpt, num_threads=1, kv_cache_tokens=4096, decode_stage_fraction=fraction,
                        disable_native_kernels=True)  # stages serve the flash-op path
        out = drive_staggered(engine, prompts, params)
        stats = engine.stats()
        assert (stats["num_staged_keys_reused"] > 0) == (fraction > 0), stats
        runs[fraction] = [(r.output_ids, [round(lp.logprob, 4) for lp in r.logprobs])
                          for r in (out.results[rid] for rid in out.rids)]
    assert runs[0.25] == runs[0.0]


def test_engine_drops_its_stages_when_idle(tmp_path_factory):
    from _engine_helpers import make_checkpoint
    from radixserve.scheduler import Engine

    engine = Engine(make_checkpoint(tmp_path_factory, "staging_idle"), num_threads=1, kv_cache_tokens=2048,
                    disable_native_kernels=True)
    stages = engine.runner.backend.stages
    for i in range(3):
        engine.add_request(list(range(20 + i, 60)), dict(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    held = 0
    while engine.has_unfinished():
        engine.step()
        held = max(held, len(stages._stages))
    assert held > 0 and not stages._stages  # kept while decoding, freed once nothing runs
