"""The llama.cpp peer bench without llama.cpp: the report on recorded rows, the client against a stand-in
llama-server (a per-slot prompt cache, streamed as llama-server streams), the slot settings, the converter's
pre-tokenizer fallback, and the gsp_long workload."""
import asyncio
import json

import pytest

from radixserve.bench import peer_llamacpp
from radixserve.bench._llamacpp import parse_slots, pre_tokenizer_fallback
from radixserve.bench.http_bench import Timing
from radixserve.radix.optimal import optimal_counts
from radixserve.bench.output import BenchOutput
from radixserve.bench.report_llamacpp import LLAMA, OURS, build_report, markdown
from radixserve.bench.workloads import WORKLOAD_NAMES, WorkRequest, make_workload


def run_row(engine, workload, rep, req_per_s, ttft_s, computed, settings=None):
    """One timed run as peer_llamacpp records it (the fields the report reads, plus some it carries)."""
    prompt = 17408
    return {"engine": engine, "workload": workload, "rep": rep, "clients": 16, "settings": settings,
            "num_requests": 16, "wall_s": 16 / req_per_s, "req_per_s": req_per_s, "tok_per_s": 1.0,
            "prompt_tokens": prompt, "cached_tokens": prompt - computed, "output_tokens": 1024,
            "hit_rate": 1 - computed / prompt, "ttft_p50_s": ttft_s, "ttft_p99_s": 2 * ttft_s,
            "tpot_p50_s": 0.1, "tpot_p99_s": 0.2, "computed_tokens": computed,
            "optimal_computed_tokens": 3072, "optimal_hit_rate": 1 - 3072 / prompt}


RUNS = [run_row(OURS, "gsp", 0, 2.0, 0.5, 3072), run_row(LLAMA, "gsp", 0, 1.0, 2.0, 9000, "16"),
        run_row(LLAMA, "gsp", 1, 1.5, 1.0, 8000, "16"), run_row(OURS, "gsp", 1, 3.0, 0.4, 3072),
        run_row(OURS, "gsp", 2, 2.5, 0.3, 3072), run_row(LLAMA, "gsp", 2, 0.5, 3.0, 9000, "16"),
        run_row(OURS, "react", 0, 4.0, 0.2, 100)]  # react: no llama.cpp row, so no ratio
SWEEP = [{**run_row(LLAMA, "gsp", -1, 1.2, 1.0, 9000, "4"), "chosen": False},
         {**run_row(LLAMA, "gsp", -1, 1.4, 1.0, 8000, "16"), "chosen": True}]
SINGLE = [{"engine": e, "rep": r, "context": 1024, "new_tokens": 64, "prefill_tok_s": p, "decode_tok_s": d}
          for e, r, p, d in [(OURS, 0, 700.0, 30.0), (LLAMA, 0, 500.0, 50.0), (LLAMA, 1, 600.0, 40.0),
                             (OURS, 1, 800.0, 20.0), (OURS, 2, 750.0, 25.0), (LLAMA, 2, 550.0, 45.0)]]


def test_report_medians_ratios_and_tables(tmp_path):
    report = build_report(RUNS, SWEEP, SINGLE, {"model": "L", "dtype": "bf16", "size": "full", "runs": 3,
                                                "load_average": {"start": 1.5, "end": 2.25}})
    rows = {(r["workload"], r["engine"]): r for r in report["rows"]}
    ours, theirs = rows[("gsp", OURS)], rows[("gsp", LLAMA)]
    assert (ours["req_per_s"], ours["req_per_s_min"], ours["req_per_s_max"]) == (2.5, 2.0, 3.0)
    assert (theirs["req_per_s"], theirs["ttft_p50_ms"], theirs["ttft_p99_ms"]) == (1.0, 2000.0, 4000.0)
    assert theirs["computed_tokens"] == 9000 and theirs["computed_tokens_runs"] == [9000, 8000, 9000]
    assert theirs["settings"] == "16" and ours["num_runs"] == 3
    assert report["ratios"]["gsp"]["req_per_s"] == 2.5
    assert report["ratios"]["gsp"]["ttft_p50"] == pytest.approx(400 / 2000)
    assert "react" not in report["ratios"]
    single = report["single_stream"]
    assert single["engines"][OURS]["decode_tok_s"] == 25.0 and single["engines"][LLAMA]["decode_tok_s"] == 45.0
    assert single["decode_ratio"] == pytest.approx(25 / 45) and single["prefill_ratio"] == pytest.approx(750 / 550)
    assert [s["chosen"] for s in report["sweep"]] == [False, True]

    text = markdown(report)
    assert "| gsp | **radixserve** | 16 | - | 2.50 (2.00–3.00) | 400 / 800 | 100.0 / 200.0 | 3072 of 17408 |" in text
    assert "| gsp | llama.cpp | 16 | 16 slots, KV per slot | 1.00 (0.50–1.50) |" in text
    assert "9000 of 17408 (varies) | 0.483 | 0.824 |" in text
    assert "- gsp: radixserve / llama.cpp (16 slots, KV per slot) = **2.50x** req/s; TTFT p50 0.20x" in text
    assert "| gsp | 4 slots, KV per slot | 1.20 | 1000 | 9000 |  |" in text
    assert "| llama.cpp | 550.0 (500.0–600.0) | 45.0 (40.0–50.0) | 3 |" in text
    assert "decode **0.56x**, prefill **1.36x**" in text
    assert "load average (1 min) 1.50 at the start, 2.25 at the end" in text

    out = BenchOutput("peer_llamacpp", str(tmp_path))
    assert peer_llamacpp.write_report(report, out) == text
    saved = json.loads((tmp_path / "peer_llamacpp_L_bf16.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"])) and len(saved["records"]) == len(RUNS)
    assert (tmp_path / "peer_llamacpp_L_bf16.md").read_text() == text


def test_a_single_stream_report_of_a_checkpoint_directory(tmp_path):
    """No workloads (--workloads ""): the single stream only, named after the checkpoint directory."""
    report = build_report([], [], SINGLE, {"model": "/ckpts/qwen-like/", "dtype": "bf16", "size": "full", "runs": 3,
                                           "threads": 2, "engines": {}, "load_average": {"start": 0.1, "end": 0.2}})
    text = peer_llamacpp.write_report(report, BenchOutput("peer_llamacpp", str(tmp_path)))
    assert "decode **0.56x**, prefill **1.36x**" in text
    assert (tmp_path / "peer_llamacpp_qwen-like_bf16_single.md").read_text() == text


def test_slot_settings():
    assert parse_slots("16", 32) == (16, False)
    assert parse_slots("4u", 32) == (4, True)
    assert parse_slots("c", 32) == (32, False) and parse_slots("cu", 8) == (8, True)
    for bad in ("0", "x", "u", "16uu", ""):
        with pytest.raises(ValueError, match="slot setting"):
            parse_slots(bad, 4)


def test_request_bodies_and_replies():
    req = WorkRequest("k", [11, 12, 13], 2)
    path, body = peer_llamacpp.request_body(OURS, req)
    assert path == "/generate" and json.loads(body) == {"input_ids": [11, 12, 13], "stream": True, "sampling_params": {
        "max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}}
    path, body = peer_llamacpp.request_body(LLAMA, req)
    sent = json.loads(body)
    assert path == "/completion" and sent["prompt"] == [11, 12, 13] and sent["n_predict"] == 2
    assert sent["cache_prompt"] and sent["ignore_eos"] and sent["return_tokens"] and sent["temperature"] == 0.0
    assert not sent["stream"]

    # radixserve: cumulative output_ids, cached tokens on the event with a finish_reason
    timing, out = Timing(prompt_tokens=3), [7]
    assert peer_llamacpp.read_event({"output_ids": [7, 8], "meta_info": {"finish_reason": None}}, timing, out) == [8]
    assert timing.cached_tokens == 0
    final = {"output_ids": [7, 8], "meta_info": {"finish_reason": {"type": "length"}, "cached_tokens": 2}}
    assert peer_llamacpp.read_event(final, timing, [7, 8]) == [] and timing.cached_tokens == 2
    with pytest.raises(RuntimeError, match="radixserve: .*overloaded"):
        peer_llamacpp.read_event({"error": {"message": "overloaded"}}, timing, [])
    # llama.cpp: one reply; its timings give the counts and the first-to-last-token time
    timing = Timing(prompt_tokens=3)
    reply = {"tokens": [9, 10, 11], "timings": {"prompt_n": 1, "cache_n": 2, "predicted_ms": 200.0}}
    assert peer_llamacpp.read_reply(reply, timing, 0.5) == [9, 10, 11]
    assert (timing.cached_tokens, timing.output_tokens) == (2, 3)
    assert timing.ttft_s == pytest.approx(0.3) and timing.tpot_s == pytest.approx(0.1)
    with pytest.raises(RuntimeError, match="counted 1 \\+ 1 prompt tokens for a prompt of 3"):
        peer_llamacpp.read_reply({"tokens": [], "timings": {"prompt_n": 1, "cache_n": 1}}, timing, 0.1)
    with pytest.raises(RuntimeError, match="context size"):
        peer_llamacpp.read_reply({"error": {"message": "context size exceeded"}}, timing, 0.1)


def stand_in_llama_server(slots):
    """A stand-in llama-server: `slots` slots, each keeping its last prompt + output (a request takes the free
    slot sharing the longest prefix with it); answers /completion with one JSON reply, as llama-server does."""
    memory = [[] for _ in range(slots)]
    busy = [False] * slots

    async def handle(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
            body = json.loads(await reader.readexactly(length))
            assert head.startswith(b"POST /completion ") and body["cache_prompt"] and not body["stream"]
            prompt = body["prompt"]
            slot = max((i for i in range(slots) if not busy[i]), key=lambda i: _common(memory[i], prompt))
            busy[slot] = True
            cached = min(_common(memory[slot], prompt), len(prompt) - 1)
            await asyncio.sleep(0.001 * body["n_predict"])  # generating
            tokens = [(sum(prompt) + i) % 3000 + 10 for i in range(body["n_predict"])]
            reply = json.dumps({"tokens": tokens, "stop": True, "timings": {
                "prompt_n": len(prompt) - cached, "cache_n": cached, "predicted_ms": 0.5 * body["n_predict"]}})
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(reply), reply.encode()))
            await writer.drain()
            memory[slot], busy[slot] = prompt + tokens, False

    return handle


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", ["gsp", "react"])
def test_client_runs_rounds_against_a_stand_in_server(name):
    """The closed loop over a multi-round workload: every request streams its tokens, the next round is built
    from the outputs, and the counted hit rate stays at or below the optimum (a slot cache is no better)."""
    workload = peer_llamacpp.PRESETS[name]["tiny"](0)

    async def main():
        server = await asyncio.start_server(stand_in_llama_server(4), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            return await peer_llamacpp.run_workload(url, LLAMA, workload, 4)
        finally:
            server.close()

    run = asyncio.run(main())
    again = peer_llamacpp.PRESETS[name]["tiny"](0)
    num_requests = sum(len(again.make_round(i, _Outputs()).requests) for i in range(again.num_rounds))
    assert run["num_requests"] == num_requests and run["output_tokens"] == num_requests * 4
    assert 0 < run["computed_tokens"] <= run["prompt_tokens"]
    assert run["computed_tokens"] >= run["optimal_computed_tokens"]
    assert run["hit_rate"] <= run["optimal_hit_rate"] + 1e-9 and run["hit_rate"] > 0
    assert run["ttft_p50_s"] is not None and run["tpot_p50_s"] is not None and run["req_per_s"] > 0


class _Outputs(dict):
    """Any key's output: placeholders, for counting a chained workload's requests."""

    def __missing__(self, key):
        return [10] * 4


def test_converter_pre_tokenizer_fallback(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}}))
    assert pre_tokenizer_fallback(str(tmp_path)) == "gpt-2"
    tok.write_text(json.dumps({"pre_tokenizer": {"type": "ByteLevel", "use_regex": False}}))
    assert pre_tokenizer_fallback(str(tmp_path)) == ""
    tok.write_text(json.dumps({"pre_tokenizer": {"type": "Sequence", "pretokenizers": []}}))
    assert pre_tokenizer_fallback(str(tmp_path)) == ""
    tok.unlink()
    assert pre_tokenizer_fallback(str(tmp_path)) == ""


def test_gsp_long_is_one_long_prefix_read_by_32_requests():
    (requests,) = [make_workload("gsp_long", "full").make_round(0, {}).requests]
    assert len(requests) == 32 and {len(r.prompt_ids) for r in requests} == {4096 + 64}
    assert {tuple(r.prompt_ids[:4096]) for r in requests} == {tuple(requests[0].prompt_ids[:4096])}
    assert len({tuple(r.prompt_ids[4096:]) for r in requests}) == 32 and {r.max_new_tokens for r in requests} == {64}
    counts = optimal_counts([[(r.prompt_ids, [0] * 64) for r in requests]])
    assert counts.computed_tokens == 4096 + 32 * 64
    assert "gsp_long" not in WORKLOAD_NAMES  # not in the scheduling grid of run_cache_bench
    for size in ("reduced", "tiny"):
        assert len(make_workload("gsp_long", size).make_round(0, {}).requests) >= 8


def test_a_batch_decode_report_says_its_batch(tmp_path):
    """--single-batch 16: the same medians and ratios, headed and named as a batch-16 decode."""
    batched = [{**r, "batch": 16} for r in SINGLE]
    report = build_report([], [], batched, {"model": "/g/L-q4_0.gguf", "dtype": "bf16", "size": "full", "runs": 3,
                                            "threads": 2, "engines": {}, "load_average": {"start": 0.1, "end": 0.2}})
    text = peer_llamacpp.write_report(report, BenchOutput("peer_llamacpp", str(tmp_path)))
    assert "Batch decode (16 sequences together" in text and "decode **0.56x**" in text
    assert (tmp_path / "peer_llamacpp_L-q4_0.gguf_bf16_batch16.md").read_text() == text


def test_command_line_errors(tmp_path, capsys):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    base = ["--llama-server", str(binary), "--gguf", str(tmp_path)]
    with pytest.raises(SystemExit):
        peer_llamacpp._parse(base)
    assert "not an executable file" in capsys.readouterr().err
    binary.chmod(0o755)
    assert peer_llamacpp._parse(base).workloads == ["gsp", "react", "gsp_long"]
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert peer_llamacpp._parse(["--llama-server", str(binary), "--model", str(gguf)]).gguf is None  # the same file
    with pytest.raises(SystemExit):
        peer_llamacpp._parse(["--llama-server", str(binary)])
    assert "--gguf is needed unless --model is a GGUF file" in capsys.readouterr().err
    for extra, message in ((["--workloads", "gsp,fewshot"], "unknown workload(s) fewshot"),
                           (["--llama-slots", "4,x"], "bad llama.cpp slot setting 'x'"),
                           (["--runs", "0"], "--runs and --clients must be >= 1")):
        with pytest.raises(SystemExit):
            peer_llamacpp._parse(base + extra)
        assert message in capsys.readouterr().err


def test_radixserve_side_on_the_tiny_model():
    """`radixserve serve` through the bench's own client: streamed /generate with input_ids, the cached tokens of
    meta_info, a chained workload's rounds; radixserve reuses the shared prompts of requests sent together."""
    from radixserve.bench.harness import bench_model_path

    server = peer_llamacpp.OursServer(bench_model_path("tiny"), "f32", 1, 8, 4096, [])
    try:
        asyncio.run(peer_llamacpp.warm_up(server.url, OURS))
        runs = {}
        for name in ("gsp", "react"):
            server.flush()
            runs[name] = asyncio.run(peer_llamacpp.run_workload(server.url, OURS,
                                                                peer_llamacpp.PRESETS[name]["tiny"](0), 8))
    finally:
        server.close()
    assert (runs["gsp"]["num_requests"], runs["gsp"]["output_tokens"]) == (8, 8 * 4)
    assert (runs["react"]["num_requests"], runs["react"]["output_tokens"]) == (12, 12 * 4)
    for run in runs.values():
        assert run["optimal_computed_tokens"] <= run["computed_tokens"] < run["prompt_tokens"]
        assert run["ttft_p50_s"] > 0 and run["tpot_p50_s"] > 0
    assert runs["gsp"]["hit_rate"] == pytest.approx(runs["gsp"]["optimal_hit_rate"])
