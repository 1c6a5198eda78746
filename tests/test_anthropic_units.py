"""The Messages API's pieces without a server: the content-block builder's events (any cut of the text gives the same
blocks, every block opened once and closed once, in order), stop reasons, usage, thinking signatures, and the error
format chosen by path."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.frontend.anthropic_output import MessageContent, message_usage, stop_reason
from radixserve.frontend.errors import APIError, anthropic_path
from radixserve.frontend.reasoning import ReasoningSplitter, resolve_syntax
from radixserve.frontend.thinking_signature import sign, signing_key, verify
from radixserve.scheduler.req import GenerateResult

KEY = b"k" * 32
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TEXT = "<think>\nplan it\n</think>\n\nLet me look." + CALL + CALL.replace("Paris", "Rome")


def _content(single_call: bool = False) -> MessageContent:
    return MessageContent(ReasoningSplitter(resolve_syntax("qwen3", None), in_reasoning=False), True, KEY, single_call)


def _run(content: MessageContent, pieces: list[str]) -> list[dict]:
    events = [e for piece in pieces for e in content.feed(piece, 1)]
    return events + content.finish(cut=False)


def _cuts(text: str, points: list[int]) -> list[str]:
    points = sorted({p % (len(text) + 1) for p in points})
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_any_cut_gives_the_same_blocks_and_well_formed_events(points):
    whole = _content()
    _run(whole, [TEXT])
    cut = _content()
    events = _run(cut, _cuts(TEXT, points))
    assert _without_ids(cut.blocks) == _without_ids(whole.blocks)
    assert [b["type"] for b in cut.blocks] == ["thinking", "text", "tool_use", "tool_use"]
    assert cut.blocks[0] == {"type": "thinking", "thinking": "plan it", "signature": sign(KEY, "plan it")}
    assert cut.blocks[1]["text"] == "Let me look." and cut.blocks[3]["input"] == {"city": "Rome"}
    open_index = None
    starts = []
    for event in events:  # each block: start, its deltas, stop; the next starts only after
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == len(starts)
            open_index = event["index"]
            starts.append(event["content_block"])
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
        else:
            assert event == {"type": "content_block_stop", "index": open_index}
            open_index = None
    assert open_index is None and len(starts) == 4
    assert starts[2]["input"] == {} and starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    partial = [e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"]
    assert [json.loads(p) for p in partial] == [{"city": "Paris"}, {"city": "Rome"}]
    signatures = [e["delta"]["signature"] for e in events if e.get("delta", {}).get("type") == "signature_delta"]
    assert signatures == [sign(KEY, "plan it")]


def _without_ids(blocks: list[dict]) -> list[dict]:
    assert all(b["id"].startswith("toolu_") for b in blocks if b["type"] == "tool_use")
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def test_single_call_keeps_the_first_and_non_object_arguments_stay_text():
    content = _content(single_call=True)
    _run(content, [TEXT])
    assert [b["type"] for b in content.blocks] == ["thinking", "text", "tool_use"] and content.num_calls == 1
    odd = MessageContent(None, True, KEY, False)
    _run(odd, ['<tool_call>{"name": "f", "arguments": "not json"}</tool_call>'])
    assert [b["type"] for b in odd.blocks] == ["text"] and '"f"' in odd.blocks[0]["text"] and odd.num_calls == 0


def _result(finish: str, matched=None, cached: int = 0) -> GenerateResult:
    return GenerateResult(rid="r", text="", output_ids=[1, 2], prompt_tokens=10, cached_tokens=cached,
                          completion_tokens=2, finish_reason=finish, matched_stop=matched)


def test_stop_reasons_and_usage():
    assert stop_reason(_result("length"), True, []) == ("max_tokens", None)
    assert stop_reason(_result("stop", 7), True, []) == ("tool_use", None)
    assert stop_reason(_result("stop", "END"), False, ["END"]) == ("stop_sequence", "END")
    assert stop_reason(_result("stop", 7), False, ["END"]) == ("end_turn", None)
    assert message_usage(10, _result("stop", cached=6), 3) == {
        "input_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 6, "output_tokens": 2,
        "output_tokens_details": {"thinking_tokens": 3}}


def test_signatures_and_keys(monkeypatch):
    assert verify(KEY, "thought", sign(KEY, "thought"))
    assert not verify(KEY, "thought!", sign(KEY, "thought")) and not verify(b"other", "thought", sign(KEY, "thought"))
    assert not verify(KEY, "thought", "not base64 at all \udcff")
    monkeypatch.setenv("RADIXSERVE_THINKING_KEY", "from-env")
    assert signing_key(None) == b"from-env" and signing_key("flag") == b"flag"
    monkeypatch.delenv("RADIXSERVE_THINKING_KEY")
    assert signing_key(None) != signing_key(None)  # random per start


def test_error_format_by_path():
    assert anthropic_path("/v1/messages") and anthropic_path("/v1/messages/count_tokens")
    assert not anthropic_path("/v1/messagesx") and not anthropic_path("/v1/chat/completions")
    for status, kind in [(400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
                         (405, "invalid_request_error"), (413, "request_too_large"), (429, "rate_limit_error"),
                         (500, "api_error"), (503, "overloaded_error")]:
        error = APIError(status, "why")
        assert json.loads(error.response("/v1/messages").body) == {"type": "error",
                                                                   "error": {"type": kind, "message": "why"}}
        assert set(json.loads(error.response("/v1/models").body)["error"]) == {"message", "type", "param", "code"}
