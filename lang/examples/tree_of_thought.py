"""Tree of thought: fork into several approaches, fork each into next steps, judge the leaves.

    python -m radixserve.lang.examples.tree_of_thought [--model DIR | --url URL]

Each `fork` first sends the shared prefix once as a prefix-only request, so every branch's
request starts with a cache hit; the branches of one level run concurrently and batch together.

It needs a chat model that can propose and judge approaches. The built-in demo model was never
trained to (it knows a fact table, sums and tool calls), so on it the approaches and steps are
fragments and the answer is wrong: there the run shows only the tree's requests and cache hits.
"""
from __future__ import annotations

import argparse
import sys

from .. import function, gen, select, user
from .common import add_backend_args, make_backend

QUESTION = "A farmer has 17 sheep and buys 5 more, then sells 8. How many sheep are left?"
DEMO_NOTE = ("Note: this runs on the built-in demo model, which was never trained to propose or judge approaches: "
             "expect fragments and a wrong answer below; the requests and the hit rate are what it shows. "
             "--model DIR or --url URL runs it on a chat model.")


@function
def tree_of_thought(s, question: str, num_approaches: int = 3, num_steps: int = 2, step_tokens: int = 16):
    s += user(question)
    with s.assistant():
        s += "Let me consider several approaches.\n"
        approaches = s.fork(num_approaches)
        for i, branch in enumerate(approaches):
            branch += f"Approach {i + 1}:" + gen("approach", max_tokens=step_tokens, stop="\n") + "\n"
        leaves = []
        for branch in approaches:  # each fork waits only for its own branch's approach
            steps = branch.fork(num_steps)
            for j, leaf in enumerate(steps):
                leaf += f"Step {j + 1}:" + gen("step", max_tokens=step_tokens, stop="\n") + "\n"
                leaf += "Is this correct? " + select("verdict", ["yes", "no"])
            leaves.append(steps)
        for steps in leaves:
            steps.join()
        approaches.join()
        best_score, best = None, (0, 0)
        for i, steps in enumerate(leaves):
            for j, leaf in enumerate(steps):
                score = leaf.get_meta_info("verdict")["sum_logprobs"][0]  # logprob of "yes"
                if best_score is None or score > best_score:
                    best_score, best = score, (i, j)
        i, j = best
        s += f"Best: approach {i + 1}, step {j + 1}: {leaves[i][j]['step'].strip()}\nAnswer:"
        s += gen("answer", max_tokens=step_tokens, stop="\n")
    s["best"] = best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_backend_args(parser)
    parser.add_argument("--question", default=QUESTION)
    args = parser.parse_args(argv)
    backend = make_backend(args)
    if args.model is None and args.url is None:
        print(DEMO_NOTE + "\n")
    try:
        state = tree_of_thought.run(question=args.question, backend=backend, temperature=0.0)
        for i, approach in enumerate(state["approach"]):
            print(f"approach {i + 1}:{approach}")
        print(f"chosen (approach, step): {tuple(k + 1 for k in state['best'])}\n")
        print(state.text())
        kinds = [r.kind for r in state.requests]
        prompt = sum(r.output.prompt_tokens for r in state.requests)
        cached = sum(r.output.cached_tokens for r in state.requests)
        print(f"\n{len(kinds)} requests ({kinds.count('prefix')} prefix-only), hit rate {cached / max(prompt, 1):.1%}")
    finally:
        backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
