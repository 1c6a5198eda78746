"""The seeded draw under top-k / top-p / min-p, without sorting the vocabulary.

Semantics (`reference_keep`, the full-sort definition): a row's probabilities p = softmax(x), x =
logits / temperature, are ranked by p descending, ties by the lower token id. Rank r is kept iff
r < top_k; and, with top_p < 1, the mass of the better-ranked tokens, cumsum(p)[r - 1] / mass, is
below top_p (mass: the top_k tokens' cumsum(p)[top_k - 1], or 1 without top_k: a softmax sums to
1); and p[r] >= min_p * p[0]. Rank 0 is always kept. The token drawn is the kept id with the largest
x + Gumbel noise (sampling_noise), ties to the lower id.

Each filter removes a suffix of the ranking (a cumsum of p >= 0 never decreases), so the kept
tokens are a prefix of it. `draw_filtered` ranks only the C most probable tokens (a topk, its ties
put in id order): a cumsum run in order gives a prefix the values of the whole ranking, so the
decide a row exactly unless its kept prefix reaches its C-th candidate's value (then tokens past
the candidates, or ties cut by topk, may belong to it): such rows go to a larger C, then to the
full sort. Tokens with p == 0 never matter: p underflows only some 75 below the row's maximum x,
far more than the noise's range (about -3.1 to 22.9) can make up, and rank 0 is always kept.
Exact on the CPU, where cumsum runs in order; a parallel scan (CUDA) may round a prefix differently.
"""
from __future__ import annotations

import torch

from .sampling_noise import gumbel_argmax, gumbel_at

CANDIDATES = (256, 4096)  # candidate counts tried before the full sort, for rows without top_k
_MIN_CANDIDATES = 64  # rows with top_k start at max(top_k + 1, this)
_BLOCK_WIDTHS = (64, 32, 16)  # column blocks of the two-stage topk (a width dividing the vocabulary)


def candidate_counts(top_k: list[int], vocab: int, tries: tuple[int, ...] = CANDIDATES) -> list[int]:
    """The candidate counts to try, on the host: the first covers every row's top_k + 1."""
    first = min(vocab, max(max(k + 1, _MIN_CANDIDATES) if k < vocab else tries[0] for k in top_k))
    return [first] + [c for c in tries[1:] if first < c < vocab]


def draw_filtered(x: torch.Tensor, key: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None,
                  min_p: torch.Tensor | None, counts: list[int]) -> torch.Tensor:
    """Tokens [num_rows] drawn from x [num_rows, vocab] float32 under the filters (module docstring).

    key: the rows' noise keys [num_rows, 1]; top_k [num_rows] int64, the vocabulary size where it is
    off; top_p / min_p [num_rows] float32, None where no row uses the filter; counts: from
    candidate_counts. All tensors on x's device.
    """
    vocab = x.shape[-1]
    probs = torch.softmax(x, dim=-1)
    tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    rows = torch.arange(x.shape[0], device=x.device)  # rows still to decide
    for count in counts:
        sub = None if rows.numel() == x.shape[0] else rows  # all rows: no gather copies
        ok, drawn = _draw_candidates(_pick(x, sub), _pick(probs, sub), _pick(key, sub), top_k[rows],
                                     _pick(top_p, sub), _pick(min_p, sub), count, vocab)
        tokens[rows[ok]] = drawn[ok]
        rows = rows[~ok]
        if rows.numel() == 0:
            return tokens
    keep = reference_keep(probs[rows], top_k[rows], _pick(top_p, rows), _pick(min_p, rows), vocab)
    tokens[rows] = gumbel_argmax(x[rows].masked_fill(~keep, float("-inf")), key[rows])
    return tokens


def reference_keep(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor | None,
                   min_p: torch.Tensor | None, vocab: int) -> torch.Tensor:  # [num_rows, vocab] bool
    """The kept tokens by the full-sort definition (module docstring), True = kept, in id order."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # stable: ties by id
    keep = keep_ranks(sorted_p, k, top_p, min_p, vocab)
    return torch.zeros_like(keep).scatter(1, order, keep)


def keep_ranks(sorted_p: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor | None,
               min_p: torch.Tensor | None, vocab: int) -> torch.Tensor:  # [num_rows, width] bool
    """Kept ranks of the leading `width` probabilities of each ranking (all of it, or candidates)."""
    width = sorted_p.shape[-1]
    keep = torch.arange(width, device=sorted_p.device)[None, :] < k[:, None]
    if top_p is not None:
        csum = sorted_p.cumsum(dim=-1)
        at_k = csum.gather(1, (k.clamp(max=width) - 1)[:, None]).squeeze(1)
        mass = torch.where(k < vocab, at_k, torch.ones_like(at_k))[:, None]
        before = torch.cat([torch.zeros_like(csum[:, :1]), csum[:, :-1]], dim=1)  # mass of better ranks
        keep &= ~((before / mass >= top_p[:, None]) & (top_p[:, None] < 1.0))
    if min_p is not None:
        keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    keep[:, 0] = True
    return keep


def candidate_keep(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                   count: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows the `count` most probable tokens decide [num_rows] bool, their ids in rank order
    [num_rows, count], kept ranks [num_rows, count] bool); kept ranks are exact on decided rows."""
    vals, ids = top_candidates(probs, count)  # ties in no set order: put them in id order
    ids, perm = ids.sort(dim=-1)
    vals, perm = vals.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, perm)
    keep = keep_ranks(vals, k, top_p, min_p, vocab)
    last = vals.gather(1, (keep.sum(dim=-1) - 1)[:, None]).squeeze(1)  # the kept prefix's last value
    edge = vals[:, -1]  # tokens past the candidates have p <= edge
    # The top-k mass needs the k-th value: known when top_k <= count (or off, or past the p > 0 tokens).
    decided = (count == vocab) | (edge == 0) | ((last > edge) & ((k <= count) | (k >= vocab)))
    return (vals[:, 0] > 0) & decided, ids, keep


def top_candidates(probs: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs.topk(count, dim=-1) up to the order of ties (any float rows), over the `count` column
    blocks of the largest maxima: they hold every value above the count-th largest and enough equal
    to it."""
    rows, vocab = probs.shape
    width = next((w for w in _BLOCK_WIDTHS if vocab % w == 0), 0)
    if not width or vocab // width < 4 * count:
        return probs.topk(count, dim=-1)
    block_max = probs.reshape(rows, vocab // width, width).amax(dim=-1)  # [rows, vocab / width]
    blocks = block_max.topk(count, dim=-1).indices
    ids = (blocks[:, :, None] * width + torch.arange(width, device=probs.device)).view(rows, -1)
    vals, at = probs.gather(1, ids).topk(count, dim=-1)
    return vals, ids.gather(1, at)


def _draw_candidates(x: torch.Tensor, probs: torch.Tensor, key: torch.Tensor, k: torch.Tensor,
                     top_p: torch.Tensor | None, min_p: torch.Tensor | None, count: int,
                     vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows the `count` best candidates decide [num_rows] bool, their drawn tokens [num_rows])."""
    ok, ids, keep = candidate_keep(probs, k, top_p, min_p, count, vocab)
    score = (x.gather(1, ids) + gumbel_at(key, ids)).masked_fill(~keep, float("-inf"))
    best = score.max(dim=-1, keepdim=True).values
    drawn = torch.where(score == best, ids, vocab).min(dim=-1).values  # ties: the lower id
    return ok, drawn


def _pick(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or rows is None else t[rows]
