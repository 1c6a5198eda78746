"""Sampling bench: the sample part of a decode step (kernels/sampling.sample_next_tokens) on a large vocabulary.

    python -m radixserve.bench.sample_bench                          # this tree's sampler
    python -m radixserve.bench.sample_bench --baseline HEAD~3 --threads 1   # against an older commit's, alternating

Writes sample_bench.{json,md} (bench/output.py says where). Random logits (float32 or bf16) of
--vocab columns at each batch size, one call per repetition, timed with the host work and the
final `.tolist()`; each figure is the min and the median of --repeats. Modes: greedy; sample
(temperature 0.8, top_k 50, top_p 0.9); sample_rep (the same with repetition_penalty 1.1 over a
1,024-token prompt, penalty statistics kept incrementally as the runner keeps them: one new token
per call); temperature (0.8 alone: a draw over the whole vocabulary); logprobs (greedy, 5 top
logprobs); grammar (greedy under an xgrammar bitmask allowing about half the tokens).

--baseline REV loads kernels/sampling.py, sampling_noise.py and step_upload.py as they were at
REV (git show) beside this tree's, and the two run alternately within each repetition, on the
same logits; `differing_draws` counts the draws where their tokens differ (each implementation
appends its own tokens, so after a difference the penalised contexts differ too).
"""
from __future__ import annotations

import importlib.util
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

from .output import BenchOutput, bench_parser, parse_args, progress
from ..kernels.forward_io import SeqInput
from ..scheduler.sampling_params import SamplingParams
from ..scheduler.slot_row import SlotRow

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "greedy": dict(temperature=0.0),
    "sample": dict(temperature=0.8, top_k=50, top_p=0.9),
    "sample_rep": dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1),
    "temperature": dict(temperature=0.8),
    "logprobs": dict(temperature=0.0, logprobs=5),
    "grammar": dict(temperature=0.0),
}
PROMPT_LEN = 1024
_OLD_MODULES = ("step_upload", "sampling_noise", "sampling")


def load_baseline(rev: str) -> types.ModuleType:
    """The sampler as it was at git revision `rev`, importable beside this tree's."""
    # Loaded as radixserve.kernels._baseline_<name>, so that their imports of the kernels package (relative, or
    # absolute in older revisions) read this tree's modules, and those of one another the baseline's.
    prefix = "radixserve.kernels._baseline"
    for name in _OLD_MODULES:
        source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:kernels/{name}.py"], check=True,
                                capture_output=True, text=True).stdout
        for other in _OLD_MODULES:
            source = source.replace(f"radixserve.kernels.{other} ", f"{prefix}_{other} ")
            source = source.replace(f"from .{other} import", f"from ._baseline_{other} import")
        spec = importlib.util.spec_from_loader(f"{prefix}_{name}", loader=None)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        exec(compile(source, f"{rev}:kernels/{name}.py", "exec"), module.__dict__)
    return sys.modules[f"{prefix}_sampling"]


class Case:
    """One (mode, batch, dtype) cell: its logits and requests, the same for every implementation."""

    def __init__(self, mode: str, batch: int, dtype: torch.dtype, vocab: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.logits = (torch.randn(batch, vocab, generator=gen) * 2.5).to(dtype)
        params = SamplingParams(**MODES[mode])
        self.prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)]
        self.outputs: dict[str, list[list[int]]] = {}
        self.rows: dict[str, list[SlotRow]] = {}  # per implementation: each request's scheduler-side row
        words = (vocab + 31) // 32
        masks = torch.randint(-2**31, 2**31 - 1, (batch, words), generator=gen, dtype=torch.int64).to(torch.int32)
        self.masks = masks if mode == "grammar" else None
        self.params, self.batch, self.mode = params, batch, mode

    def seqs(self, impl: str, new_row: bool) -> list[SeqInput]:
        """The step's rows; new_row: each request has just been given its row (its penalties are fed whole)."""
        outputs = self.outputs.setdefault(impl, [[] for _ in range(self.batch)])
        if new_row or impl not in self.rows:
            self.rows[impl] = [SlotRow() for _ in range(self.batch)]
        sampling = self.params.row_sampling()
        seqs = []
        for i in range(self.batch):
            feed = self.rows[impl][i].take_penalty_tokens(self.prompts[i], outputs[i]) if sampling.penalised else None
            seq = SeqInput(input_ids=[1], prefix_len=0, row=i, new_slots=[], slot_offset=0, sample=True,
                           new_row=new_row, sampling=sampling, sampling_seed=1000 + i, sample_index=len(outputs[i]),
                           penalty_tokens=feed, num_top_logprobs=5 if self.mode == "logprobs" else 0,
                           token_bitmask=None if self.masks is None else self.masks[i])
            seq.prompt_ids, seq.output_ids = self.prompts[i], outputs[i]  # what a --baseline sampler before them reads
            seqs.append(seq)
        return seqs


def run_case(case: Case, impls: dict[str, types.ModuleType], repeats: int, native: bool) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in impls}
    states = {name: mod.PenaltyState(case.batch) for name, mod in impls.items()}
    drawn: dict[str, list[list[int]]] = {name: [] for name in impls}
    for name, mod in impls.items():  # warm-up; builds the penalty rows (the runner does it once per request)
        mod.sample_next_tokens(case.logits, case.seqs(name, True), penalties=states[name], native=native)
    for _ in range(repeats):
        for name, mod in impls.items():
            seqs = case.seqs(name, False)
            start = time.perf_counter()
            tokens, _ = mod.sample_next_tokens(case.logits, seqs, penalties=states[name], native=native)
            times[name].append(time.perf_counter() - start)
            drawn[name].append(tokens)
            for seq, token in zip(seqs, tokens):
                seq.output_ids.append(token)  # the next call is the next position (incremental penalties)
    row = {"mode": case.mode, "batch": case.batch}
    for name, values in times.items():
        row[name] = {"min_ms": min(values) * 1e3, "median_ms": statistics.median(values) * 1e3}
    if len(impls) > 1:  # draws (row, call) where an implementation's token differs from this tree's
        row["differing_draws"] = sum(a != b for name in impls if name != "after"
                                     for call, other in zip(drawn["after"], drawn[name]) for a, b in zip(call, other))
        row["draws"] = case.batch * repeats
    return row


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    impls = meta["impls"]
    head = "| mode | batch | dtype | " + " | ".join(f"{n} min / median ms" for n in impls)
    head += " | speedup (median) | differing draws |" if len(impls) > 1 else " |"
    lines = [f"# Sampling bench: vocab {meta['vocab']}, {meta['threads']} thread(s)", "",
             f"`{meta['command']}`", "", f"torch {meta['torch']}, {meta['cpu']}; baseline: {meta['baseline']}", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["mode"], str(r["batch"]), r["dtype"]]
        cells += [f"{r[n]['min_ms']:.2f} / {r[n]['median_ms']:.2f}" for n in impls]
        if len(impls) > 1:
            cells += [f"{r['before']['median_ms'] / r['after']['median_ms']:.1f}x",
                      f"{r['differing_draws']} / {r['draws']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("sample_bench", __doc__)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="logits dtypes")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--baseline", metavar="REV", help="also time the sampler of this git revision")
    parser.add_argument("--no-native", action="store_true", help="torch's argmax instead of the native one")
    args = parse_args(parser, argv)
    torch.set_num_threads(args.threads)
    from ..kernels import sampling
    impls = {"before": load_baseline(args.baseline)} if args.baseline else {}
    impls["after"] = sampling
    modes, batches = args.modes.split(","), [int(b) for b in args.batches.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    rows = []
    with progress(len(modes) * len(batches) * len(dtypes), "sample bench") as bar:
        for mode in modes:
            for batch in batches:
                for dtype in dtypes:
                    case = Case(mode, batch, dtype, args.vocab, seed=batch)
                    rows.append({**run_case(case, impls, args.repeats, not args.no_native),
                                 "dtype": str(dtype).removeprefix("torch.")})
                    bar.update()
    meta = {"command": args.command, "vocab": args.vocab, "threads": args.threads, "repeats": args.repeats,
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "baseline": args.baseline or "none", "impls": list(impls), "native_argmax": not args.no_native}
    out = BenchOutput("sample_bench", args.out)
    table = markdown(rows, meta)
    report = {"meta": meta, "rows": rows}
    out.write_report("sample_bench", report, table)
    out.finish(table)
    return report


if __name__ == "__main__":
    main()
