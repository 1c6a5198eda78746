"""Next-token sampling for one step, vectorised over the sampled sequences.

Order of operations (per row): raw logits -> logprobs (returned, if requested)
-> repetition penalty (prompt + output tokens) -> frequency / presence penalties (output
token counts) -> EOS / stop-token mask while min_new_tokens is unmet -> greedy argmax, or
temperature -> top-k -> top-p (over the top-k renormalised mass) -> min-p -> draw.

The draw is Gumbel-max with noise that is a pure hash of (sampling_seed, output position,
token id): a seeded sequence gets the same tokens whatever its batch mates, after being
recomputed, and on any device. Greedy rows (temperature 0 or top_k 1) never touch noise.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixserve.kernels.forward_io import SeqInput, TokenLogprob

logger = logging.getLogger(__name__)

_M32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B  # < 2**31, so x * _HASH_MUL never overflows int64 for 32-bit x


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


def sample_next_tokens(
    logits: torch.Tensor,  # [num_rows, vocab] float32, one row per sampled sequence
    seqs: list[SeqInput],
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Picks one token per row and, where `sampling.logprobs` is set, its logprob + top-k."""
    params = _read_params(seqs)
    adjusted = adjust_logits(logits, seqs, params)
    tokens = adjusted.argmax(dim=-1)  # [num_rows]; final for greedy rows
    random_rows = [i for i, g in enumerate(params.greedy) if not g]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        tokens[idx] = _sample_random(adjusted[idx], [seqs[i] for i in random_rows], params, random_rows)
    token_list = tokens.tolist()
    want = [i for i, s in enumerate(seqs) if _wants_logprobs(s)]
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    if want:
        rows = torch.tensor(want, device=logits.device)
        found = token_logprobs(logits[rows], [token_list[i] for i in want],
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


def gumbel_noise(seeds: list[int], positions: list[int], vocab_size: int,
                 device: torch.device | str) -> torch.Tensor:  # [num_rows, vocab] float32
    """Standard Gumbel noise, a pure function of (seed, position, token id)."""
    seeds_u64 = [s & 0xFFFFFFFFFFFFFFFF for s in seeds]
    lo = torch.tensor([s & _M32 for s in seeds_u64], dtype=torch.int64, device=device)
    hi = torch.tensor([s >> 32 for s in seeds_u64], dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device) & _M32
    key = _mix32(_mix32(_mix32(lo ^ 0x9E3779B9) ^ hi) ^ pos)[:, None]  # [num_rows, 1]
    token = torch.arange(vocab_size, dtype=torch.int64, device=device)[None, :]
    bits = _mix32((_mix32(token ^ key) + key) & _M32)  # [num_rows, vocab] uniform 32-bit
    # float64 so that u never rounds to 0 or 1 (float32 would, for ~1 token in 2**24).
    u = (bits.double() + 0.5) / 2.0**32
    return (-torch.log(-torch.log(u))).float()


def adjust_logits(logits: torch.Tensor, seqs: list[SeqInput], p: _RowParams | None = None) -> torch.Tensor:
    """Penalties and the min_new_tokens mask; returns `logits` itself when nothing applies."""
    p = _read_params(seqs) if p is None else p
    rep_rows = [i for i, r in enumerate(p.repetition) if r != 1.0]
    count_rows = [i for i in range(len(seqs)) if p.frequency[i] != 0.0 or p.presence[i] != 0.0]
    mask_rows = [i for i, ids in enumerate(p.masked_ids) if ids]
    if not (rep_rows or count_rows or mask_rows):
        return logits  # common case: nothing to change, no copy
    out = logits.clone()
    vocab = out.shape[-1]
    device = out.device
    if rep_rows:
        rows, toks = _flat_pairs(rep_rows, [seqs[i].prompt_ids + seqs[i].output_ids for i in rep_rows], vocab)
        seen = torch.zeros_like(out, dtype=torch.bool)
        seen[rows.to(device), toks.to(device)] = True
        penalty = torch.tensor(p.repetition, device=device)[:, None]  # [num_rows, 1]
        # HF / vLLM: divide positive logits, multiply negative ones.
        out = torch.where(seen, torch.where(out < 0, out * penalty, out / penalty), out)
    if count_rows:
        rows, toks = _flat_pairs(count_rows, [seqs[i].output_ids for i in count_rows], vocab)
        counts = torch.zeros_like(out)
        counts.index_put_((rows.to(device), toks.to(device)), torch.ones(len(rows), device=device),
                          accumulate=True)
        freq = torch.tensor(p.frequency, device=device)[:, None]
        pres = torch.tensor(p.presence, device=device)[:, None]
        out = out - freq * counts - pres * (counts > 0).float()
    if mask_rows:
        rows, toks = _flat_pairs(mask_rows, [p.masked_ids[i] for i in mask_rows], vocab)
        out[rows.to(device), toks.to(device)] = float("-inf")
    return out


# ---------------------------------------------------------------------------------------------
# private helpers


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
        banned: list[int] = []
        if len(seq.output_ids) < int(getattr(s, "min_new_tokens", 0)):
            banned = list(seq.eos_ids) + list(getattr(s, "stop_token_ids", None) or [])
        p.masked_ids.append(banned)
    return p


def _wants_logprobs(seq: SeqInput) -> bool:
    return getattr(seq.sampling, "logprobs", None) is not None or seq.num_top_logprobs > 0


def _sample_random(logits: torch.Tensor, seqs: list[SeqInput], p: _RowParams,
                   rows: list[int]) -> torch.Tensor:  # [num_sel] token ids
    device = logits.device
    num_sel, vocab = logits.shape
    temperature = torch.tensor([p.temperature[i] for i in rows], device=device)[:, None]
    x = logits / temperature  # [num_sel, vocab]
    top_k = [p.top_k[i] if 0 < p.top_k[i] < vocab else vocab for i in rows]
    top_p = [p.top_p[i] for i in rows]
    min_p = [p.min_p[i] for i in rows]
    if any(k < vocab for k in top_k) or any(v < 1.0 for v in top_p) or any(v > 0 for v in min_p):
        x = x.masked_fill(_filter_mask(torch.softmax(x, dim=-1), top_k, top_p, min_p), float("-inf"))
    noise = gumbel_noise([seqs[j].sampling_seed for j in range(num_sel)],
                         [len(seqs[j].output_ids) for j in range(num_sel)], vocab, device)
    return (x + noise).argmax(dim=-1)


def _filter_mask(probs: torch.Tensor, top_k: list[int], top_p: list[float],
                 min_p: list[float]) -> torch.Tensor:  # [num_sel, vocab] True = removed
    device = probs.device
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [num_sel, vocab]
    rank = torch.arange(probs.shape[-1], device=device)[None, :]
    remove = rank >= torch.tensor(top_k, device=device)[:, None]
    top_p_t = torch.tensor(top_p, device=device)[:, None]
    if (top_p_t < 1.0).any():
        kept = sorted_p.masked_fill(remove, 0.0)
        kept = kept / kept.sum(dim=-1, keepdim=True)
        mass_before = kept.cumsum(dim=-1) - kept  # probability of the better-ranked tokens
        remove |= (mass_before >= top_p_t) & (top_p_t < 1.0)
    min_p_t = torch.tensor(min_p, device=device)[:, None]
    remove |= sorted_p < min_p_t * sorted_p[:, :1]
    remove[:, 0] = False  # the most likely token always stays
    return torch.zeros_like(remove).scatter(1, order, remove)


def _flat_pairs(rows: list[int], token_lists: list[list[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for a sparse update, dropping ids outside the vocabulary."""
    row_idx = [r for r, toks in zip(rows, token_lists) for t in toks if 0 <= t < vocab]
    tok_idx = [t for toks in token_lists for t in toks if 0 <= t < vocab]
    return torch.tensor(row_idx, dtype=torch.long), torch.tensor(tok_idx, dtype=torch.long)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (bijective on [0, 2**32)) in int64 arithmetic."""
    x = x ^ (x >> 16)
    x = (x * _HASH_MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _HASH_MUL) & _M32
    return x ^ (x >> 16)
