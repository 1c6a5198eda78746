"""Many tenants on one engine (issue 41): a light tenant beside a heavy one on a shared system prompt, with the
engine's fair share on and off; the timing isolation of a salt that starts after the system prompt; and 64 tenants
computing one shared system prompt once.

Over HTTP against `radixserve serve --api-keys` (each tenant its own key), token-level /generate requests, streamed
so TTFT is the first output chunk. Per repetition (engines alternating fair share on / off):
  capacity  closed-loop requests/s at the server's running limit (calibrates the offered load);
  alone     the light tenant alone, a Poisson stream at `light_fraction` of that capacity;
  load      the light tenant beside the heavy one (`heavy_ratio` x its rate; together above capacity): the light
            tenant's TTFT p50/p99, the step time under load, and the hit rate against the optimum (every system
            prompt token cached, every private suffix computed);
  isolation tenant A sends private suffixes salted after the system prompt (`cache_salt_after`); tenant B probes
            half of them and as many fresh ones: the best TTFT threshold's accuracy (0.5 = no signal); unsalted
            probes show what a leak looks like;
  shared    64 tenants, one system prompt, each salted after it: prompt tokens computed vs one system prompt + the
            private suffixes.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import orjson

from ..scheduler.gc_freeze import FullPasses
from .http_client import HTTPConnection
from .output import BenchOutput, bench_parser, parse_args, percentile

CLIENT_GC = FullPasses()  # this client's open streams are as many as the server's: its full passes only between phases
KEYS = {"sk-light": "light", "sk-heavy": "heavy", "sk-a": "a", "sk-b": "b"}


@dataclass(frozen=True)
class TenantsConfig:
    system_tokens: int = 1024
    private_tokens: int = 64
    output_tokens: int = 32
    light_fraction: float = 0.1  # of the measured capacity
    heavy_ratio: float = 12.0  # x the light tenant's rate
    duration_s: float = 30.0  # at least: a phase lasts until the light tenant's stream has offered min_light requests
    min_light: int = 100  # so that its p99 is not just its largest (model L serves ~4 requests/s: 13 in 30 s)
    max_running: int = 16
    stream_interval: int = 1  # the server's --stream-interval: output every N tokens (the first at once)
    probes: int = 200
    shared_tenants: int = 64
    vocab: int = 3000
    seed: int = 0


class Client:
    def __init__(self, url: str, cfg: TenantsConfig) -> None:
        host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
        self.host, self.port, self.cfg = host, int(port), cfg
        self.rng = random.Random(cfg.seed)
        self.sent = 0
        self.system = [self.rng.randrange(10, cfg.vocab) for _ in range(cfg.system_tokens)]

    def private(self) -> list[int]:
        """A private suffix whose first token no recent request's shares (the request's number, lowest digit first,
        in two tokens), so the optimum caches exactly the system prompt of every request."""
        self.sent += 1
        span = self.cfg.vocab - 10
        head = [10 + self.sent % span, 10 + self.sent // span % span]
        return head + [self.rng.randrange(10, self.cfg.vocab) for _ in range(self.cfg.private_tokens - 2)]

    async def ttft(self, key: str, suffix: list[int], salt: str | None = None, output_tokens: int | None = None,
                   engine: list[tuple[float, float]] | None = None) -> float:
        """Send system + suffix as `key`'s tenant; seconds to the first streamed output (the stream is drained).
        `engine` gets the engine's own (TTFT, queue time) of the request, from its final event's meta_info."""
        params: dict[str, Any] = {"max_new_tokens": output_tokens or self.cfg.output_tokens, "temperature": 0.0,
                                  "ignore_eos": True}
        if salt is not None:
            params |= {"cache_salt": salt, "cache_salt_after": len(self.system)}
        body = orjson.dumps({"input_ids": self.system + suffix, "sampling_params": params, "stream": True})
        conn = HTTPConnection(self.host, self.port, {"Authorization": f"Bearer {key}"})
        start, first, last = time.perf_counter(), None, b""
        try:
            async for line in conn.post_lines("/generate", body):
                if line.startswith(b"data:") and not line.endswith(b"[DONE]"):
                    first = time.perf_counter() - start if first is None else first
                    last = line
        finally:
            await conn.close()
        if engine is not None and last:
            meta = orjson.loads(last[5:]).get("meta_info", {})
            if meta.get("engine_ttft") is not None:
                engine.append((meta["engine_ttft"], meta["queue_time"]))
        return first if first is not None else float("nan")

    async def stats(self) -> dict[str, Any]:
        """The engine's counters (/get_server_info, an admin endpoint), and the HTTP process's full collections."""
        info = json.loads(await self.admin("GET", "/get_server_info"))
        return info.get("stats", {}) | {"http_gc_full_passes": info.get("gc_full_passes", 0)}

    async def admin(self, method: str, path: str) -> bytes:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer sk-admin\r\n"
                     "Content-Length: 0\r\nConnection: close\r\n\r\n".encode())
        data = await reader.read()
        writer.close()
        status, _, rest = data.partition(b"\r\n")
        if b" 200 " not in status:
            raise RuntimeError(f"{method} {path}: {status.decode(errors='replace')}")
        return rest.split(b"\r\n\r\n", 1)[1]


async def capacity(client: Client, seconds: float) -> float:
    """Closed-loop requests per second at the server's running limit."""
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await client.ttft("sk-heavy", client.private())
            done += 1
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(client.cfg.max_running)))
    return done / (time.perf_counter() - start)


async def poisson(client: Client, key: str, rate: float, seconds: float, out: list[float],
                  engine: list[tuple[float, float]] | None = None) -> list[asyncio.Task]:
    """Requests of one tenant as a Poisson stream for `seconds`; each task appends its TTFT to `out` (and the
    engine's TTFT and queue time to `engine`)."""
    rng = random.Random(f"{client.cfg.seed}-{key}")
    tasks, stop = [], time.perf_counter() + seconds

    async def one() -> None:
        out.append(await client.ttft(key, client.private(), engine=engine))
    while time.perf_counter() < stop:
        tasks.append(asyncio.ensure_future(one()))
        await asyncio.sleep(rng.expovariate(rate))
    return tasks


def phase_seconds(cfg: TenantsConfig, light_rate: float) -> float:
    """A load phase's length: --duration, or longer, until the light stream is expected to have sent min_light."""
    return max(cfg.duration_s, cfg.min_light / light_rate if light_rate > 0 else 0.0)


async def offered_load(client: Client, light_rate: float, heavy: bool) -> dict[str, Any]:
    cfg = client.cfg
    CLIENT_GC.tick(quiet=True)  # between phases: nothing of this one is in flight yet
    before = await client.stats()
    light: list[float] = []
    engine: list[tuple[float, float]] = []  # the light requests' TTFT and queue time on the engine's clock
    heavy_out: list[float] = []
    seconds = phase_seconds(cfg, light_rate)
    streams = [poisson(client, "sk-light", light_rate, seconds, light, engine)]
    if heavy:
        streams.append(poisson(client, "sk-heavy", light_rate * cfg.heavy_ratio, seconds, heavy_out))
    light_tasks, *heavy_tasks = await asyncio.gather(*streams)
    await asyncio.gather(*light_tasks)  # every light request is measured, however long it waited
    after = await client.stats()
    for task in (t for tasks in heavy_tasks for t in tasks):
        task.cancel()  # the heavy backlog is abandoned (the server aborts it)
    await asyncio.gather(*(t for tasks in heavy_tasks for t in tasks), return_exceptions=True)
    steps = after.get("num_steps", 0) - before.get("num_steps", 0)
    prompt = after.get("num_prompt_tokens", 0) - before.get("num_prompt_tokens", 0)
    cached = after.get("num_cached_tokens", 0) - before.get("num_cached_tokens", 0)
    optimal = prompt * cfg.system_tokens / (cfg.system_tokens + cfg.private_tokens)
    return {"light_requests": len(light), "light_ttft_p50_s": percentile(light, 50),
            "light_ttft_p99_s": percentile(light, 99), "heavy_finished": len(heavy_out),
            "light_engine_ttft_p99_s": percentile([t for t, _ in engine], 99),
            "light_queue_p99_s": percentile([q for _, q in engine], 99),
            "step_s": (after.get("step_time_s", 0) - before.get("step_time_s", 0)) / steps if steps else None,
            "hit_vs_optimal": cached / optimal if optimal else None,
            "gc_full_passes": {"http": after.get("http_gc_full_passes", 0) - before.get("http_gc_full_passes", 0),
                               "engine": after.get("gc_full_passes", 0) - before.get("gc_full_passes", 0)}}


async def isolation(client: Client, salted: bool) -> dict[str, Any]:
    """A sends half the probed suffixes; B probes them and as many fresh ones, in a shuffled order, one at a time."""
    n = client.cfg.probes
    sent, fresh = [client.private() for _ in range(n)], [client.private() for _ in range(n)]
    for suffix in sent:
        await client.ttft("sk-a", suffix, "a" if salted else None, output_tokens=1)
    probes = [(s, True) for s in sent] + [(s, False) for s in fresh]
    client.rng.shuffle(probes)
    timed = [(await client.ttft("sk-b", s, "b" if salted else None, output_tokens=1), was) for s, was in probes]
    return {"salted": salted, "accuracy": best_threshold_accuracy(timed),
            "ttft_sent_p50_s": percentile([t for t, was in timed if was], 50),
            "ttft_fresh_p50_s": percentile([t for t, was in timed if not was], 50)}


def best_threshold_accuracy(timed: Sequence[tuple[float, bool]]) -> float:
    """The best accuracy of 'sent iff TTFT < threshold' over every threshold (0.5 when TTFT tells nothing)."""
    ordered = sorted(timed)
    total, sent_total = len(ordered), sum(was for _, was in ordered)
    best = max(sent_total, total - sent_total)
    sent_below = 0
    for i, (t, was) in enumerate(ordered, 1):
        sent_below += was
        if i < total and ordered[i][0] == t:
            continue  # a threshold cannot split equal times
        best = max(best, sent_below + (total - i) - (sent_total - sent_below))  # below: called sent
    return best / total


async def shared_prompt(client: Client) -> dict[str, Any]:
    await client.admin("POST", "/flush_cache")  # the system prompt computed again: once, for all of them
    before = await client.stats()
    for i in range(client.cfg.shared_tenants):
        await client.ttft("sk-a", client.private(), f"tenant-{i}", output_tokens=1)
    after = await client.stats()
    computed = (after["num_prompt_tokens"] - after["num_cached_tokens"]) - (
        before["num_prompt_tokens"] - before["num_cached_tokens"])
    expected = client.cfg.system_tokens + client.cfg.shared_tenants * client.cfg.private_tokens
    return {"tenants": client.cfg.shared_tenants, "computed": computed, "one_system_prompt_plus_suffixes": expected}


def start_server(model_path: str, cfg: TenantsConfig, fair: bool, threads: int, keys_file: str) -> Any:
    from ..frontend.spawn import ServerProcess

    kv = 64 * (cfg.system_tokens + cfg.private_tokens + cfg.output_tokens) + 8 * cfg.system_tokens
    return ServerProcess(["--model", model_path, "--api-keys", keys_file, "--num-threads", str(threads),
                          "--kv-cache-tokens", str(kv), "--max-running-requests", str(cfg.max_running),
                          "--stream-interval", str(cfg.stream_interval),
                          "--max-queued-requests", "100000", "--disable-log-requests",
                          "--policy-fair-share" if fair else "--no-policy-fair-share"])


def write_keys(path: str) -> None:
    entries = {key: {"tenant": tenant} for key, tenant in KEYS.items()} | {"sk-admin": {"tenant": "ops",
                                                                                        "admin": True}}
    with open(path, "w") as f:
        json.dump(entries, f)


async def repetition(url: str, cfg: TenantsConfig, fair: bool, extras: bool) -> dict[str, Any]:
    client = Client(url, cfg)
    await client.ttft("sk-light", client.private())  # the system prompt cached, the server warm
    cap = await capacity(client, min(10.0, cfg.duration_s))
    row = {"fair_share": fair, "capacity_rps": cap, "light_rps": cap * cfg.light_fraction}
    if extras:
        row["alone"] = await offered_load(client, row["light_rps"], heavy=False)
    row["load"] = await offered_load(client, row["light_rps"], heavy=True)
    if extras:
        row["isolation"] = [await isolation(client, salted) for salted in (True, False)]
        row["shared"] = await shared_prompt(client)
    return row


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [f"# Tenants (model {report['model']}, median of {report['repeats']}, "
             f"{report.get('engine_threads', '?')} engine thread(s), --stream-interval "
             f"{report['config'].get('stream_interval', 1)})", "",
             "| | light p99 TTFT | light p50 TTFT | p99 in the engine (queued) | step under load | hit / optimal |",
             "|---|---|---|---|---|---|"]
    for name in ("alone", "fair_on", "fair_off"):
        r = s[name]
        lines.append(f"| {name} | {_ms(r['light_ttft_p99_s'])} | {_ms(r['light_ttft_p50_s'])} | "
                     f"{_ms(r.get('light_engine_ttft_p99_s'))} ({_ms(r.get('light_queue_p99_s'))}) | "
                     f"{_ms(r.get('step_s'))} | {_num(r.get('hit_vs_optimal'))} |")
    lines += ["", f"- fair on: light p99 {_ms(s['fair_on']['light_ttft_p99_s'])} vs alone + 2 steps "
                  f"{_ms(s['target_p99_s'])}; vs fair off: {_num(s['on_vs_off'])}x",
              f"- timing isolation (best-threshold accuracy, 0.5 = none): salted {_num(s['isolation_salted'])}, "
              f"unsalted {_num(s['isolation_unsalted'])}",
              f"- {s['shared']['tenants']} tenants, one system prompt salted after it: {s['shared']['computed']} "
              f"prompt tokens computed (one system prompt + the suffixes = "
              f"{s['shared']['one_system_prompt_plus_suffixes']})", ""]
    return "\n".join(lines)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(rs: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(values) if values else None
    parts = {"alone": [r["alone"] for r in rows if "alone" in r],
             "fair_on": [r["load"] for r in rows if r["fair_share"]],
             "fair_off": [r["load"] for r in rows if not r["fair_share"]]}
    keys = ("light_ttft_p50_s", "light_ttft_p99_s", "light_engine_ttft_p99_s", "light_queue_p99_s", "step_s",
            "hit_vs_optimal")
    out = {name: {k: med(rs, k) for k in keys} for name, rs in parts.items()}
    on, off, alone = out["fair_on"], out["fair_off"], out["alone"]
    out["target_p99_s"] = (alone["light_ttft_p99_s"] or 0) + 2 * (on["step_s"] or 0)
    out["on_vs_off"] = (on["light_ttft_p99_s"] / off["light_ttft_p99_s"]) if off["light_ttft_p99_s"] else None
    iso = [i for r in rows for i in r.get("isolation", [])]
    out["isolation_salted"] = statistics.median([i["accuracy"] for i in iso if i["salted"]])
    out["isolation_unsalted"] = statistics.median([i["accuracy"] for i in iso if not i["salted"]])
    out["shared"] = next(r["shared"] for r in rows if "shared" in r)
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from .harness import bench_model_path

    args = _parse(argv)
    cfg = TenantsConfig(duration_s=args.duration, probes=args.probes, max_running=args.max_running, seed=args.seed,
                        min_light=args.min_light, stream_interval=args.stream_interval)
    model_path = bench_model_path(args.model)
    CLIENT_GC.install()  # full collections would stall the light tenant's streams here too (scheduler/gc_freeze.py)
    keys = os.path.join(tempfile.mkdtemp(prefix="tenants-"), "keys.json")
    write_keys(keys)
    rows = []
    for rep in range(args.repeats):
        for fair in ((True, False) if rep % 2 == 0 else (False, True)):  # alternating which runs first
            server = start_server(model_path, cfg, fair, args.threads, keys)
            try:
                rows.append({"rep": rep, **asyncio.run(repetition(server.url, cfg, fair, extras=fair))})
            finally:
                server.stop()
    report = {"bench": "tenants", "command": args.command, "model": args.model, "repeats": args.repeats,
              "engine_threads": args.threads,
              "config": asdict(cfg), "summary": summarize(rows), "runs": rows}
    out = BenchOutput("tenants", args.out)
    out.finish(out.write_report(f"tenants_{args.model}", report, markdown(report)))
    return report


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{1000 * value:,.0f} ms"


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _parse(argv: Sequence[str] | None) -> Any:
    d = TenantsConfig()
    p = bench_parser("tenants", __doc__)
    p.add_argument("--model", default="S", help="bench model (S, M, L), a checkpoint directory or a config.json")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of offered load per phase (at least)")
    p.add_argument("--min-light", type=int, default=d.min_light,
                   help="a phase lasts until the light tenant is expected to have sent this many requests")
    p.add_argument("--probes", type=int, default=d.probes, help="isolation probes of each kind")
    p.add_argument("--max-running", type=int, default=d.max_running)
    p.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help="the server's --stream-interval (1: a chunk per token; the first token at once either way)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the server's engine (on 2 cores, 1 leaves a core to the HTTP frontend and "
                        "to this client, whose delays would otherwise be measured as the light tenant's)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions per fair-share setting; medians reported")
    p.add_argument("--seed", type=int, default=d.seed)
    return parse_args(p, argv)


if __name__ == "__main__":
    main()
    sys.exit(0)
