"""Per-token bookkeeping after a forward: append, detokenize, check stops, build deltas."""
from __future__ import annotations

import time

from radixserve.kernels.forward_io import SeqOutput, TokenLogprob
from radixserve.scheduler.req import Req, StreamDelta


class OutputProcessor:
    def __init__(self, eos_token_ids: tuple[int, ...], context_length: int):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length

    def record_prompt_logprobs(self, req: Req, prefix_len: int, out: SeqOutput) -> None:
        """Append prompt logprobs in position order. A chunk also scores the next chunk's
        first token (the runner looks one token ahead), so chunks cover the prompt without
        gaps; positions already recorded are skipped."""
        if req.params.logprob_start_len is None or not out.prompt_logprobs:
            return
        first_pos = max(1, req.params.logprob_start_len, prefix_len + 1)
        next_pos = max(1, req.params.logprob_start_len) + len(req.prompt_logprobs)
        for offset, lp in enumerate(out.prompt_logprobs):
            if first_pos + offset == next_pos and next_pos < len(req.prompt_ids):
                req.prompt_logprobs.append(lp)
                next_pos += 1

    def append_token(self, req: Req, token_id: int, logprob: TokenLogprob | None) -> None:
        now = time.perf_counter()
        if req.first_token_time is None:
            req.first_token_time = now
        req.output_ids.append(token_id)
        if logprob is not None and req.params.logprobs is not None:
            req.output_logprobs.append(logprob)
        prev_len = len(req.text)
        req.text += req.detok.add(token_id)
        self._check_stop(req, token_id, prev_len)

    def finish(self, req: Req, reason: str, matched: int | str | None = None, error: str | None = None) -> None:
        if req.finish_reason is not None:
            return
        req.finish_reason = reason
        req.matched_stop = matched
        req.error = error
        req.finish_time = time.perf_counter()
        if not isinstance(matched, str) and req.detok is not None:
            req.text += req.detok.finish()

    def take_delta(self, req: Req) -> StreamDelta | None:
        """Text and tokens not yet handed out. While running, text that may be the start of
        a stop string is held back so a trimmed stop never reaches a stream."""
        done = req.finish_reason is not None
        end = len(req.text) if done else len(req.text) - _stop_prefix_overlap(req.text, req.params.stop)
        end = max(end, req.emitted_len)
        new_ids = req.output_ids[req.emitted_tokens:]
        if not done and end == req.emitted_len and not new_ids:
            return None
        lps = req.output_logprobs[req.emitted_tokens:] if req.params.logprobs is not None else []
        delta = StreamDelta(rid=req.rid, text=req.text[req.emitted_len:end], token_ids=list(new_ids),
                            logprobs=list(lps), finished=done, result=req.to_result() if done else None)
        req.emitted_len = end
        req.emitted_tokens = len(req.output_ids)
        return delta

    def _check_stop(self, req: Req, token_id: int, prev_text_len: int) -> None:
        p = req.params
        num_out = len(req.output_ids)
        if num_out >= p.min_new_tokens:
            if token_id in self.eos_token_ids and not p.ignore_eos:
                return self.finish(req, "stop", token_id)
            if token_id in p.stop_token_ids:
                return self.finish(req, "stop", token_id)
            if p.stop:
                hit = _find_stop(req.text, p.stop, prev_text_len)
                if hit is not None:
                    idx, stop = hit
                    req.text = req.text[:idx]
                    return self.finish(req, "stop", stop)
        if num_out >= p.max_new_tokens:
            return self.finish(req, "length")
        if req.seq_len >= self.context_length:
            return self.finish(req, "length")


def _find_stop(text: str, stops: list[str], prev_len: int) -> tuple[int, str] | None:
    """Earliest stop string that ends in the newly added text."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, prev_len - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def _stop_prefix_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
