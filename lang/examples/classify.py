"""A request classifier: `select` labels each request with the tool that should handle it.

    python -m radixserve.lang.examples.classify [--model DIR | --url URL]

Every request starts with the same system turn, the tool preamble of a Hermes / Qwen-style chat
template (the tools' JSON schemas and how to call them), so after the first request it is a cache
hit. The assistant's turn opens a tool call, `<tool_call>{"name": "`, and `select` scores each
tool's name by its token logprobs after that prefix, all labels in one batched request: the label
is the tool the model would call. The built-in demo model was trained on exactly this format
(weather questions to get_weather, arithmetic to calculator), so it labels these requests right,
two cities it never saw in a weather question (Lisbon, Kyoto) and an invented one included.
"""
from __future__ import annotations

import argparse
import json
import sys

from .. import Backend, assistant, function, select, system, user
from .common import add_backend_args, make_backend


def _tool(name: str, description: str, arg: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}


TOOLS = [_tool("get_weather", "Get the current weather in a city", "city"),
         _tool("calculator", "Evaluate an arithmetic expression", "expression")]
LABELS = [t["function"]["name"] for t in TOOLS]

# What the chat template renders for `tools` (kernels/demo_checkpoint/tokenizer_config.json), as a system turn.
TOOL_PREAMBLE = (
    "# Tools\n\nYou may call one or more of the functions described, as JSON, inside <tools></tools>:\n<tools>"
    + "".join("\n" + json.dumps(tool) for tool in TOOLS)
    + "\n</tools>\n\nTo call a function, answer with its name and arguments as a JSON object inside "
    '<tool_call></tool_call> tags:\n<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>')

INPUTS = [
    "Is it raining in Lisbon?",
    "How much is 312 * 7?",
    "What's the weather like in Kyoto?",
    "Calculate 45 / 9.",
    "Check the forecast for Zanvorik, please.",
    "Please compute 880 - 47.",
]


@function
def classify(s, text: str, method: str = "normalized"):
    s += system(TOOL_PREAMBLE)
    s += user(text)
    s += assistant('<tool_call>{"name": "' + select("label", LABELS, method=method))


def run_classifier(backend: Backend, texts: list[str] = INPUTS, progress_bar: bool = False) -> list:
    return classify.run_batch([{"text": t} for t in texts], backend=backend, progress_bar=progress_bar)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_backend_args(parser)
    args = parser.parse_args(argv)
    backend = make_backend(args)
    try:
        states = run_classifier(backend, progress_bar=True)
        width = max(map(len, LABELS))
        for text, state in zip(INPUTS, states):
            scores = state.get_meta_info("label")["normalized_logprobs"]
            shown = ", ".join(f"{label} {score:.2f}" for label, score in zip(LABELS, scores))
            print(f"{state['label']:>{width}}  {text}  ({shown})")
        records = [r for s in states for r in s.requests]
        prompt = sum(r.output.prompt_tokens for r in records)
        cached = sum(r.output.cached_tokens for r in records)
        print(f"{len(records)} scoring requests, hit rate {cached / max(prompt, 1):.1%}")
    finally:
        backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
