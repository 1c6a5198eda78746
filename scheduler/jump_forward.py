"""Jump-forward decoding: when a request's grammar admits exactly one continuation (a fixed JSON key,
punctuation), its tokens are appended at once and the next step computes them as one extend, instead
of one forward per token (the compressed-FSM idea of the SGLang paper).

Called by the engine right after a constrained request sampled token t, which the matcher has accepted
and which is neither in the KV cache (it is the pending token) nor handed out in a delta yet:

    output ids:  ... emitted, with KV ... | t |        t has no KV and was never streamed
    forced text:                              s        matcher.find_jump_forward_string()
    candidates:  retokenized  encode(text(t) + s)      replaces t (the boundary token may merge with s)
                 plain        [t] + encode(s)          keeps t

Only s's stable prefix is forced (stable_prefix: up to its last word end; what
follows may merge with text the model writes next), or all of s when it ends in an added token. The retokenization boundary is t's start, the last boundary that costs nothing to move: every token before t
already has KV and was already streamed, so nothing is released and the streamed ids and text stay a prefix
of the final ones. A candidate is used when (1) it has no special token, (2) decoding it after the last few
ids gives exactly the old text plus s (so the detokenizer and the stop checks see the same text either way),
and (3) the matcher accepts every token of it (for the retokenized one after rolling t back). Otherwise the
next candidate is tried, and with none the request simply decodes on. The matcher ends accepting the returned
ids; the caller appends them (each through the output processor's stop, length and context checks).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
CONTEXT_IDS = 4  # ids before t decoded with it, so context-dependent decoders (sentencepiece) are compared in place


def jump_forward_ids(matcher: Any, tokenizer: Any, context_ids: Sequence[int], token_id: int,
                     max_ids: int, special_ids: frozenset[int]) -> tuple[list[int], bool] | None:
    """The ids that replace the just-accepted `token_id` (it first, unless retokenized), or None for no
    jump. At most `max_ids` ids (what max_new_tokens and the context leave); the second value says whether
    token_id itself was replaced. On None the matcher is as it was (token_id accepted)."""
    if max_ids < 2:
        return None  # no room for a forced token after t
    forced = matcher.find_jump_forward_string()
    if not _ends_atomic(tokenizer, forced):
        forced = stable_prefix(forced)
    if not forced:
        return None
    ctx = list(context_ids[-CONTEXT_IDS:])
    before = _decode(tokenizer, ctx)
    with_t = _decode(tokenizer, ctx + [token_id])
    want = with_t + forced
    candidates: list[tuple[list[int], bool]] = []
    if with_t.startswith(before) and not with_t.endswith(_REPLACEMENT) and not before.endswith(_REPLACEMENT):
        retok = tokenizer.encode(with_t[len(before):] + forced, add_special_tokens=False)
        if retok:
            candidates.append((retok, retok[0] != token_id))
    plain = [token_id] + tokenizer.encode(forced, add_special_tokens=False)
    if all(plain != ids for ids, _ in candidates):
        candidates.append((plain, False))
    for ids, replaces in candidates:
        if len(ids) < 2 and not replaces:
            continue  # nothing forced beyond t
        if any(i in special_ids for i in ids) or _decode(tokenizer, ctx + ids) != want:
            continue
        ids = ids[:max_ids]
        if _accept_all(matcher, ids if replaces else ids[1:], undo=token_id if replaces else None):
            return ids, replaces
    return None


def _ends_atomic(tokenizer: Any, text: str) -> bool:
    """Whether text encodes to ids ending in an added token (e.g. '</tool_call>'): nothing merges across it."""
    added = getattr(tokenizer, "added_token_ids", None)
    if not text or not added:
        return False
    ids = tokenizer.encode(text, add_special_tokens=False)
    return bool(ids) and ids[-1] in added


def stable_prefix(forced: str) -> str:
    """The part of a forced string whose tokens cannot depend on the text after it: up to the last place where
    a letter or digit meets punctuation (BPE pre-tokenizers split words there, so no token crosses it).

    The rest is left for the model to write: text after the forced string may merge into its last word
    ('"arguments": {' encodes as [..., '":', ' ', '{'] where the model writes ' {"'), and forcing that lone
    ' ' or '{' would put the model in a context it never saw in training."""
    for i in range(len(forced) - 1, 0, -1):
        if forced[i - 1].isalnum() and not (forced[i].isalnum() or forced[i].isspace() or forced[i] == "_"):
            return forced[:i]
    return ""


def _accept_all(matcher: Any, ids: list[int], undo: int | None) -> bool:
    """Accept ids, after rolling back the last accepted token `undo` when given; on a rejection the
    matcher is restored (undo accepted again)."""
    if undo is not None:
        matcher.rollback(1)
    num = 0
    for tok in ids:
        if not matcher.accept_token(tok):
            break
        num += 1
    if num == len(ids):
        return True
    if num:
        matcher.rollback(num)
    if undo is not None and not matcher.accept_token(undo):
        raise RuntimeError(f"the grammar refused token {undo} after a rollback, having accepted it before")
    return False


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
