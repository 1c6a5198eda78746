"""radixserve against itself: two engine configurations, each in its own process, alternating (for settings that
act on the whole process, such as the host allocator).

For settings that act on the whole process (the host allocator, threads) an in-process A/B would
measure one setting twice, so each side is a child process holding one `Engine` and answering
JSON lines: a workload name in, one run's wall time, page faults and system time out. Per workload
every side first runs once untimed (new shapes build their oneDNN kernels), then the sides alternate
for `--reps` repetitions (order flipped every other one) after `--settle-s` idle, median of the runs.

    python -m radixserve.bench.engine_ab --model M --workloads gsp,fewshot \
        --a '{"release_host_memory": true}' --b '{}' --label-a release --label-b retain --name host_memory_M
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from .harness import MODEL_HELP
from .output import BenchOutput, bench_parser, parse_args, progress
from .peer_vllm import alternation
from .workloads import NONALIGNED_WORKLOADS, WORKLOAD_NAMES

ENGINE = dict(kv_cache_tokens=120000, max_running_requests=64, chunked_prefill_size=4096)


class Child:
    """One side: `python -m radixserve.bench.engine_ab --child` with its engine configuration."""

    def __init__(self, label: str, model: str, size: str, threads: int, config: dict[str, Any],
                 src: str | None = None) -> None:
        self.label, self.config = label, {**ENGINE, **config}
        spec = json.dumps({"model": model, "size": size, "threads": threads, "config": self.config})
        self._link_dir = tempfile.TemporaryDirectory(prefix="engine-ab-") if src else None
        env = dict(os.environ)
        if self._link_dir is not None:  # the child imports radixserve from that checkout (ahead of the installed one)
            os.symlink(os.path.abspath(src), os.path.join(self._link_dir.name, "radixserve"))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (self._link_dir.name, env.get("PYTHONPATH"))))
        self.proc = subprocess.Popen([sys.executable, "-m", "radixserve.bench.engine_ab", "--child", spec],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=self._link_dir.name if self._link_dir is not None else None)
        self.package = self._read().get("package")  # ready: where the child's radixserve.bench came from

    def run(self, workload: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)
        if self._link_dir is not None:
            self._link_dir.cleanup()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"side {self.label} exited with {self.proc.wait()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"side {self.label}: {reply['error']}")
        return reply


def child_main(spec_json: str) -> int:
    """The child: stdout carries only protocol lines (logs go to stderr)."""
    from .harness import bench_model_path
    from .peer_sides import OursSide
    from .peer_vllm import run_rounds, warm_up
    from .workloads import make_workload

    spec = json.loads(spec_json)
    side = OursSide(bench_model_path(spec["model"]), spec["threads"], **spec["config"])
    warm_up(side)
    print(json.dumps({"ready": True, "package": os.path.dirname(os.path.abspath(__file__))}), flush=True)
    for line in sys.stdin:
        before = resource.getrusage(resource.RUSAGE_SELF)
        measure = run_rounds(side, make_workload(line.strip(), spec["size"], 0))
        side.reset()
        after = resource.getrusage(resource.RUSAGE_SELF)
        print(json.dumps({"wall_s": measure.wall_s, "requests": len(measure.prompts),
                          "minor_faults": after.ru_minflt - before.ru_minflt,
                          "system_s": after.ru_stime - before.ru_stime}), flush=True)
    side.close()
    return 0


def measure(sides: dict[str, Child], workloads: list[str], reps: int, settle_s: float,
            on_run: Callable[[], object] = lambda: None) -> list[dict[str, Any]]:
    """Per workload: one untimed run per side, then `reps` alternating timed ones; on_run() after every run."""
    runs = []
    for workload in workloads:
        for side in sides.values():
            side.run(workload)  # untimed: this workload's shapes
            on_run()
        for rep, order in enumerate(alternation(list(sides), reps)):
            for label in order:
                time.sleep(settle_s)
                runs.append({"workload": workload, "side": label, "rep": rep, **sides[label].run(workload)})
                on_run()
    return runs


def summarize(runs: list[dict[str, Any]], labels: tuple[str, str]) -> list[dict[str, Any]]:
    """Per workload: each side's medians, and b's speed-up over a (median wall of a / of b)."""
    rows = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        row: dict[str, Any] = {"workload": workload}
        for label in labels:
            mine = [r for r in runs if r["workload"] == workload and r["side"] == label]
            row[label] = {"wall_s": statistics.median(r["wall_s"] for r in mine),
                          "wall_s_runs": [r["wall_s"] for r in mine],
                          "req_per_s": statistics.median(r["requests"] / r["wall_s"] for r in mine),
                          "minor_faults": statistics.median(r["minor_faults"] for r in mine),
                          "system_s": statistics.median(r["system_s"] for r in mine)}
        row["speedup"] = row[labels[0]]["wall_s"] / row[labels[1]]["wall_s"]
        rows.append(row)
    return rows


def markdown(report: dict[str, Any]) -> str:
    a, b = report["labels"]
    lines = [f"# radixserve A/B: {a} vs {b} (model {report['model']})", "",
             f"Command: `{report['command']}`. Each side is its own process ({report['threads']} torch threads), "
             f"{a} = `{json.dumps(report['configs'][a])}`, {b} = `{json.dumps(report['configs'][b])}`. Per workload "
             "one untimed run each, then the sides alternate (order flipped every other repetition), "
             f"median of {report['reps']} runs (listed). Faults and system time are the process's own during a run.",
             *([f"Code: {a} = {report['sources'][a]}; {b} = {report['sources'][b]}."] if "sources" in report else []),
             "", f"| workload | {a} s | {b} s | {b} speed-up | {a} runs | {b} runs | minor faults {a} / {b} "
             f"| system s {a} / {b} |", "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        sa, sb = row[a], row[b]
        runs = [", ".join(f"{x:.2f}" for x in s["wall_s_runs"]) for s in (sa, sb)]
        lines.append(f"| {row['workload']} | {sa['wall_s']:.2f} | {sb['wall_s']:.2f} | **{row['speedup']:.2f}x** "
                     f"| {runs[0]} | {runs[1]} | {sa['minor_faults']:.0f} / {sb['minor_faults']:.0f} "
                     f"| {sa['system_s']:.2f} / {sb['system_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    if args.child:
        sys.exit(child_main(args.child))
    labels = (args.label_a, args.label_b)
    configs = {args.label_a: json.loads(args.a), args.label_b: json.loads(args.b)}
    srcs = {args.label_a: args.src_a, args.label_b: args.src_b}
    sources = {k: _describe(srcs[k]) for k in labels}  # the code as the sides load it, not as it is at the end
    sides: dict[str, Child] = {}
    try:
        for label in labels:
            sides[label] = Child(label, args.model, args.size, args.threads, configs[label], srcs[label])
        with progress(len(args.workloads) * 2 * (1 + args.reps), "engine A/B") as bar:
            runs = measure(sides, args.workloads, args.reps, args.settle_s, bar.update)
    finally:
        for side in sides.values():
            side.close()
    report = {"bench": "engine_ab", "command": args.command,
              "model": args.model, "size": args.size, "reps": args.reps, "threads": args.threads,
              "labels": list(labels), "configs": {k: sides[k].config for k in labels},
              "sources": sources,
              "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
              "runs": runs, "rows": summarize(runs, labels)}
    out = BenchOutput("engine_ab", args.out)
    out.finish(out.write_report(args.name or f"engine_ab_{args.model}", report, markdown(report)))
    return report


def _describe(src: str | None) -> str:
    """The code a side ran: the checkout's commit (and whether its tree was dirty), or the installed package."""
    path = src or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return path
    return f"{head}{' + uncommitted changes' if dirty else ''} ({'checkout ' + path if src else 'installed'})"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("engine_ab", __doc__)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model", default="M", help=MODEL_HELP)
    p.add_argument("--size", choices=("full", "reduced", "tiny"), default="full", help="workload size")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=["gsp", "fewshot", "multiturn", "react"],
                   help="comma-separated workloads, from " + ", ".join(WORKLOAD_NAMES + NONALIGNED_WORKLOADS))
    p.add_argument("--reps", type=int, default=3, help="timed runs per side and workload; the report gives their median")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    p.add_argument("--settle-s", type=float, default=3.0,
                   help="idle seconds before each run, so the other side's spinning threads have stopped")
    p.add_argument("--a", default="{}", help='side a\'s Engine keywords as JSON, e.g. \'{"release_host_memory": true}\'')
    p.add_argument("--b", default="{}", help="side b's Engine keywords as JSON")
    p.add_argument("--label-a", default="a", help="side a's name in the report")
    p.add_argument("--label-b", default="b", help="side b's name in the report")
    p.add_argument("--src-a", help="side a runs the code of this checkout (e.g. a `git worktree` of an older "
                                   "commit) instead of the installed one: a before/after A/B of a change")
    p.add_argument("--src-b", help="side b's checkout, likewise")
    p.add_argument("--name", help="the result files' name, NAME.{json,md} (default: engine_ab_MODEL)")
    args = parse_args(p, argv)
    if args.label_a == args.label_b:
        p.error("--label-a and --label-b must differ")
    return args


if __name__ == "__main__":
    main()
