"""Arithmetic in the demo model's corpus (bench/demo_kit/data.py): how a sum is answered, and which sums are held out.

A sum of two one-digit numbers is a fact ("2 + 3 = 5."). A sum with a two-digit operand is answered the way it is
done on paper, one column at a time, so that the reply only ever needs the one-digit facts and a carry:

    37 + 48: 7 + 8 = 15, carry 1; 3 + 4 = 7, 7 + 1 = 8. So 37 + 48 = 85.

Every step is a one-digit fact or adding the carry (n + 1); every one-digit fact is trained, alone and as a step;
held-out two-digit operand pairs (is_heldout_pair) are never asked, so the evaluation (bench/demo_kit/eval_cases.py)
measures whether the column method generalises.
Differences (0..DIFF_MAX) and products (0..PRODUCT_MAX) are small tables, all of them trained.
"""
from __future__ import annotations

import random

SUM_MAX = 99
DIFF_MAX = 12
PRODUCT_MAX = 9

SUM_PHRASINGS = ("What is {a} + {b}?", "What's {a} + {b}?", "Compute {a} + {b}.", "{a} + {b} = ?",
                 "How much is {a} plus {b}?", "Add {a} and {b}.", "What is {a} plus {b}?",
                 "Please compute {a} + {b}.", "Tell me what {a} + {b} is.", "Could you add {a} and {b}?",
                 "Do you know what {a} plus {b} is?", "Calculate {a} + {b} for me.")
DIFF_PHRASINGS = ("What is {a} - {b}?", "What's {a} - {b}?", "Compute {a} - {b}.", "What is {a} minus {b}?")
PROD_PHRASINGS = ("What is {a} * {b}?", "What is {a} times {b}?", "Compute {a} * {b}.", "Multiply {a} by {b}.")


def is_heldout_pair(a: int, b: int) -> bool:
    """Sums never asked: a fixed ~6% of the pairs with a two-digit operand (one-digit facts are all trained)."""
    return max(a, b) >= 10 and (a * 7 + b * 13) % 16 == 5


def sum_answer(a: int, b: int) -> str:
    """The reply to "a + b" (0 <= a, b <= 99): the fact, or the two columns and the result."""
    if a < 10 and b < 10:
        return f"{a} + {b} = {a + b}."
    ones = a % 10 + b % 10
    carry = ones // 10
    first = f"{a % 10} + {b % 10} = {ones}" + (", carry 1" if carry else "")
    tens = a // 10 + b // 10
    second = f"{a // 10} + {b // 10} = {tens}" + (f", {tens} + 1 = {tens + 1}" if carry else "")
    return f"{a} + {b}: {first}; {second}. So {a} + {b} = {a + b}."


def _operand(r: random.Random) -> int:
    return r.randint(0, 9) if r.random() < 0.4 else r.randint(0, SUM_MAX)


def sum_pair(r: random.Random) -> tuple[int, int]:
    """A trained pair: one-digit pairs often (each fact is also a column step), two-digit ones otherwise."""
    while True:
        a, b = _operand(r), _operand(r)
        if not is_heldout_pair(a, b):
            return a, b


def arithmetic_qa(r: random.Random) -> tuple[str, str]:
    op = r.choices("+-*", (6, 1, 1))[0]
    if op == "+":
        a, b = sum_pair(r)
        return r.choice(SUM_PHRASINGS).format(a=a, b=b), sum_answer(a, b)
    hi = DIFF_MAX if op == "-" else PRODUCT_MAX
    a, b = r.randint(0, hi), r.randint(0, hi)
    if op == "-" and a < b:
        a, b = b, a
    value = a - b if op == "-" else a * b
    phrasings = DIFF_PHRASINGS if op == "-" else PROD_PHRASINGS
    return r.choice(phrasings).format(a=a, b=b), f"{a} {op} {b} = {value}."
