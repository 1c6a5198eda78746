"""frontend/reasoning.py: the incremental <think> splitter, parser resolution, the thinking switch and efforts."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from radixserve.frontend.config import ServerConfig
from radixserve.frontend.reasoning import (
    CLOSE_TAG,
    EFFORT_BUDGETS,
    OPEN_TAG,
    ReasoningSplitter,
    budget_params,
    effort_settings,
    prompt_state,
    reasoning_token_count,
    resolve_syntax,
    split_output,
    supports_thinking_toggle,
    thinking_template_kwargs,
)

QWEN3 = resolve_syntax("qwen3", None)
R1 = resolve_syntax("deepseek-r1", None)


def split_at_once(text: str, in_reasoning: bool, syntax=QWEN3) -> tuple[str, str]:
    s = ReasoningSplitter(syntax, in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


@pytest.mark.parametrize("text, in_reasoning, want", [
    ("<think>\nplan it\n</think>\n\nThe answer.", False, ("plan it", "The answer.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("no tags at all", False, ("", "no tags at all")),
    ("no tags at all", True, ("no tags at all", "")),  # opened by the prompt, never closed (cut short)
    ("plan\n</think>\n\nanswer", True, ("plan", "answer")),  # Qwen3-Thinking / DeepSeek-R1-0528: opened in the prompt
    ("<think>plan</think>answer", True, ("plan", "answer")),  # a model that repeats the open tag
    ("<thinking> is a word", False, ("", "<thinking> is a word")),
    ("<think>\n\n</think>\n\nhi", False, ("", "hi")),
    ("answer with </think> inside", False, ("", "answer with </think> inside")),  # content never reopens
    ("<think>a</think>b<think>c</think>", False, ("a", "b<think>c</think>")),
    ("<think>cut off </thi", False, ("cut off </thi", "")),  # a partial tag at the end is the model's text
    ("", False, ("", "")),
])
def test_split(text, in_reasoning, want):
    assert split_at_once(text, in_reasoning) == want


TEXTS = st.builds(
    lambda pre, a, mid, b, post: pre + a + mid + b + post,
    st.sampled_from(["", " ", "\n", OPEN_TAG, " " + OPEN_TAG + "\n", "<th", "<thinking>"]),
    st.text("ab <>/\n", max_size=12),
    st.sampled_from(["", CLOSE_TAG, "\n" + CLOSE_TAG + "\n\n", "</thi", "</ think>", "</"]),
    st.text("ab <>/\n", max_size=12),
    st.sampled_from(["", OPEN_TAG, CLOSE_TAG, " x"]),
)


@settings(max_examples=400, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(0, 60), max_size=8), in_reasoning=st.booleans(),
       forced=st.booleans())
def test_any_cut_gives_the_same_split_and_no_partial_tag(text, cuts, in_reasoning, forced):
    syntax = R1 if forced else QWEN3
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])]
    s = ReasoningSplitter(syntax, in_reasoning)
    deltas = [s.feed(p, 1) for p in pieces] + [s.finish()]
    reasoning = "".join(r for r, _ in deltas)
    content = "".join(c for _, c in deltas)
    whole = split_at_once(text, in_reasoning, syntax)
    assert (reasoning, content) == whole
    # Nothing streamed is taken back: every streamed prefix is a prefix of the final split, so no delta holds a
    # piece of a tag the split consumed (the final reasoning and content never contain those tags).
    shown_r = shown_c = ""
    for r, c in deltas:
        shown_r, shown_c = shown_r + r, shown_c + c
        assert whole[0].startswith(shown_r) and whole[1].startswith(shown_c)
    assert CLOSE_TAG not in whole[0]  # the first close tag ends the reasoning
    assert s.reasoning_tokens <= len(pieces)


def test_partial_tags_are_held_back_while_streaming():
    s = ReasoningSplitter(QWEN3, False)
    assert s.feed("<", 1) == ("", "") and s.feed("thi", 1) == ("", "") and s.feed("nk>", 1) == ("", "")
    assert s.feed("plan ", 1) == ("plan", "")  # trailing whitespace waits: it may precede the close tag
    assert s.feed("more</", 1) == (" more", "")
    assert s.feed("think", 1) == ("", "")
    assert s.feed(">\n\n", 1) == ("", "")
    assert s.feed("Yes", 1) == ("", "Yes")
    assert s.finish() == ("", "")
    assert s.reasoning_tokens == 7 and s.closed  # the three open-tag tokens, plan, more, think, the close


def test_content_only_counts_no_reasoning_tokens():
    s = ReasoningSplitter(QWEN3, False)
    for piece in ["<", "b", "c"]:
        s.feed(piece, 1)
    s.finish()
    assert s.reasoning_tokens == 0 and not s.entered


class _CharTokenizer:
    """One token per character: decode(ids) is the characters."""

    def __init__(self, text: str) -> None:
        self.text = text

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.text[i] for i in ids)


@pytest.mark.parametrize("text, in_reasoning, want", [
    ("<think>ab</think>cd", False, len("<think>ab</think>")),
    ("ab</think>cd", True, len("ab</think>")),
    ("abcd", True, 4),
    ("abcd", False, 0),
])
def test_split_output_counts_tokens_up_to_the_close(text, in_reasoning, want):
    tok = _CharTokenizer(text)
    s = ReasoningSplitter(QWEN3, in_reasoning)
    split_output(s, text, list(range(len(text))), tok)
    assert s.reasoning_tokens == want
    streamed = ReasoningSplitter(QWEN3, in_reasoning)
    for ch in text:
        streamed.feed(ch, 1)
    assert streamed.reasoning_tokens == want
    if in_reasoning or text.startswith(OPEN_TAG):
        assert reasoning_token_count(QWEN3, in_reasoning, list(range(len(text))), tok) == want


def test_prompt_state():
    assert prompt_state("<|im_start|>assistant\n<think>\n", QWEN3) == "open"
    assert prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n", QWEN3) == "closed"
    assert prompt_state("<think>x</think>old<|im_end|>\n<|im_start|>assistant\n", QWEN3) == "none"
    assert prompt_state("<|im_start|>assistant\n", QWEN3) == "none"


QWEN3_LIKE = "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
R1_LIKE = "{{'<｜Assistant｜>'}}{% set c = c.split('</think>')[-1] %}<think>\n"


def test_auto_resolution_and_the_thinking_switch():
    assert resolve_syntax("auto", QWEN3_LIKE).kind == "qwen3"
    assert resolve_syntax("auto", {"default": R1_LIKE}).kind == "deepseek-r1"
    assert resolve_syntax("auto", "{{ messages }}") is None
    assert resolve_syntax(None, QWEN3_LIKE) is None
    with pytest.raises(ValueError, match="reasoning_parser"):
        resolve_syntax("gpt-oss", None)
    assert supports_thinking_toggle(QWEN3_LIKE) and not supports_thinking_toggle(R1_LIKE)
    assert thinking_template_kwargs(False, QWEN3_LIKE) == {"enable_thinking": False}
    assert thinking_template_kwargs(False, R1_LIKE) == {} and thinking_template_kwargs(None, QWEN3_LIKE) == {}


def test_efforts_and_budget_params():
    assert effort_settings(None) == (None, None)
    assert effort_settings("none") == (False, None) and effort_settings("minimal") == (False, None)
    assert effort_settings("low") == (True, EFFORT_BUDGETS["low"])
    assert EFFORT_BUDGETS["low"] < EFFORT_BUDGETS["medium"] < EFFORT_BUDGETS["high"]
    with pytest.raises(ValueError, match="low"):
        effort_settings("max")
    opened = ReasoningSplitter(QWEN3, True)
    assert budget_params(QWEN3, 8, opened) == {"reasoning_budget": 8, "reasoning_end": "\n</think>\n\n",
                                               "reasoning_open": None}
    assert budget_params(QWEN3, 8, ReasoningSplitter(QWEN3, False))["reasoning_open"] == OPEN_TAG
    assert budget_params(QWEN3, None, opened) == {"reasoning_end": "\n</think>\n\n", "reasoning_open": None}
    assert budget_params(None, 8, None) == {} and budget_params(QWEN3, 8, None) == {}


def test_server_flag():
    assert ServerConfig(reasoning_parser="auto").reasoning_parser == "auto"
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="o1")


def test_plan_reads_where_the_prompt_leaves_the_output(tmp_path):
    from radixserve.bench.demo_kit.tokenizer import build_tokenizer
    from radixserve.frontend.reasoning import plan_reasoning
    from radixserve.scheduler.tokenizer import Tokenizer

    build_tokenizer(str(tmp_path), 512)
    tok = Tokenizer(str(tmp_path))
    head = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    opened = plan_reasoning(QWEN3, tok, tok.encode(head + "<think>\n"), budget=7)
    assert opened.splitter().starts_in_reasoning and opened.sampling() == {
        "reasoning_end": "\n</think>\n\n", "reasoning_open": None, "reasoning_budget": 7}
    plain = plan_reasoning(QWEN3, tok, tok.encode(head))
    assert not plain.splitter().starts_in_reasoning and plain.sampling()["reasoning_open"] == OPEN_TAG
    assert plan_reasoning(R1, tok, tok.encode(head)).splitter().starts_in_reasoning  # R1 starts inside anyway
    off = plan_reasoning(QWEN3, tok, tok.encode(head + "<think>\n\n</think>\n\n"), budget=7)
    assert off.splitter() is None and off.sampling() == {}  # thinking turned off: all answer, no budget
    assert plan_reasoning(None, tok, tok.encode(head)).sampling() == {}
