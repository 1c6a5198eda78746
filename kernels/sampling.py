"""Next-token sampling for one step, vectorised over the sampled sequences.

Order of operations (per row): raw logits -> logprobs (returned, if requested)
-> repetition penalty (prompt + output tokens) -> frequency / presence penalties (output
token counts) -> logit_bias (OpenAI's: its (row, id, bias) entries added in one index_put, ids past
the logits ignored) -> EOS / stop-token mask while min_new_tokens is unmet (not on constrained rows:
there the grammar decides when the stop token may come) -> the grammar's token bitmask
(structured generation; disallowed ids and ids past the mask's width -> -inf) -> greedy argmax, or
temperature -> top-k -> top-p (over the top-k renormalised mass) -> min-p -> draw.

The draw is Gumbel-max with noise that is a pure hash of (sampling_seed, output position,
token id): a seeded sequence gets the same tokens whatever its batch mates, after being
recomputed, and on any device. Greedy rows (temperature 0 or top_k 1) never touch noise.

Host work: every decision that depends on the parameters is taken on the host from the Python
lists (no device sync but the final `.tolist()`), and everything a step sends to the device
goes as one int64 and one float32 tensor (`StepUpload`). Penalty statistics are either rebuilt
from prompt_ids + output_ids per step (stateless, O(context)) or kept per row of the runner's
request table in a `PenaltyState` and updated with the new tokens only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from radixserve.kernels.forward_io import SeqInput, TokenLogprob
from radixserve.kernels.native import argmax_rows
from radixserve.kernels.sampling_noise import gumbel_rows, seed_words
from radixserve.kernels.step_upload import StepUpload

logger = logging.getLogger(__name__)


@dataclass
class _RowParams:
    """Per-row settings read once from the duck-typed SamplingParams."""

    greedy: list[bool]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    repetition: list[float]
    frequency: list[float]
    presence: list[float]
    masked_ids: list[list[int]]  # ids banned this step (min_new_tokens unmet)
    grammar_rows: list[int] = field(default_factory=list)  # rows with a token bitmask (structured generation)
    bitmasks: list[torch.Tensor] = field(default_factory=list)  # their [ceil(vocab / 32)] int32 rows
    # logit_bias as flat (row, token id, bias) triples; a few entries per biased row, never the vocabulary.
    bias_rows: list[int] = field(default_factory=list)
    bias_toks: list[int] = field(default_factory=list)
    bias_vals: list[float] = field(default_factory=list)

    def penalised_rows(self) -> tuple[list[int], list[int]]:
        """(rows with a repetition penalty, rows with a frequency or presence penalty)."""
        rep = [i for i, r in enumerate(self.repetition) if r != 1.0]
        count = [i for i, (f, p) in enumerate(zip(self.frequency, self.presence)) if f != 0.0 or p != 0.0]
        return rep, count


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


def sample_next_tokens(
    logits: torch.Tensor,  # [num_rows, vocab] float32, one row per sampled sequence
    seqs: list[SeqInput],
    penalties: PenaltyState | None = None,
    native: bool = False,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Picks one token per row and, where `sampling.logprobs` is set, its logprob + top-k.

    penalties: the runner's per-row state (incremental penalties); None rebuilds them per step.
    native: the greedy argmax goes through the native library (native.argmax_rows, same answer).
    """
    params = _read_params(seqs)
    random_rows = [i for i, g in enumerate(params.greedy) if not g]
    up = StepUpload()
    _plan_adjust(up, seqs, params, logits.shape[-1], penalties)
    if random_rows:
        _plan_random(up, seqs, params, random_rows, logits.shape[-1])
    want = [i for i, s in enumerate(seqs) if _wants_logprobs(s)]
    if want:
        up.add_ints("logprob_rows", want)
    up.send(logits.device)
    adjusted = _adjust(logits, params, up, penalties)
    tokens = argmax_rows(adjusted) if native else adjusted.argmax(dim=-1)  # [num_rows]; final for greedy rows
    if random_rows:
        idx = up.ints("random_rows")
        tokens[idx] = _sample_random(adjusted[idx], up)
    token_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    if want:
        found = token_logprobs(logits[up.ints("logprob_rows")], [token_list[i] for i in want],
                               [seqs[i].num_top_logprobs for i in want])
        for i, lp in zip(want, found):
            logprobs[i] = lp
    return token_list, logprobs


def token_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] raw model logits
    token_ids: list[int],  # [num_rows] the token scored on each row
    num_tops: list[int],  # [num_rows] how many alternatives to return per row
) -> list[TokenLogprob]:
    """log_softmax of the raw logits at the given tokens, with the top alternatives."""
    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # [num_rows, vocab]
    ids = torch.tensor(token_ids, device=logits.device)
    chosen = logp.gather(1, ids[:, None]).squeeze(1).tolist()
    max_top = min(max(num_tops), logp.shape[-1])
    top_vals: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if max_top > 0:
        values, indices = logp.topk(max_top, dim=-1)
        top_vals, top_ids = values.tolist(), indices.tolist()
    return [TokenLogprob(token_id=t, logprob=lp, top=list(zip(top_ids[i][:n], top_vals[i][:n])))
            for i, (t, lp, n) in enumerate(zip(token_ids, chosen, num_tops))]


def adjust_logits(logits: torch.Tensor, seqs: list[SeqInput], p: _RowParams | None = None,
                  penalties: PenaltyState | None = None) -> torch.Tensor:
    """Penalties and the min_new_tokens mask; returns `logits` itself when nothing applies."""
    p = _read_params(seqs) if p is None else p
    up = StepUpload()
    _plan_adjust(up, seqs, p, logits.shape[-1], penalties)
    up.send(logits.device)
    return _adjust(logits, p, up, penalties)


# ---------------------------------------------------------------------------------------------
# private helpers


def _plan_adjust(up: StepUpload, seqs: list[SeqInput], p: _RowParams, vocab: int,
                 penalties: PenaltyState | None) -> None:
    rep_rows, count_rows = p.penalised_rows()
    if penalties is not None:  # also books rows without a penalty (they lose their record)
        penalties._plan("seen", seqs, rep_rows, vocab, up)
        penalties._plan("counts", seqs, count_rows, vocab, up)
        if rep_rows or count_rows:
            up.add_ints("state_rows", [s.row for s in seqs])
    if rep_rows:
        up.add_floats("repetition", p.repetition)
        if penalties is None:
            rows, toks = _flat_pairs(rep_rows, [seqs[i].prompt_ids + seqs[i].output_ids for i in rep_rows], vocab)
            up.add_ints("rep_rows", rows)
            up.add_ints("rep_toks", toks)
    if count_rows:
        up.add_floats("frequency", p.frequency)
        up.add_floats("presence", p.presence)
        if penalties is None:
            rows, toks = _flat_pairs(count_rows, [seqs[i].output_ids for i in count_rows], vocab)
            up.add_ints("count_rows", rows)
            up.add_ints("count_toks", toks)
    mask_rows = [i for i, ids in enumerate(p.masked_ids) if ids]
    if mask_rows:
        rows, toks = _flat_pairs(mask_rows, [p.masked_ids[i] for i in mask_rows], vocab)
        up.add_ints("mask_rows", rows)
        up.add_ints("mask_toks", toks)
    if p.bias_rows:
        keep = [k for k, t in enumerate(p.bias_toks) if t < vocab]  # ids past the logits are ignored
        if len(keep) < len(p.bias_toks):
            p.bias_rows = [p.bias_rows[k] for k in keep]
            p.bias_toks = [p.bias_toks[k] for k in keep]
            p.bias_vals = [p.bias_vals[k] for k in keep]
        if p.bias_rows:
            up.add_ints("bias_rows", p.bias_rows)
            up.add_ints("bias_toks", p.bias_toks)
            up.add_floats("bias_vals", p.bias_vals)
    if p.grammar_rows:
        up.add_ints("grammar_rows", p.grammar_rows)


def _adjust(logits: torch.Tensor, p: _RowParams, up: StepUpload, penalties: PenaltyState | None) -> torch.Tensor:
    has_rep, has_count, has_mask = up.has("repetition"), up.has("frequency"), up.has("mask_rows")
    has_grammar, has_bias = up.has("grammar_rows"), up.has("bias_rows")
    if penalties is not None:
        if has_rep:
            penalties._apply("seen", up, logits)
        if has_count:
            penalties._apply("counts", up, logits)
    if not (has_rep or has_count or has_mask or has_grammar or has_bias):
        return logits  # common case: nothing to change, no copy
    out = logits.clone()
    if has_rep:
        if penalties is not None:
            seen = penalties.seen[up.ints("state_rows")]  # [num_rows, vocab]; rows without the penalty: / 1.0
        else:
            seen = torch.zeros_like(out, dtype=torch.bool)
            seen[up.ints("rep_rows"), up.ints("rep_toks")] = True
        penalty = up.floats("repetition")[:, None]  # [num_rows, 1]
        # HF / vLLM: divide positive logits, multiply negative ones.
        out = torch.where(seen, torch.where(out < 0, out * penalty, out / penalty), out)
    if has_count:
        if penalties is not None:
            counts = penalties.counts[up.ints("state_rows")]  # rows without a penalty: x 0.0
        else:
            counts = torch.zeros_like(out)
            num = up.num("count_rows")
            counts.index_put_((up.ints("count_rows"), up.ints("count_toks")), torch.ones(num, device=out.device),
                              accumulate=True)
        freq = up.floats("frequency")[:, None]
        pres = up.floats("presence")[:, None]
        out = out - freq * counts - pres * (counts > 0).float()
    if has_bias:  # before the masks, so a banned id stays -inf whatever its bias
        out.index_put_((up.ints("bias_rows"), up.ints("bias_toks")), up.floats("bias_vals").to(out.dtype),
                       accumulate=True)
    if has_mask:
        out[up.ints("mask_rows"), up.ints("mask_toks")] = float("-inf")
    if has_grammar:
        rows = up.ints("grammar_rows")
        masks = torch.stack(p.bitmasks).to(out.device, non_blocking=True)  # [num_constrained, words] int32
        allowed = unpack_bitmask(masks, out.shape[-1])  # [num_constrained, vocab] bool
        out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [num_rows, vocab_size] bool
    """xgrammar's packed token bitmask ([num_rows, words] int32, bit j of word w = token 32 * w + j)
    as booleans, True = allowed; ids past the mask's 32 * words are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = ((bitmask[:, :, None] >> shifts) & 1).bool()  # [num_rows, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)  # [num_rows, 32 * words]
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - width, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def _read_params(seqs: list[SeqInput]) -> _RowParams:
    p = _RowParams([], [], [], [], [], [], [], [], [])
    for seq in seqs:
        s = seq.sampling
        temperature = float(getattr(s, "temperature", 0.0)) if s is not None else 0.0
        top_k = int(getattr(s, "top_k", -1)) if s is not None else -1
        p.greedy.append(temperature == 0.0 or top_k == 1)
        p.temperature.append(temperature if temperature > 0 else 1.0)
        p.top_k.append(top_k)
        p.top_p.append(float(getattr(s, "top_p", 1.0)))
        p.min_p.append(float(getattr(s, "min_p", 0.0)))
        p.repetition.append(float(getattr(s, "repetition_penalty", 1.0)))
        p.frequency.append(float(getattr(s, "frequency_penalty", 0.0)))
        p.presence.append(float(getattr(s, "presence_penalty", 0.0)))
        bias = getattr(s, "logit_bias", None)
        if bias:
            row = len(p.greedy) - 1
            p.bias_rows += [row] * len(bias)
            p.bias_toks += bias.keys()
            p.bias_vals += bias.values()
        banned: list[int] = []
        if seq.token_bitmask is not None:
            p.grammar_rows.append(len(p.greedy) - 1)
            p.bitmasks.append(seq.token_bitmask)
        elif len(seq.output_ids) < int(getattr(s, "min_new_tokens", 0)):
            banned = list(seq.eos_ids) + list(getattr(s, "stop_token_ids", None) or [])
        p.masked_ids.append(banned)
    return p


def _wants_logprobs(seq: SeqInput) -> bool:
    return getattr(seq.sampling, "logprobs", None) is not None or seq.num_top_logprobs > 0


def _plan_random(up: StepUpload, seqs: list[SeqInput], p: _RowParams, rows: list[int], vocab: int) -> None:
    """Book the sampled rows' settings; the filters that apply are decided here, on the host."""
    top_k = [p.top_k[i] if 0 < p.top_k[i] < vocab else vocab for i in rows]
    top_p = [p.top_p[i] for i in rows]
    min_p = [p.min_p[i] for i in rows]
    up.add_ints("random_rows", rows)
    up.add_floats("temperature", [p.temperature[i] for i in rows])
    if any(k < vocab for k in top_k) or any(v < 1.0 for v in top_p) or any(v > 0 for v in min_p):
        up.add_ints("top_k", top_k)
        if any(v < 1.0 for v in top_p):
            up.add_floats("top_p", top_p)
        if any(v > 0 for v in min_p):
            up.add_floats("min_p", min_p)
    lo, hi, pos = seed_words([seqs[i].sampling_seed for i in rows], [len(seqs[i].output_ids) for i in rows])
    up.add_ints("seed_lo", lo)
    up.add_ints("seed_hi", hi)
    up.add_ints("seed_pos", pos)


def _sample_random(logits: torch.Tensor, up: StepUpload) -> torch.Tensor:  # [num_sel] token ids
    x = logits / up.floats("temperature")[:, None]  # [num_sel, vocab]
    if up.has("top_k"):
        x = x.masked_fill(_filter_mask(torch.softmax(x, dim=-1), up), float("-inf"))
    noise = gumbel_rows(up.ints("seed_lo"), up.ints("seed_hi"), up.ints("seed_pos"), logits.shape[-1])
    return (x + noise).argmax(dim=-1)


def _filter_mask(probs: torch.Tensor, up: StepUpload) -> torch.Tensor:  # [num_sel, vocab] True = removed
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [num_sel, vocab]
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    remove = rank >= up.ints("top_k")[:, None]
    if up.has("top_p"):  # some row has top_p < 1 (decided on the host)
        top_p_t = up.floats("top_p")[:, None]
        kept = sorted_p.masked_fill(remove, 0.0)
        kept = kept / kept.sum(dim=-1, keepdim=True)
        mass_before = kept.cumsum(dim=-1) - kept  # probability of the better-ranked tokens
        remove |= (mass_before >= top_p_t) & (top_p_t < 1.0)
    if up.has("min_p"):  # without it the test below removes nothing (probabilities are >= 0)
        remove |= sorted_p < up.floats("min_p")[:, None] * sorted_p[:, :1]
    remove[:, 0] = False  # the most likely token always stays
    return torch.zeros_like(remove).scatter(1, order, remove)


def _flat_pairs(rows: list[int], token_lists: list[list[int]], vocab: int) -> tuple[list[int], list[int]]:
    """(row, token) index pairs for a sparse update, dropping ids outside the vocabulary."""
    row_idx = [r for r, toks in zip(rows, token_lists) for t in toks if 0 <= t < vocab]
    tok_idx = [t for toks in token_lists for t in toks if 0 <= t < vocab]
    return row_idx, tok_idx


