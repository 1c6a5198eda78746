"""The CPU attention reader where the native kernel is not built: ``attend_tokens``, the contract of
``native.attend_tokens`` in torch, over K/V gathered per call (and widened to fp32; an int8 pool's dequantized).

``attend`` is ``aten._scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp a
merge needs; it is private to torch, so plain matmuls (``attend_matmul``) stand in when it is
missing or refuses the inputs.
"""
from __future__ import annotations

import logging

import torch

from .kv_int8 import gather

logger = logging.getLogger(__name__)

_FLASH_OP = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_tokens(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  bounds: tuple[torch.Tensor | None, torch.Tensor], tokens: torch.Tensor, scale: float,
                  out: torch.Tensor, lse: torch.Tensor, merge: bool) -> None:
    """native.attend_tokens in torch: entry b's stacked row r (token ``tokens[b, r // group]``, q head
    kv_head * group + r % group; -1 = padding) attends over its keys [lo, hi) of ``slots[b]``; the
    result and its LSE go to out [tokens, q_heads, d] / lse [tokens, q_heads] (float32) in place, or
    with merge are log-sum-exp merged into the partial they hold. No token may appear twice."""
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    num, per = tokens.shape
    tok = tokens.reshape(-1).long()
    real = tok >= 0
    qb = q[tok.clamp(min=0)].view(num, per, num_kv_heads, group, head_dim).transpose(1, 2)
    qb = qb.reshape(num, num_kv_heads, per * group, head_dim)
    lo, hi = bounds
    key = torch.arange(slots.shape[1], device=q.device)
    seen = key < hi[..., None]  # [num, rows, keys]
    if lo is not None:
        seen &= key >= lo[..., None]
    some = seen.any(-1)  # [num, rows]
    seen[..., 0] |= ~some  # a row that sees nothing reads key 0 (the op leaves NaN on it) and is dropped below
    mask = torch.zeros(seen.shape, dtype=torch.float32, device=q.device).masked_fill_(~seen, float("-inf"))
    # fp32 throughout, as the kernel: in bf16 the op would round each partial before the merges (int8: dequantized)
    keys, values = (gather(cache, slots).transpose(1, 2).float() for cache in (k_cache, v_cache))
    o, o_lse = attend(qb.float(), keys, values, mask[:, None], scale)
    o = o.masked_fill_(~some[:, None, :, None], 0.0)
    o_lse = o_lse.masked_fill(~some[:, None], float("-inf"))
    # stacked [num, kv_heads, per * group, ...] -> token-major [num * per, q_heads, ...], real tokens only
    o = o.view(num, num_kv_heads, per, group, head_dim).transpose(1, 2).reshape(num * per, -1, head_dim)[real]
    o_lse = o_lse.view(num, num_kv_heads, per, group).transpose(1, 2).reshape(num * per, -1)[real]
    rows = tok[real]
    if merge:
        o, o_lse = lse_merge(out[rows], lse[rows], o, o_lse)
    out[rows] = o
    lse[rows] = o_lse


def lse_merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor):
    """Softmax-weighted sum of two partial attentions over disjoint keys: o [..., d], lse [...].
    A side with lse -inf (it saw no key) gets weight 0."""
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    total = w1 + w2
    inv = 1.0 / total.clamp_min(1e-30)
    merged = o1.float() * (w1 * inv)[..., None] + o2.float() * (w2 * inv)[..., None]
    return merged.to(o1.dtype), m + torch.log(total)


def attend(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, h, lq, d], k/v [b, h, lk, d] (any strides), mask additive [b, 1, lq, lk] or None.
    Returns out [b, h, lq, d] and the natural-log LSE [b, h, lq] in float32."""
    if _FLASH_OP is not None:
        try:
            o, lse = _FLASH_OP(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
            return o, lse.float()
        except RuntimeError as exc:  # unsupported dtype / layout on this build
            logger.debug("flash attention op refused the inputs (%s); using matmuls", exc)
    return attend_matmul(q, k, v, mask, scale)


def attend_matmul(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """attend as plain matmuls, where the flash op is missing or refuses the inputs (a GPU)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if mask is not None:
        s.add_(mask)
    m = s.amax(-1, keepdim=True).clamp_(min=-1e30)
    p = torch.exp_(s.sub_(m))
    den = p.sum(-1, keepdim=True)
    o = torch.matmul(p, v.float()).div_(den)
    return o.to(q.dtype), (m + torch.log(den)).squeeze(-1)
