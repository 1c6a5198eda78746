"""ReAct traces for the demo model's corpus, in exactly the format lang/examples/react.py prompts for:

    Thought 1: <thought>\nAction 1: calculator[<expression>]\nObservation 1: <tool result>\n ... Thought k: I have the
    answer.\nAnswer: <value>

under that example's system prompt and a "Question: ..." user turn. Observations come from the example's own tools
(so they are what the agent will see) and are context only: the loss never sees them.
"""
from __future__ import annotations

import random
from typing import Callable

from .sample import Sample

Step = tuple[str, str, str]  # thought, tool, input


def _unit_conversion(r: random.Random) -> tuple[str, list[Step]]:
    n = r.randint(2, 30)
    kind = r.randrange(4)
    if kind == 0:
        return f"How many seconds are in {n} days?", [
            ("A day has 24 hours and an hour has 3600 seconds.", "calculator", f"{n} * 24 * 3600")]
    if kind == 1:
        return f"How many minutes are in {n} hours?", [("An hour has 60 minutes.", "calculator", f"{n} * 60")]
    if kind == 2:
        return f"How many hours are in {n} days?", [
            ("I need the number of hours per day.", "lookup", "hours per day"),
            (f"I multiply 24 by {n}.", "calculator", f"24 * {n}")]
    return f"How many days are in {n} weeks?", [("A week has 7 days.", "calculator", f"{n} * 7")]


def _fact(r: random.Random) -> tuple[str, list[Step]]:
    from ...lang.examples.react import FACTS

    key = r.choice(list(FACTS))
    return f"What is the value of {key}?", [(f"I need to look up {key}.", "lookup", key)]


def _arithmetic(r: random.Random) -> tuple[str, list[Step]]:
    a, b, op = r.randint(100, 9999), r.randint(2, 999), r.choice("+-*")  # a > SUM_MAX: never a held-out pair
    return f"What is {a} {op} {b}?", [("I use the calculator.", "calculator", f"{a} {op} {b}")]


def _circle(r: random.Random) -> tuple[str, list[Step]]:
    radius = r.randint(1, 50)
    return f"What is the area of a circle with radius {radius}?", [
        ("The area is pi times the radius squared.", "calculator", f"3.14159 * {radius} * {radius}")]


# The example's own questions (lang/examples/react.py QUESTIONS), each with a fixed plan.
_EXAMPLE_PLANS: dict[str, list[Step]] = {
    "How many seconds are in a day?": [("A day has 24 hours and an hour has 3600 seconds.", "calculator",
                                        "24 * 3600")],
    "How many hours are in a year?": [("I need the number of days per year.", "lookup", "days per year"),
                                      ("I multiply the days by 24 hours.", "calculator", "365 * 24")],
    "What is the circumference of the earth in km?": [
        ("I need the radius of the earth.", "lookup", "earth radius km"),
        ("The circumference is 2 times pi times the radius.", "calculator", "2 * 3.14159 * 6371")],
    "How far does light travel in one hour, in meters?": [
        ("I need the speed of light.", "lookup", "speed of light"),
        ("An hour has 3600 seconds.", "calculator", "299792458 * 3600")],
    "How many earth radii is the moon away?": [
        ("I need the distance to the moon.", "lookup", "moon distance km"),
        ("I divide it by the earth radius of 6371 km.", "calculator", "384400 / 6371")],
    "What is the boiling point of water in Fahrenheit?": [
        ("I need the boiling point in Celsius.", "lookup", "water boiling point c"),
        ("Fahrenheit is Celsius times 9 / 5 plus 32.", "calculator", "100 * 9 / 5 + 32")],
    "How many seconds are in a year?": [("I need the number of days per year.", "lookup", "days per year"),
                                        ("A day has 86400 seconds.", "calculator", "365 * 86400")],
    "What is the area of a circle with radius 3?": [
        ("The area is pi times the radius squared.", "calculator", "3.14159 * 3 * 3")],
}


def _example(r: random.Random) -> tuple[str, list[Step]]:
    question = r.choice(list(_EXAMPLE_PLANS))
    return question, _EXAMPLE_PLANS[question]


_KINDS: tuple[tuple[Callable[[random.Random], tuple[str, list[Step]]], int], ...] = (
    (_unit_conversion, 3), (_fact, 2), (_arithmetic, 3), (_circle, 1), (_example, 3))


def react_sample(r: random.Random) -> Sample:
    from ...lang.examples.react import ANSWERED_THOUGHT, SYSTEM_PROMPT, TOOLS

    makers, weights = zip(*_KINDS)
    question, steps = r.choices(makers, weights)[0](r)
    pieces: list[tuple[str, bool]] = []
    observation = ""
    for i, (thought, tool, arg) in enumerate(steps, 1):
        observation = TOOLS[tool](arg)
        pieces.append((f"Thought {i}: {thought}\nAction {i}: {tool}[{arg}]\n", True))
        pieces.append((f"Observation {i}: {observation}\n", False))
    pieces.append((f"Thought {len(steps) + 1}: {ANSWERED_THOUGHT}\nAnswer: {observation}", True))
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"Question: {question}"},
                {"role": "assistant", "content": "".join(text for text, _ in pieces)}]
    return Sample(messages, None, [pieces])
