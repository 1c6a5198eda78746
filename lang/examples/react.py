"""ReAct agents: Thought / Action / Observation steps with two Python tools.

Each step the model writes a thought, `select` picks the tool, the model writes the tool's
input, and the tool's result comes back as the observation. All agents share the system prompt
and each agent's prompt grows step by step, so nearly every prompt token is a cache hit.

    python -m radixserve.lang.examples.react                 # in-process, built-in demo model
    python -m radixserve.lang.examples.react --model DIR     # in-process, a checkpoint
    python -m radixserve.lang.examples.react --url http://127.0.0.1:30000   # a running server

It prints each agent's trace summary, the hit rate (Σ cached / Σ prompt tokens over the requests
it sent) and the optimal hit rate (ARCHITECTURE §12) of those same prompts, one round per step.
"""
from __future__ import annotations

import argparse
import ast
import operator
import sys
from typing import Callable

from .. import Backend, function, gen, select, system, user
from ..accounting import CacheReport, cache_report
from .common import add_backend_args, make_backend

FACTS = {
    "speed of light": "299792458",
    "earth radius km": "6371",
    "moon distance km": "384400",
    "days per year": "365",
    "hours per day": "24",
    "seconds per hour": "3600",
    "water boiling point c": "100",
    "pi": "3.14159",
}

QUESTIONS = [
    "How many seconds are in a day?",
    "How many hours are in a year?",
    "What is the circumference of the earth in km?",
    "How far does light travel in one hour, in meters?",
    "How many earth radii is the moon away?",
    "What is the boiling point of water in Fahrenheit?",
    "How many seconds are in a year?",
    "What is the area of a circle with radius 3?",
]

SYSTEM_PROMPT = f"""You answer questions step by step. Each step has a Thought, an Action and an Observation.
Actions:
  calculator[expression] evaluates arithmetic with + - * / ** and parentheses.
  lookup[key] reads a fact table with the keys: {", ".join(FACTS)}.

Example:
Question: How many minutes are in a week?
Thought 1: A week has 7 days and a day has 24 hours.
Action 1: calculator[7 * 24]
Observation 1: 168
Thought 2: Each hour has 60 minutes.
Action 2: calculator[168 * 60]
Observation 2: 10080
Answer: 10080"""

# The thought after which the agent stops acting and answers (the demo model writes it once it has the result).
ANSWERED_THOUGHT = "I have the answer."

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}


def calculator(expression: str) -> str:
    """Arithmetic on numbers only (no names, calls or attribute access)."""
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as exc:
        return f"error: {type(exc).__name__}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def lookup(key: str) -> str:
    return FACTS.get(key.strip().lower(), "unknown key")


TOOLS: dict[str, Callable[[str], str]] = {"calculator": calculator, "lookup": lookup}


@function
def react_agent(s, question: str, num_steps: int = 6, thought_tokens: int = 32, input_tokens: int = 16):
    s += system(SYSTEM_PROMPT)
    s += user(f"Question: {question}")
    with s.assistant():
        for i in range(1, num_steps + 1):
            s += f"Thought {i}:" + gen(f"thought_{i}", max_tokens=thought_tokens, stop="\n") + "\n"
            if s[f"thought_{i}"].strip() == ANSWERED_THOUGHT:
                break
            s += f"Action {i}: " + select(f"action_{i}", list(TOOLS)) + "["
            s += gen(f"input_{i}", max_tokens=input_tokens, stop=["]", "\n"]) + "]\n"
            observation = TOOLS[s[f"action_{i}"]](s[f"input_{i}"])
            s += f"Observation {i}: {observation}\n"
        s += "Answer:" + gen("answer", max_tokens=thought_tokens, stop="\n")


def tool_calls(state) -> list[tuple[str, str, str]]:
    """(tool, input, observation) of each step an agent acted on."""
    calls, i = [], 1
    while state.get_var(f"input_{i}") is not None:
        tool, arg = state[f"action_{i}"], state[f"input_{i}"]
        calls.append((tool, arg, TOOLS[tool](arg)))
        i += 1
    return calls


def run_agents(backend: Backend, num_agents: int = 8, num_steps: int = 6, thought_tokens: int = 32,
               input_tokens: int = 16, progress_bar: bool = False) -> tuple[list, CacheReport]:
    """Run `num_agents` agents side by side (greedy); return their states and the cache report."""
    batch = [{"question": QUESTIONS[i % len(QUESTIONS)], "num_steps": num_steps,
              "thought_tokens": thought_tokens, "input_tokens": input_tokens} for i in range(num_agents)]
    states = react_agent.run_batch(batch, backend=backend, num_threads=num_agents, temperature=0.0,
                                   progress_bar=progress_bar)
    return states, cache_report(states, backend)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_backend_args(parser)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--thought-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    backend = make_backend(args)
    try:
        states, report = run_agents(backend, args.agents, args.steps, args.thought_tokens, progress_bar=True)
        for idx, state in enumerate(states):
            calls = [f"{tool}[{arg}] -> {result}" for tool, arg, result in tool_calls(state)]
            print(f"agent {idx}: {state.messages()[1]['content']!r} calls={calls} "
                  f"answer={state['answer'].strip()!r}")
        print(f"hit rate:         {report.hit_rate:.1%}")
        print(f"optimal hit rate: {report.optimal_hit_rate:.1%}  (same prompts; round k = every agent's k-th call)")
        print(report)
    finally:
        backend.shutdown()
    return 0


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not arithmetic")


if __name__ == "__main__":
    sys.exit(main())
