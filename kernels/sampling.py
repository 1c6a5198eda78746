"""Next-token sampling for one step, vectorised over the sampled sequences.

Order of operations (per row): raw logits -> logprobs (returned, if requested)
-> repetition penalty (prompt + output tokens) -> frequency / presence penalties (output
token counts) -> logit_bias (OpenAI's: its (row, id, bias) entries added in one index_put, ids past
the logits ignored) -> the row's banned ids (`SeqInput.banned_ids`: the scheduler bans EOS and stop tokens
while min_new_tokens is unmet) -> the grammar's token bitmask
(structured generation; disallowed ids and ids past the mask's width -> -inf) -> greedy argmax, or
temperature -> top-k -> top-p (over the top-k mass) -> min-p -> draw (kernels/sampling_filter.py
defines the filters exactly and applies them without sorting the vocabulary).

The draw is Gumbel-max with noise that is a pure hash of (sampling_seed, output position,
token id): a seeded sequence gets the same tokens whatever its batch mates, after being
recomputed, and on any device. Greedy rows (temperature 0 or top_k 1) never touch noise.

Host work: every decision that depends on the parameters is taken on the host from the Python
lists (no device sync but the final `.tolist()` and, on filtered rows, one to find the rows the
candidates do not decide), and everything a step sends to the device goes as one int64 and one
float32 tensor (`StepUpload`). Penalty statistics are either rebuilt per step from a reset
`SeqInput.penalty_tokens` (stateless, the whole context) or kept per row of the runner's request table
in a `PenaltyState` and fed the new tokens only; either way they change only the logits of the tokens
seen, not the whole rows. Logits of any float dtype are widened to float32 once, on entry.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .forward_io import SeqInput, TokenLogprob
from .native import argmax_rows
from .sampling_filter import candidate_counts, draw_filtered, top_candidates
from .sampling_noise import gumbel_argmax, row_keys, seed_words
from .sampling_penalties import PenaltyState, penalty_entries
from .step_upload import StepUpload

logger = logging.getLogger(__name__)

_BLOCK_LOGITS = 1 << 21  # logits per block of rows (8 MiB in float32)

__all__ = ["PenaltyState", "adjust_logits", "sample_next_tokens", "token_logprobs", "unpack_bitmask"]


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
    masked_ids: list[list[int]]  # ids banned this step (SeqInput.banned_ids)
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


def sample_next_tokens(
    logits: torch.Tensor,  # [num_rows, vocab], one row per sampled sequence
    seqs: list[SeqInput],
    penalties: PenaltyState | None = None,
    native: bool = False,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Picks one token per row and, where `sampling.logprobs` is set, its logprob + top-k.

    penalties: the runner's per-row state (incremental penalties); None rebuilds them per step.
    native: the greedy argmax goes through the native library (native.argmax_rows, same answer).
    Rows are sampled independently of each other, so on the CPU a large batch runs in blocks of
    rows whose [rows, vocab] temporaries stay in the cache (and are reused by the allocator, where a
    larger one would be mapped afresh, page by page, every step).
    """
    params = _read_params(seqs)
    step = max(1, _BLOCK_LOGITS // max(1, logits.shape[-1]))
    plain = logits.dtype == torch.float32 and _argmax_only(params, seqs)  # no temporaries, nothing to block
    if len(seqs) <= step or logits.device.type != "cpu" or plain:
        return _sample_block(logits, seqs, penalties, native, params)
    tokens: list[int] = []
    logprobs: list[TokenLogprob | None] = []
    for start in range(0, len(seqs), step):
        block = _sample_block(logits[start:start + step], seqs[start:start + step], penalties, native, None)
        tokens += block[0]
        logprobs += block[1]
    return tokens, logprobs


def _argmax_only(p: _RowParams, seqs: list[SeqInput]) -> bool:
    """Whether the step is a plain argmax of every row."""
    rep_rows, count_rows = p.penalised_rows()
    return (all(p.greedy) and not (rep_rows or count_rows or p.grammar_rows or p.bias_rows)
            and not any(p.masked_ids) and not any(_wants_logprobs(s) for s in seqs))


def _sample_block(logits: torch.Tensor, seqs: list[SeqInput], penalties: PenaltyState | None, native: bool,
                  params: _RowParams | None) -> tuple[list[int], list[TokenLogprob | None]]:
    logits = logits.float()  # a no-op for float32; bf16 is widened once (exactly) for every step below
    params = _read_params(seqs) if params is None else params
    random_rows = [i for i, g in enumerate(params.greedy) if not g]
    up = StepUpload()
    _plan_adjust(up, seqs, params, logits.shape[-1], penalties)
    draw = _plan_random(up, seqs, params, random_rows, logits.shape[-1]) if random_rows else None
    want = [i for i, s in enumerate(seqs) if _wants_logprobs(s)]
    if want:
        up.add_ints("logprob_rows", want)
    up.send(logits.device)
    adjusted = _adjust(logits, params, up, penalties)
    if native or not random_rows:
        tokens = argmax_rows(adjusted) if native else adjusted.argmax(dim=-1)  # final for greedy rows
    else:  # torch's CPU argmax is slow: only on the greedy rows
        tokens = torch.zeros(len(seqs), dtype=torch.int64, device=logits.device)
        greedy = [i for i, g in enumerate(params.greedy) if g]
        if greedy:
            tokens[greedy] = adjusted[greedy].argmax(dim=-1)
    if draw is not None:
        tokens[up.ints("random_rows")] = _sample_random(_rows(adjusted, up, "random_rows"), up, draw)
    token_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    if want:
        found = token_logprobs(_rows(logits, up, "logprob_rows"), [token_list[i] for i in want],
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
        values, indices = top_candidates(logp, max_top)  # torch's topk scans the row slowly on the CPU
        top_vals, top_ids = values.tolist(), indices.tolist()
    return [TokenLogprob(token_id=t, logprob=lp, top=list(zip(top_ids[i][:n], top_vals[i][:n])))
            for i, (t, lp, n) in enumerate(zip(token_ids, chosen, num_tops))]


def adjust_logits(logits: torch.Tensor, seqs: list[SeqInput], p: _RowParams | None = None,
                  penalties: PenaltyState | None = None) -> torch.Tensor:
    """Penalties, logit_bias and banned ids; returns `logits` itself (float32) when nothing applies."""
    logits = logits.float()
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
    if penalties is not None:
        penalties._plan("seen", seqs, rep_rows, vocab, up)
        penalties._plan("counts", seqs, count_rows, vocab, up)
    if rep_rows:
        up.add_ints("rep_batch", rep_rows)
        up.add_floats("repetition", p.repetition)
        if penalties is None:
            rows, toks = _flat_pairs(rep_rows, [_context(seqs[i], "seen") for i in rep_rows], vocab)
            up.add_ints("rep_rows", rows)
            up.add_ints("rep_toks", toks)
        else:
            up.add_ints("rep_state", [seqs[i].row for i in rep_rows])
    if count_rows:
        up.add_ints("count_batch", count_rows)
        up.add_floats("frequency", p.frequency)
        up.add_floats("presence", p.presence)
        if penalties is None:
            rows, toks = _flat_pairs(count_rows, [_context(seqs[i], "counts") for i in count_rows], vocab)
            up.add_ints("count_rows", rows)
            up.add_ints("count_toks", toks)
        else:
            up.add_ints("count_state", [seqs[i].row for i in count_rows])
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


def _context(seq: SeqInput, kind: str) -> tuple[int, ...]:
    """The tokens a stateless rebuild counts: prompt + output ("seen") or output ("counts"), from a reset feed."""
    feed = seq.penalty_tokens
    if feed is None or not feed.reset:
        raise ValueError("without a PenaltyState, a penalised row needs a reset penalty_tokens (its whole context)")
    return feed.prompt + feed.output if kind == "seen" else feed.output


def _adjust(logits: torch.Tensor, p: _RowParams, up: StepUpload, penalties: PenaltyState | None) -> torch.Tensor:
    has_rep, has_count, has_mask = up.has("repetition"), up.has("frequency"), up.has("mask_rows")
    has_bias = up.has("bias_rows")
    if penalties is not None:
        if has_rep:
            penalties._apply("seen", up, logits)
        if has_count:
            penalties._apply("counts", up, logits)
    if not (has_rep or has_count or has_mask or p.grammar_rows or has_bias):
        return logits  # common case: nothing to change, no copy
    out = logits.clone()
    # The penalties change only the (row, token) entries of tokens seen; elsewhere they are
    # identities (x / 1, x - 0 * 0), so the sparse update equals the dense formula.
    if has_rep:
        rows, toks, _ = penalty_entries(up, "rep", penalties, out.shape[-1])
        x = out[rows, toks]
        penalty = up.floats("repetition")[rows]
        out[rows, toks] = torch.where(x < 0, x * penalty, x / penalty)  # HF / vLLM: divide positive logits
    if has_count:
        rows, toks, counts = penalty_entries(up, "count", penalties, out.shape[-1])
        freq, pres = up.floats("frequency")[rows], up.floats("presence")[rows]
        out[rows, toks] = out[rows, toks] - freq * counts - pres * (counts > 0).float()
    if has_bias:  # before the masks, so a banned id stays -inf whatever its bias
        out.index_put_((up.ints("bias_rows"), up.ints("bias_toks")), up.floats("bias_vals"), accumulate=True)
    if has_mask:
        out[up.ints("mask_rows"), up.ints("mask_toks")] = float("-inf")
    if p.grammar_rows:
        _apply_bitmasks(out, p.grammar_rows, p.bitmasks)
    return out


def _apply_bitmasks(out: torch.Tensor, rows: list[int], bitmasks: list[torch.Tensor]) -> None:
    """-inf where the rows' xgrammar token bitmasks ([ceil(vocab / 32)] int32 each) disallow a token,
    in place with xgrammar's kernel (unpacked here where xgrammar is absent: masks built by hand);
    ids past a mask's 32 * words are not allowed either."""
    masks = torch.stack(bitmasks).to(out.device, non_blocking=True)  # [num_constrained, words] int32
    try:
        import xgrammar
    except ImportError:
        out[rows] = out[rows].masked_fill(~unpack_bitmask(masks, out.shape[-1]), float("-inf"))
        return
    if len(rows) < out.shape[0]:  # the kernel reads the mask of row i at index i
        full = torch.full((out.shape[0], masks.shape[1]), -1, dtype=torch.int32, device=out.device)
        full[rows] = masks
        masks = full
    width = min(out.shape[-1], 32 * masks.shape[1])
    xgrammar.apply_token_bitmask_inplace(out, masks, vocab_size=width, indices=rows)
    if width < out.shape[-1]:
        out[rows, width:] = float("-inf")


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
        p.greedy.append(s.greedy)
        p.temperature.append(s.temperature if s.temperature > 0 else 1.0)
        p.top_k.append(s.top_k)
        p.top_p.append(s.top_p)
        p.min_p.append(s.min_p)
        p.repetition.append(s.repetition_penalty)
        p.frequency.append(s.frequency_penalty)
        p.presence.append(s.presence_penalty)
        bias = s.logit_bias
        if bias:
            row = len(p.greedy) - 1
            p.bias_rows += [row] * len(bias)
            p.bias_toks += bias.keys()
            p.bias_vals += bias.values()
        if seq.token_bitmask is not None:
            p.grammar_rows.append(len(p.greedy) - 1)
            p.bitmasks.append(seq.token_bitmask)
        p.masked_ids.append(list(seq.banned_ids))
    return p


def _wants_logprobs(seq: SeqInput) -> bool:
    return seq.sampling.logprobs or seq.num_top_logprobs > 0


@dataclass
class _Draw:
    """Host side of the sampled rows' draw: which rows (positions among them) filter, which do not."""

    filtered: list[int]
    plain: list[int]
    counts: list[int]  # candidate counts for the filtered rows (sampling_filter.candidate_counts)


def _plan_random(up: StepUpload, seqs: list[SeqInput], p: _RowParams, rows: list[int], vocab: int) -> _Draw:
    """Book the sampled rows' settings; the filters that apply are decided here, on the host."""
    top_k = [p.top_k[i] if 0 < p.top_k[i] < vocab else vocab for i in rows]
    top_p = [p.top_p[i] for i in rows]
    min_p = [p.min_p[i] for i in rows]
    is_filtered = [k < vocab or tp < 1.0 or mp > 0 for k, tp, mp in zip(top_k, top_p, min_p)]
    filtered = [j for j, f in enumerate(is_filtered) if f]
    draw = _Draw(filtered, [j for j, f in enumerate(is_filtered) if not f], [])
    up.add_ints("random_rows", rows)
    up.add_floats("temperature", [p.temperature[i] for i in rows])
    if filtered:
        up.add_ints("filtered", filtered)
        up.add_ints("plain", draw.plain)
        up.add_ints("top_k", [top_k[j] for j in filtered])
        draw.counts = candidate_counts([top_k[j] for j in filtered], vocab)
        if any(top_p[j] < 1.0 for j in filtered):
            up.add_floats("top_p", [top_p[j] for j in filtered])
        if any(min_p[j] > 0 for j in filtered):
            up.add_floats("min_p", [min_p[j] for j in filtered])
    lo, hi, pos = seed_words([seqs[i].sampling_seed for i in rows], [seqs[i].sample_index for i in rows])
    up.add_ints("seed_lo", lo)
    up.add_ints("seed_hi", hi)
    up.add_ints("seed_pos", pos)
    return draw


def _sample_random(logits: torch.Tensor, up: StepUpload, draw: _Draw) -> torch.Tensor:  # [num_sel] token ids
    x = logits / up.floats("temperature")[:, None]  # [num_sel, vocab]
    key = row_keys(up.ints("seed_lo"), up.ints("seed_hi"), up.ints("seed_pos"))  # [num_sel, 1]
    if not draw.filtered:
        return gumbel_argmax(x, key)
    top_p = up.floats("top_p") if up.has("top_p") else None
    min_p = up.floats("min_p") if up.has("min_p") else None
    if not draw.plain:
        return draw_filtered(x, key, up.ints("top_k"), top_p, min_p, draw.counts)
    tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    filtered, plain = up.ints("filtered"), up.ints("plain")
    tokens[filtered] = draw_filtered(x[filtered], key[filtered], up.ints("top_k"), top_p, min_p, draw.counts)
    tokens[plain] = gumbel_argmax(x[plain], key[plain])
    return tokens


def _rows(t: torch.Tensor, up: StepUpload, name: str) -> torch.Tensor:
    """t's rows listed under `name` (increasing row numbers): t itself when they are all (no copy)."""
    return t if up.num(name) == t.shape[0] else t[up.ints(name)]


def _flat_pairs(rows: list[int], token_lists: list[list[int]], vocab: int) -> tuple[list[int], list[int]]:
    """(row, token) index pairs for a sparse update, dropping ids outside the vocabulary."""
    row_idx = [r for r, toks in zip(rows, token_lists) for t in toks if 0 <= t < vocab]
    tok_idx = [t for toks in token_lists for t in toks if 0 <= t < vocab]
    return row_idx, tok_idx


