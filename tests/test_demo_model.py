"""The built-in demo model (kernels/demo_checkpoint/, trained by bench/demo_kit/train.py) on the real engine:
greedy replies to facts, including phrasings held out of its corpus (bench/demo_kit/eval_cases.py), every reply ending with
EOS well before 64 tokens; and the files it ships with. Each held-out set is asserted at a floor a little under
what was measured at training time (eval.json, MODEL_CARD.md).
"""
from __future__ import annotations

import json
import os

import pytest

from radixserve.bench.demo_kit import data as demo_data, eval_cases as demo_eval
from radixserve.kernels.demo import DEMO_CHECKPOINT_DIR, demo_model_path

MAX_NEW = 64


@pytest.fixture(scope="module")
def engine():
    from radixserve.scheduler.engine import Engine

    eng = Engine(None, num_threads=1, kv_cache_tokens=16384, max_running_requests=64)
    yield eng
    eng.shutdown()


def _replies(engine, cases) -> list:
    prompts = [engine.tokenizer.apply_chat_template(messages, tools=tools) for messages, tools, _ in cases]
    return engine.generate(prompts, {"max_new_tokens": MAX_NEW, "temperature": 0.0})


def _ends_with_eos(result) -> bool:
    return result.finish_reason == "stop" and result.completion_tokens < MAX_NEW


def test_engine_none_loads_the_shipped_trained_model(engine):
    assert engine.model_path == demo_model_path() == DEMO_CHECKPOINT_DIR
    files = set(os.listdir(DEMO_CHECKPOINT_DIR))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "MODEL_CARD.md"} <= files
    assert os.path.getsize(os.path.join(DEMO_CHECKPOINT_DIR, "model.safetensors")) <= 16 * 2**20
    with open(os.path.join(DEMO_CHECKPOINT_DIR, "generation_config.json")) as f:
        assert json.load(f)["max_new_tokens"] == engine.tokenizer.default_max_new_tokens == 256


@pytest.mark.parametrize("question, answer", [
    ("What is the capital of France?", "Paris"),
    ("Hello! What is the capital of France?", "Paris"),  # the README's first request
    ("What day comes after Monday?", "Tuesday"),
    ("What is 2 + 3?", "5"),
    ("What is 37 + 48?", "85"),
    ("Hello!", "Hello"),
])
def test_named_questions(engine, question, answer):
    [result] = _replies(engine, [([{"role": "user", "content": question}], None, None)])
    assert demo_eval.contains(answer)(result.text), result.text
    assert _ends_with_eos(result), result


# Least accuracy per held-out set (measured at training time: eval.json and MODEL_CARD.md). Of the six held-out
# cities one ("Montevideo") is miscopied.
THRESHOLDS = {"capital_trained": 0.95, "capital_heldout_phrasing": 0.9, "weather_heldout_phrasing": 0.8,
              "weather_trained_city": 0.9, "weather_heldout_city": 0.8, "sum_one_digit": 0.9,
              "sum_heldout_phrasing": 0.8, "sum_heldout_pairs": 0.85}


@pytest.mark.parametrize("name", sorted(THRESHOLDS))
def test_heldout_sets(engine, name):
    cases = demo_eval.case_sets()[name]
    results = _replies(engine, cases)
    no_eos = [r.text for r in results if not _ends_with_eos(r)]
    assert not no_eos, no_eos
    wrong = [(c[0][-1]["content"], r.text) for c, r in zip(cases, results) if not c[2](r.text)]
    assert 1 - len(wrong) / len(cases) >= THRESHOLDS[name], wrong


def test_heldout_sets_are_really_held_out():
    """The evaluation prompts' phrasings, operand pairs and cities never occur in the training stream."""
    gen = demo_data.Generator(0)
    seen = set()
    for _ in range(3000):
        sample = gen.sample()
        for m in sample.messages:
            if m["role"] == "user" and isinstance(m["content"], str):
                seen.add(m["content"])
    for name in ("capital_heldout_phrasing", "sum_heldout_pairs", "sum_heldout_phrasing", "weather_heldout_city"):
        for messages, _, _ in demo_eval.case_sets()[name]:
            assert messages[-1]["content"] not in seen, messages
    assert not any(city in text for city in demo_data.HELDOUT_CITIES for text in seen if "weather" in text)
