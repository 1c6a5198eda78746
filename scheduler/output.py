"""Per-token bookkeeping after a forward: append, detokenize, check stops, build deltas.

Stop strings and `stop_regex` end a request when they appear in the output text. The text is trimmed at
the start of the earliest match (kept up to its end with `no_stop_trim`). While a request runs, text that
could still become part of a match is held back, so a trimmed stop never reaches a stream:

* stop strings: the longest suffix of the text that is a proper prefix of a stop string;
* stop_regex: everything from the earliest position where a match could still start. That is the start
  of the leftmost *partial* match (the `regex` module's `partial=True`: a match attempt that reached the
  end of the text without failing), so a pattern such as `a.*b` holds text back from an `a` until a `b`
  comes or the request ends. Every position before the emitted end was, when emitted, not the start of a
  complete or partial match, and extending the text cannot change that (a future match starting there
  would have been complete or partial already), so stop_regex is searched only from the emitted end.
  Anchors see the output text so far: `$` matches at its current end. Before min_new_tokens tokens are
  out nothing stops the request; from then on the earliest match in the text counts.
"""
from __future__ import annotations

import time

from ..kernels.forward_io import SeqOutput, TokenLogprob
from .req import Req, StreamDelta
from .sampling_params import stop_regex_pattern

# One stop_regex search may take this long; a pattern that takes longer (catastrophic backtracking)
# aborts its request instead of stalling the engine.
STOP_REGEX_TIMEOUT_S = 1.0


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
        """Text and tokens not yet handed out. While running, text that may become (part of) a
        stop string or stop_regex match is held back so a trimmed stop never reaches a stream."""
        done = req.finish_reason is not None
        if not done and _held_for_interval(req):
            return None
        end = len(req.text)
        if not done:
            end -= _stop_prefix_overlap(req.text, req.params.stop)
            if req.params.stop_regex:
                end = min(end, self._regex_hold_start(req))
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
            hit = _find_stop(req.text, p.stop, prev_text_len) if p.stop else None
            if p.stop_regex and len(req.text) > prev_text_len:
                try:
                    hit = _earliest(hit, _find_stop_regex(req.text, p.stop_regex, req.emitted_len))
                except TimeoutError:
                    return self.finish(req, "abort", error=f"stop_regex took longer than {STOP_REGEX_TIMEOUT_S} s")
            if hit is not None:
                start, end, matched = hit
                req.text = req.text[:end] if p.no_stop_trim else req.text[:start]
                return self.finish(req, "stop", matched)
        if num_out >= p.max_new_tokens:
            return self.finish(req, "length")
        if req.seq_len >= self.context_length:
            return self.finish(req, "length")

    def _regex_hold_start(self, req: Req) -> int:
        """Where a stop_regex match could still start (len(text) if nowhere): the leftmost partial match."""
        start = len(req.text)
        for pattern in req.params.stop_regex:
            try:
                m = stop_regex_pattern(pattern).search(req.text, req.emitted_len, partial=True,
                                                       timeout=STOP_REGEX_TIMEOUT_S)
            except TimeoutError:  # the next stop check aborts the request; hold everything until then
                return req.emitted_len
            if m is not None:
                start = min(start, m.start())
        return start


def _held_for_interval(req: Req) -> bool:
    """A running request's delta waits for its stream interval (SamplingParams.stream_interval): none while nobody
    streams it (0), else until `interval` new tokens are out; the first token goes at once."""
    interval = req.params.stream_interval
    if interval == 1:
        return False
    return interval == 0 or (req.emitted_tokens > 0 and len(req.output_ids) - req.emitted_tokens < interval)


# A stop hit: (start, end, matched) — the match is text[start:end]; matched is what matched_stop reports.
StopHit = tuple[int, int, str]


def _find_stop(text: str, stops: list[str], prev_len: int) -> StopHit | None:
    """Earliest stop string that ends in the newly added text."""
    best: StopHit | None = None
    for stop in stops:
        idx = text.find(stop, max(0, prev_len - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, idx + len(stop), stop)
    return best


def _find_stop_regex(text: str, patterns: list[str], from_pos: int) -> StopHit | None:
    """Earliest complete stop_regex match starting at or after from_pos (the emitted end: see the
    module docstring); matched is the pattern, as SGLang reports it."""
    best: StopHit | None = None
    for pattern in patterns:
        m = stop_regex_pattern(pattern).search(text, from_pos, timeout=STOP_REGEX_TIMEOUT_S)
        if m is not None and (best is None or m.start() < best[0]):
            best = (m.start(), m.end(), pattern)
    return best


def _earliest(a: StopHit | None, b: StopHit | None) -> StopHit | None:
    if a is None or b is None:
        return a if b is None else b
    return a if a[0] <= b[0] else b


def _stop_prefix_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
