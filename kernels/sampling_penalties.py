"""Penalty statistics for the sampler (kernels/sampling.py): kept per request-table row between
steps (`PenaltyState`), or rebuilt per step, and read back as sparse (row, token, count) entries.

What a row takes each step comes from the scheduler (`SeqInput.penalty_tokens`, a `PenaltyTokens`): the
whole context the first time a request samples on the row (reset), then only its new output tokens. The
scheduler knows when a row is new to a request (scheduler/slot_row.py); nothing here guesses it."""
from __future__ import annotations

import torch

from .forward_io import SeqInput
from .step_upload import StepUpload


class PenaltyState:
    """Per-row penalty statistics kept on the logits' device between steps.

    Rows are those of the runner's request table (SeqInput.row). Two [num_rows, vocab] tensors,
    each allocated on first use: `seen` (bool, prompt + output tokens: repetition penalty) and
    `counts` (float32, output-token counts: frequency / presence). A reset feed zeroes the row and adds
    its whole context; a later feed adds the new output tokens. A request that does not use a tensor
    never writes its row. Values equal the stateless rebuild exactly (counts are small integers in
    float32).
    """

    def __init__(self, num_rows: int) -> None:
        if num_rows <= 0:
            raise ValueError(f"num_rows must be positive, got {num_rows}")
        self.num_rows = num_rows
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.num_rebuilt_rows = 0  # rows rebuilt from the whole context (for tests and stats)
        self.num_updated_rows = 0  # rows updated incrementally

    def _plan(self, kind: str, seqs: list[SeqInput], rows: list[int], vocab: int,
              up: StepUpload) -> None:
        """Book the host side of this step's update of `kind` for the given batch rows."""
        rebuild: list[int] = []
        pair_rows: list[int] = []
        pair_toks: list[int] = []
        for i in rows:
            seq = seqs[i]
            if not 0 <= seq.row < self.num_rows:
                raise ValueError(f"row {seq.row} outside the penalty state's {self.num_rows} rows")
            feed = seq.penalty_tokens
            if feed is None:
                raise ValueError(f"row {seq.row} samples with a penalty but the step sent no penalty_tokens")
            if feed.reset:
                rebuild.append(seq.row)
                self.num_rebuilt_rows += 1
            else:
                self.num_updated_rows += 1
            new = feed.prompt + feed.output if kind == "seen" else feed.output
            for tok in new:
                if 0 <= tok < vocab:
                    pair_rows.append(seq.row)
                    pair_toks.append(tok)
        up.add_ints(f"{kind}_rebuild", rebuild)
        up.add_ints(f"{kind}_rows", pair_rows)
        up.add_ints(f"{kind}_toks", pair_toks)

    def _apply(self, kind: str, up: StepUpload, like: torch.Tensor) -> None:
        """Device side of _plan: zero the rebuilt rows, then add the new tokens."""
        if kind == "seen":
            if self.seen is None:
                self.seen = torch.zeros(self.num_rows, like.shape[-1], dtype=torch.bool, device=like.device)
            table, value = self.seen, True
        else:
            if self.counts is None:
                self.counts = torch.zeros(self.num_rows, like.shape[-1], dtype=torch.float32, device=like.device)
            table, value = self.counts, 1.0
        if up.num(f"{kind}_rebuild"):
            table[up.ints(f"{kind}_rebuild")] = 0
        num = up.num(f"{kind}_rows")
        if num:
            index = (up.ints(f"{kind}_rows"), up.ints(f"{kind}_toks"))
            if kind == "seen":
                table[index] = value
            else:
                table.index_put_(index, torch.ones(num, device=like.device), accumulate=True)


def penalty_entries(up: StepUpload, kind: str, penalties: PenaltyState | None,
                    vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch rows, token ids, output counts) of the penalised rows' seen tokens, each once; kind:
    "rep" (prompt + output tokens; counts unused) or "count" (output tokens)."""
    batch = up.ints(f"{kind}_batch")
    if penalties is not None:
        table = penalties.seen if kind == "rep" else penalties.counts
        stats = table[up.ints(f"{kind}_state")]  # [num_penalised, vocab]
        index, toks = stats.nonzero(as_tuple=True)
        counts = stats[index, toks].float()
        return batch[index], toks, counts
    # Stateless: the (row, token) pairs of the whole context, duplicates merged into counts.
    flat = up.ints(f"{kind}_rows") * vocab + up.ints(f"{kind}_toks")
    flat, counts = flat.unique(return_counts=True)
    return flat // vocab, flat % vocab, counts.float()
