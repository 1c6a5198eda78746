"""A few-shot sentiment classifier: labelled examples, then `select` over the labels.

    python -m radixserve.lang.examples.classify [--model DIR | --url URL]

Every input shares the few-shot block, so after the first request it is a cache hit; each
label is scored by its token logprobs after the prefix in one batched request.
"""
from __future__ import annotations

import argparse
import sys

from radixserve.lang import Backend, function, select
from radixserve.lang.examples.common import add_backend_args, make_backend

LABELS = ["positive", "negative", "neutral"]

SHOTS = [
    ("The food was wonderful and the staff were kind.", "positive"),
    ("I waited an hour and the soup was cold.", "negative"),
    ("The shop opens at nine on weekdays.", "neutral"),
    ("Best concert I have been to in years!", "positive"),
    ("The battery died after two days.", "negative"),
    ("The train leaves from platform four.", "neutral"),
]

INPUTS = [
    "An absolute delight from start to finish.",
    "The screen cracked the first time I dropped it.",
    "The meeting is scheduled for Tuesday.",
    "Terrible service, I will not come back.",
    "Lovely view and a very comfortable bed.",
    "The package weighs two kilograms.",
]


@function
def classify(s, text: str, method: str = "normalized"):
    s += "Classify the sentiment of each review as positive, negative or neutral.\n\n"
    for review, label in SHOTS:
        s += f"Review: {review}\nSentiment: {label}\n\n"
    s += f"Review: {text}\nSentiment: " + select("label", LABELS, method=method)


def run_classifier(backend: Backend, texts: list[str] = INPUTS, progress_bar: bool = False) -> list:
    return classify.run_batch([{"text": t} for t in texts], backend=backend, progress_bar=progress_bar)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_backend_args(parser)
    args = parser.parse_args(argv)
    backend = make_backend(args)
    try:
        states = run_classifier(backend, progress_bar=True)
        for text, state in zip(INPUTS, states):
            scores = state.get_meta_info("label")["normalized_logprobs"]
            shown = ", ".join(f"{label} {score:.2f}" for label, score in zip(LABELS, scores))
            print(f"{state['label']:>8}  {text}  ({shown})")
        records = [r for s in states for r in s.requests]
        prompt = sum(r.output.prompt_tokens for r in records)
        cached = sum(r.output.cached_tokens for r in records)
        print(f"{len(records)} scoring requests, hit rate {cached / max(prompt, 1):.1%}")
    finally:
        backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
