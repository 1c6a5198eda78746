"""stop_regex and no_stop_trim in the engine's output processor: the stop check and the stream hold-back.

The processor is driven with a scripted detokenizer (each token id adds a chosen piece of text), so the
properties are checked against a direct oracle: the request stops at the first token after which the
text so far contains a match, and is trimmed at the leftmost match; a stream never shows text that is
trimmed later (the concatenated deltas equal the final text).
"""
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.scheduler.output import OutputProcessor
from radixserve.scheduler.req import Req, StreamDelta
from radixserve.scheduler.sampling_params import SamplingParams

EOS = 0


class _PieceDetok:
    """Token id i adds pieces[i]; nothing is held back."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def add(self, token_id: int) -> str:
        return self.pieces[token_id]

    def finish(self) -> str:
        return ""


def _run(pieces: list[str], **params) -> tuple[Req, list[str]]:
    """Feeds pieces[1:] one token each (id 0 is EOS, never fed); returns the request and its deltas' texts."""
    req, deltas = _run_deltas(pieces, **params)
    return req, [d.text for d in deltas]


def _run_deltas(pieces: list[str], **params) -> tuple[Req, list[StreamDelta]]:
    params.setdefault("max_new_tokens", len(pieces))
    req = Req(rid="r", prompt_ids=[1], params=SamplingParams(**params), seed=0, arrival_step=0, arrival_time=0.0)
    req.detok = _PieceDetok(pieces)
    out = OutputProcessor((EOS,), context_length=10_000)
    deltas = []
    for token_id in range(1, len(pieces)):
        out.append_token(req, token_id, None)
        delta = out.take_delta(req)
        if delta is not None:
            deltas.append(delta)
        if req.finish_reason is not None:
            break
    if req.finish_reason is None:
        out.finish(req, "length")
        deltas.append(out.take_delta(req))
    return req, deltas


def _oracle(pieces: list[str], patterns: list[str], keep: bool) -> tuple[str, str | None]:
    text = ""
    for piece in pieces[1:]:
        text += piece
        hits = [(m.start(), m.end(), p) for p in patterns if (m := regex.search(p, text))]
        if hits:
            start, end, pattern = min(hits, key=lambda h: h[0])
            return (text[:end] if keep else text[:start]), pattern
    return text, None


def test_stop_regex_trims_and_reports_the_pattern():
    req, deltas = _run(["", "the answer ", "is 4", "2.", " Done"], stop_regex=r"\d+\.")
    assert req.finish_reason == "stop" and req.matched_stop == r"\d+\."
    assert req.text == "the answer is " and "".join(deltas) == req.text
    assert deltas[1] == "is "  # "4" could start a match: held back until "2." completes it
    kept, _ = _run(["", "the answer ", "is 4", "2.", " Done"], stop_regex=r"\d+\.", no_stop_trim=True)
    assert kept.text == "the answer is 42."


def test_stop_regex_list_earliest_match_and_stop_strings():
    req, _ = _run(["", "abc", "xyz", "END"], stop_regex=["y", "b.*z"])
    assert req.text == "a" and req.matched_stop == "b.*z"
    req, _ = _run(["", "abc", "xyz", "END"], stop_regex=["z"], stop=["c"])
    assert req.text == "ab" and req.matched_stop == "c"
    req, _ = _run(["", "abc", "xyz", "END"], stop=["xy"], no_stop_trim=True)
    assert req.text == "abcxy" and req.matched_stop == "xy"


def test_stop_regex_checked_once_min_new_tokens_are_out():
    """Before min_new_tokens nothing stops the request; from then on the earliest match in the text
    so far counts (as SGLang searches its recent text), also one completed earlier."""
    req, _ = _run(["", "1.", "2.", "3."], stop_regex=r"\d\.", min_new_tokens=2)
    assert req.text == "" and len(req.output_ids) == 2 and req.finish_reason == "stop"
    req, _ = _run(["", "1.", "2.", "3."], stop_regex=r"2\.", min_new_tokens=2)
    assert req.text == "1." and len(req.output_ids) == 2


def test_hold_back_is_released_when_no_match_can_follow():
    req, deltas = _run(["", "a", "b", "c", "d"], stop_regex="abx")
    assert deltas[:2] == ["", ""] and deltas[2] == "abc"  # "ab" held until "c" rules the match out
    assert req.finish_reason == "length" and req.text == "abcd"


PIECES = st.lists(st.text(alphabet="ab.1 ", min_size=0, max_size=3), min_size=1, max_size=12)
PATTERNS = st.lists(st.sampled_from([r"ab", r"a\.", r"b+\.", r"1 ?a", r"a.*1", r"\.\.", r"(?<=b)a", r"ba$",
                                     r"a[^.]{2}b"]), min_size=1, max_size=3, unique=True)


@settings(max_examples=300, deadline=None)
@given(PIECES, PATTERNS, st.booleans())
def test_stream_matches_oracle_and_never_shows_trimmed_text(pieces, patterns, keep):
    pieces = [""] + pieces
    req, deltas = _run(pieces, stop_regex=patterns, no_stop_trim=keep)
    expected_text, expected_pattern = _oracle(pieces, patterns, keep)
    assert req.text == expected_text
    assert req.matched_stop == expected_pattern
    assert req.finish_reason == ("stop" if expected_pattern else "length")
    assert "".join(deltas) == req.text


@settings(max_examples=200, deadline=None)
@given(PIECES, st.lists(st.sampled_from(["ab", "a.", ". 1"]), max_size=2), st.integers(0, 4))
def test_a_stream_interval_batches_deltas_without_losing_or_showing_held_text(pieces, stops, interval):
    """--stream-interval: the first token's delta at once, then one per `interval` new tokens, the last always; 0
    (nobody streams the request): the final delta only. The text and ids add up to the whole output either way."""
    pieces = [""] + pieces
    req, deltas = _run_deltas(pieces, stop=stops, stream_interval=interval)
    assert "".join(d.text for d in deltas) == req.text
    assert [t for d in deltas for t in d.token_ids] == req.output_ids
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    sizes = [len(d.token_ids) for d in deltas[:-1]]
    if interval == 0:
        assert sizes == []
    elif sizes:
        assert sizes[0] == 1 and all(n == interval for n in sizes[1:])  # interval 1: a delta per token, as before
