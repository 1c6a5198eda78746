"""Held-out prompts of the demo model and their checks: what train.py reports in eval.json and what the tests
ask the served model (tests/test_demo_model.py). Each case is (messages, tools, check); check(reply) says whether
the greedy reply is right. The sets are built from bench/demo_kit/data.py's held-out lists, so nothing here was
trained on (except the "trained" sanity sets).
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from . import arith
from . import data

Case = tuple[list[dict[str, Any]], list[dict[str, Any]] | None, Callable[[str], bool]]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def contains(expected: str) -> Callable[[str], bool]:
    pattern = re.compile(r"(?<![\w.])" + re.escape(expected) + r"(?![\w])")
    return lambda reply: bool(pattern.search(reply))


def weather_call(city: str) -> str:
    return '<tool_call>{"name": "get_weather", "arguments": ' + json.dumps({"city": city}) + "}</tool_call>"


def _exact(expected: str) -> Callable[[str], bool]:
    return lambda reply: reply.strip() == expected


def heldout_pairs(count: int = 32) -> list[tuple[int, int]]:
    """`count` of the held-out operand pairs, spread evenly over all of them."""
    n = arith.SUM_MAX + 1
    pairs = [(a, b) for a in range(n) for b in range(n) if arith.is_heldout_pair(a, b)]
    return pairs[::max(1, len(pairs) // count)][:count]


def final_number(expected: int) -> Callable[[str], bool]:
    """The reply's last number is `expected` (a column sum's steps hold other numbers first)."""
    return lambda reply: re.findall(r"-?\d+", reply)[-1:] == [str(expected)]


def _sum_case(phrasing: str, a: int, b: int) -> Case:
    return _user(phrasing.format(a=a, b=b)), None, final_number(a + b)


def _weather_case(phrasing: str, city: str) -> Case:
    """The question with get_weather offered; right = exactly the call with {"city": city}."""
    return _user(phrasing.format(c=city)), [WEATHER_TOOL], _exact(weather_call(city))


def case_sets() -> dict[str, list[Case]]:
    trained_countries = [c for c in data.CAPITALS if c not in data.STATEMENT_ONLY]
    phrasing = data.CAPITAL_PHRASINGS[0]
    sets: dict[str, list[Case]] = {
        "capital_trained": [(_user(phrasing.format(c=c)), None, contains(data.CAPITALS[c]))
                            for c in trained_countries],
        "capital_heldout_phrasing": [(_user(p.format(c=c)), None, contains(data.CAPITALS[c]))
                                     for p in data.HELDOUT_PHRASINGS["capital"] for c in trained_countries],
        "capital_statement_only": [(_user(phrasing.format(c=c)), None, contains(data.CAPITALS[c]))
                                   for c in data.STATEMENT_ONLY],
        "sum_one_digit": [_sum_case(arith.SUM_PHRASINGS[0], a, b) for a in range(10) for b in range(0, 10, 3)],
        "sum_heldout_pairs": [_sum_case(arith.SUM_PHRASINGS[0], a, b) for a, b in heldout_pairs()],
        "sum_heldout_phrasing": [_sum_case(p, a, b) for p in data.HELDOUT_PHRASINGS["sum"]
                                 for a, b in ((2, 3), (7, 8), (15, 4))],
        "weather_trained_city": [_weather_case(data.WEATHER_PHRASINGS[0], c) for c in data.WEATHER_CITIES],
        "weather_heldout_city": [_weather_case(data.WEATHER_PHRASINGS[0], c) for c in data.HELDOUT_CITIES],
        "weather_heldout_phrasing": [_weather_case(p, c) for p in data.HELDOUT_PHRASINGS["weather"]
                                     for c in ("Paris", "Tokyo", "Berlin")],
    }
    return sets


def evaluate(model_dir: str, max_new_tokens: int = 64) -> dict[str, Any]:
    """Greedy replies (transformers, one thread is enough) to every case: accuracy per set, and how many replies
    did not end with EOS within max_new_tokens."""
    import torch
    import transformers

    from ...scheduler.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results: dict[str, Any] = {}
    no_eos = 0
    for name, cases in case_sets().items():
        right = 0
        for messages, tools, check in cases:
            ids = tok.apply_chat_template(messages, tools=tools)
            out = greedy(model, ids, tok.eos_token_ids, max_new_tokens)
            ended = bool(out) and out[-1] in tok.eos_token_ids
            no_eos += not ended
            right += check(tok.decode(out, skip_special_tokens=True))
        results[name] = f"{right}/{len(cases)}"
    results["replies_without_eos_within_64"] = no_eos
    return results


def greedy(model, ids: list[int], eos_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_ids, pad_token_id=eos_ids[-1])
    return out[0, len(ids):].tolist()
