"""Penalty statistics for the sampler (kernels/sampling.py): kept per request-table row between
steps (`PenaltyState`), or rebuilt per step, and read back as sparse (row, token, count) entries."""
from __future__ import annotations

import torch

from .forward_io import SeqInput
from .step_upload import StepUpload


class PenaltyState:
    """Per-row penalty statistics kept on the logits' device between steps.

    Rows are those of the runner's request table (SeqInput.row). Two [num_rows, vocab] tensors,
    each allocated on first use: `seen` (bool, prompt + output tokens: repetition penalty) and
    `counts` (float32, output-token counts: frequency / presence). Per row and tensor a record
    says what the row holds: (the output_ids list object it was built from, its length then).
    The row is rebuilt from prompt_ids + output_ids when the sequence is new on it (new_row),
    when there is no record or it names another list (another request; so a first sampled step
    with new_row False, after a prefill chunk that sampled nothing, is safe), or when output_ids
    got shorter; otherwise only output_ids[recorded:] (normally one token) is added. A request
    that does not use a tensor never writes its row, so the record stays true. Contract: the
    SeqInput lists are the request's own (appended to, never edited in place without new_row);
    copies are still correct but rebuild every step. Values equal the stateless rebuild exactly
    (counts are small integers in float32); planning a step twice is harmless.
    """

    def __init__(self, num_rows: int) -> None:
        if num_rows <= 0:
            raise ValueError(f"num_rows must be positive, got {num_rows}")
        self.num_rows = num_rows
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        # Per kind ("seen", "counts"): row -> (the request's output_ids list, output tokens recorded).
        self._records: dict[str, dict[int, tuple[list[int], int]]] = {"seen": {}, "counts": {}}
        self.num_rebuilt_rows = 0  # rows rebuilt from the whole context (for tests and stats)
        self.num_updated_rows = 0  # rows updated incrementally

    def reset(self) -> None:
        """Forget every row (the tensors stay allocated)."""
        for records in self._records.values():
            records.clear()

    def _plan(self, kind: str, seqs: list[SeqInput], rows: list[int], vocab: int,
              up: StepUpload) -> None:
        """Book the host side of this step's update of `kind` for the given batch rows."""
        records = self._records[kind]
        rebuild: list[int] = []
        pair_rows: list[int] = []
        pair_toks: list[int] = []
        for i in rows:
            seq = seqs[i]
            if not 0 <= seq.row < self.num_rows:
                raise ValueError(f"row {seq.row} outside the penalty state's {self.num_rows} rows")
            out = seq.output_ids
            rec = records.get(seq.row)
            if seq.new_row or rec is None or rec[0] is not out or rec[1] > len(out):
                rebuild.append(seq.row)
                new = (seq.prompt_ids + out) if kind == "seen" else out
                self.num_rebuilt_rows += 1
            else:
                new = out[rec[1]:]
                self.num_updated_rows += 1
            for tok in new:
                if 0 <= tok < vocab:
                    pair_rows.append(seq.row)
                    pair_toks.append(tok)
            records[seq.row] = (out, len(out))
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
