"""The vLLM peer bench without vLLM: workloads, run order, summaries and report, the worker's
JSON-lines protocol (against a stand-in `vllm` package), and the radixserve side on the tiny model."""
import io
import json
import os
import sys

import pytest

from radixserve.bench import _vllm_worker, peer_sides, peer_vllm, report_peer, roofline
from radixserve.bench.harness import bench_model_path
from radixserve.bench.output import BenchOutput
from radixserve.radix.optimal import optimal_counts
from radixserve.bench.peer_sides import OursSide, VllmSide, parse_reply
from radixserve.bench.peer_vllm import Measure, alternation, run_rounds
from radixserve.bench.report_peer import summarize
from radixserve.bench.workloads import SIZES, TOKEN_HI, TOKEN_LO, WORKLOAD_NAMES, make_workload

# A stand-in for vllm: the worker imports only LLM, SamplingParams, inputs.TokensPrompt and
# __version__. Outputs are a function of the prompt; the "prefix cache" reports, like vLLM, the
# longest earlier-seen prefix in whole blocks, below the last prompt token.
FAKE_VLLM = '''
__version__ = "fake-0"

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens

class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids

class _Output:
    def __init__(self, token_ids, cached):
        self.outputs = [_Completion(token_ids)]
        self.num_cached_tokens = cached

class LLM:
    def __init__(self, **kwargs):
        assert kwargs["enable_prefix_caching"] and kwargs["dtype"] == "float32"
        self.block = kwargs["block_size"]
        self.seen = set()

    def generate(self, prompts, params, use_tqdm=True):
        out = []
        for prompt, sp in zip(prompts, params):
            ids = prompt["prompt_token_ids"]
            cached = 0
            for end in range(self.block, len(ids), self.block):
                if tuple(ids[:end]) in self.seen:
                    cached = end
            for end in range(self.block, len(ids) + 1, self.block):
                self.seen.add(tuple(ids[:end]))
            out.append(_Output([(sum(ids) + i) % 3000 + 10 for i in range(sp.max_tokens)], cached))
        return out

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.seen.clear()
        return True
'''


@pytest.fixture
def fake_vllm(tmp_path):
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("def TokensPrompt(**kwargs):\n    return dict(kwargs)\n")
    return str(tmp_path / "fake")


@pytest.mark.parametrize("name", peer_vllm.PEER_WORKLOADS)
@pytest.mark.parametrize("size", SIZES)
def test_peer_workloads_build_round_by_round(name, size):
    workload = make_workload(name, size)
    assert workload.name == name  # rows are labelled by it
    assert workload.arrival_step(0) is None
    requests = workload.make_round(0, {}).requests
    assert requests and all(TOKEN_LO <= t < TOKEN_HI for r in requests for t in r.prompt_ids)


def test_nonaligned_variants_are_not_block_aligned_and_stay_out_of_the_grid():
    gsp = make_workload("gsp1000q61", "full").make_round(0, {}).requests
    assert {len(r.prompt_ids) for r in gsp} == {1061}
    group0 = [r.prompt_ids for r in gsp if r.key.startswith("g0/")]
    assert len({tuple(p[:1000]) for p in group0}) == 1 and len({p[1000] for p in group0}) > 1
    few = make_workload("fewshot1499", "full").make_round(0, {}).requests
    assert len({tuple(r.prompt_ids[:1499]) for r in few}) == 1 and {len(r.prompt_ids) for r in few} == {1549}
    for length in (1000, 1061, 1499, 1549):
        assert length % 16 and length % 128
    assert not set(peer_vllm.NONALIGNED_WORKLOADS) & set(WORKLOAD_NAMES)


def test_alternation_reverses_every_other_repetition():
    order = alternation(["ours", "b128", "b32"], 4)
    assert order == [["ours", "b128", "b32"], ["b32", "b128", "ours"]] * 2
    assert alternation(["a"], 3) == [["a"]] * 3


def test_worker_replies_parse_and_stray_lines_are_skipped():
    out = io.StringIO()
    _vllm_worker._send(out, {"ok": True, "cached": [0, 32]})
    assert parse_reply(out.getvalue()) == {"ok": True, "cached": [0, 32]}
    assert parse_reply("INFO 12-01 vllm says hello\n") is None
    with pytest.raises(ValueError):
        parse_reply(_vllm_worker.PREFIX + '["ok"]\n')
    with pytest.raises(ValueError):
        parse_reply(_vllm_worker.PREFIX + '{"outputs": []}\n')


def _measure(engine, rep, wall_s, outputs, cached):
    prompts = [[10 + i] * 20 for i in range(4)]
    return Measure(engine, "gsp", rep, keys=[f"k{i}" for i in range(4)], prompts=prompts, outputs=outputs,
                   cached=cached, round_of=[0] * 4, wall_s=wall_s)


def test_summary_medians_ratio_and_report_files(tmp_path):
    outs = [[1, 2], [3, 4], [5, 6], [7, 8]]
    other = outs[:3] + [[7, 9]]
    measures = [_measure("radixserve", r, w, outs, [0, 19, 0, 19]) for r, w in enumerate((2.0, 1.0, 4.0))]
    measures += [_measure("vllm-b128", r, 1.0, outs, [0, 16, 0, 16]) for r in range(3)]
    measures += [_measure("vllm-b32", r, 2.0, other, [0, 0, 0, 0]) for r in range(3)]
    config = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
              "num_hidden_layers": 1}
    roof = {"gflops": 1e-6, "threads": 1, "num_tokens": 4}
    report = report_peer.build_report(measures, config, roof, engines={}, meta={"model": "tiny", "reps": 3})
    rows = {r["engine"]: r for r in report["rows"]}
    ours, b128, b32 = rows["radixserve"], rows["vllm-b128"], rows["vllm-b32"]
    assert (ours["req_per_s"], ours["req_per_s_min"], ours["req_per_s_max"]) == (2.0, 1.0, 4.0)
    assert ours["tok_per_s"] == pytest.approx((80 + 8) / 2.0)
    assert ours["hit_rate"] == pytest.approx(38 / 80) and b128["hit_rate"] == pytest.approx(32 / 80)
    assert report["ratios"]["gsp"] == {"best_peer": "vllm-b128", "best_peer_req_per_s": 4.0,
                                       "ours_req_per_s": 2.0, "ours_over_best": 0.5}
    assert b128["outputs_match_ours"] is True and b32["outputs_match_ours"] is False
    assert (b32["num_outputs_differ"], b32["first_differ"]) == (1, "k3")
    # P_linear = 8*8 + 2*8*4 + 8*8 + 3*8*16 = 576; forward tokens = 80 - 38 + 8 = 50 over 2 s.
    assert ours["linear_gflops"] == pytest.approx(2 * 576 * 50 / 2.0 / 1e9)
    assert ours["roofline_fraction"] == pytest.approx(ours["linear_gflops"] / 1e-6)
    report_peer.write_report(report, BenchOutput("peer_vllm", str(tmp_path)))
    saved = json.loads((tmp_path / "peer_vllm_tiny.json").read_text())
    assert saved["ratios"]["gsp"]["ours_over_best"] == 0.5
    md = (tmp_path / "peer_vllm_tiny.md").read_text()
    assert "| gsp | vllm-b128 | 4.00 (4.00–4.00) | 88 | 0.400 |" in md
    assert "no (1 differ)" in md and "**0.50x**" in md
    assert (tmp_path / "peer_vllm_tiny.png").stat().st_size > 1000


def test_linear_params_and_roofline_measure():
    s_config = {"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_hidden_layers": 4}
    assert roofline.linear_params(s_config) == 4 * (256 * 256 * 2 + 2 * 256 * 128 + 3 * 256 * 688)
    import torch

    threads = torch.get_num_threads()
    roof = roofline.measure_roofline(s_config, threads=1, num_tokens=(16, 32), min_time_s=0.01)
    assert roof["gflops"] > 0 and roof["passes"] >= 3 and torch.get_num_threads() == threads
    # The best of both methods at both sizes, so an engine's packed linears cannot beat "the roofline".
    assert sorted((r["method"], r["num_tokens"]) for r in roof["runs"]) == [
        ("packed linear", 16), ("packed linear", 32), ("torch.matmul", 16), ("torch.matmul", 32)]
    assert roof["gflops"] == max(r["gflops"] for r in roof["runs"])


@pytest.fixture(scope="module")
def ours_tiny():
    side = OursSide(bench_model_path("tiny"), threads=1, kv_cache_tokens=4096)
    yield side
    side.close()


def test_radixserve_side_chains_rounds_and_reports_hits(ours_tiny):
    ours_tiny.reset()
    m = run_rounds(ours_tiny, make_workload("multiturn", "tiny"))
    assert len(m.prompts) == 4 * 3 and all(len(o) == 4 for o in m.outputs)
    by_key = dict(zip(m.keys, zip(m.prompts, m.outputs)))
    p0, o0 = by_key["c0/t0"]
    p1, _ = by_key["c0/t1"]
    assert p1[:len(p0) + len(o0)] == p0 + o0  # the next turn carries this engine's answer
    assert [c for c, r in zip(m.cached, m.round_of) if r == 0] == [0] * 4
    assert all(c >= len(by_key[k.replace("/t1", "/t0")][0]) for k, c, r in zip(m.keys, m.cached, m.round_of) if r == 1)
    ours_tiny.reset()
    g = run_rounds(ours_tiny, make_workload("gsp1000q61", "tiny"))
    opt = optimal_counts(g.rounds())
    assert g.cached_tokens >= 0.95 * (opt.prompt_tokens - opt.computed_tokens) > 0
    # The step profile comes along: its parts are positive and add up to the step time.
    parts = [g.profile[k] for k in ("plan", "build", "forward", "sample", "outputs")]
    assert all(p > 0 for p in parts) and sum(parts) == pytest.approx(g.profile["step"], rel=0.05)
    assert g.profile["steps"] >= make_workload("gsp1000q61", "tiny").num_rounds
    row = summarize([g])[0]
    assert set(row["step_profile"]) == {"plan", "build", "forward", "sample", "outputs", "unaccounted"}
    assert abs(row["step_profile"]["unaccounted"]) < 0.05
    with pytest.raises(ValueError, match="fixed-step"):
        run_rounds(ours_tiny, make_workload("hotstream", "tiny"))


def test_vllm_side_speaks_the_worker_protocol(fake_vllm):
    env = peer_sides.worker_env("0", 1, {"PYTHONPATH": fake_vllm})
    side = VllmSide("vllm-b32", sys.executable, {"model": "/nowhere", "block_size": 32}, env, startup_timeout_s=60)
    tmp = side.tmp
    try:
        assert side.ready["vllm_version"] == "fake-0" and side.ready["config"]["enforce_eager"] is True
        assert os.path.dirname(side.proc.args[1]) == tmp  # the worker runs from its temp dir
        prompt = list(range(100, 170))
        first = side.run_round([prompt, prompt], [3, 5])
        assert first.cached == [0, 64] and [len(o) for o in first.outputs] == [3, 5]
        side.reset()
        assert side.run_round([prompt], [1]).cached == [0]
        with pytest.raises(RuntimeError, match="unknown command"):
            side._call({"cmd": "bogus"})
    finally:
        side.close()
    assert side.proc.returncode == 0 and not os.path.exists(tmp)


def test_vllm_side_reports_a_failed_start(fake_vllm, tmp_path):
    env = peer_sides.worker_env("0", 1, {"PYTHONPATH": fake_vllm})
    with pytest.raises(RuntimeError, match="AssertionError"):
        VllmSide("vllm-b32", sys.executable, {"model": "/nowhere", "dtype": "float16"}, env,
                 startup_timeout_s=60, work_root=str(tmp_path))
    (log,) = tmp_path.glob("radixserve-peer-vllm-*/stderr.log")  # kept for the post-mortem
    assert "Traceback" in log.read_text()


def test_main_end_to_end_with_a_stand_in_vllm(tmp_path, fake_vllm):
    out = tmp_path / "results"
    report = peer_vllm.main(["--model", "tiny", "--settle-s", "0", "--size", "tiny", "--workloads", "gsp1000q61,multiturn",
                             "--rounds", "2", "--block-sizes", "32", "--threads", "1", "--vllm-python",
                             sys.executable, "--vllm-env", f"PYTHONPATH={fake_vllm}", "--out", str(out)])
    rows = {(r["workload"], r["engine"]): r for r in report["rows"]}
    assert set(rows) == {(w, e) for w in ("gsp1000q61", "multiturn") for e in ("radixserve", "vllm-b32")}
    ours, fake = rows[("gsp1000q61", "radixserve")], rows[("gsp1000q61", "vllm-b32")]
    assert ours["num_runs"] == fake["num_runs"] == 2 and ours["outputs_stable"]
    assert 0 < fake["hit_rate"] < ours["hit_rate"]  # 32 of the 45 shared tokens are whole blocks
    assert fake["outputs_match_ours"] is False
    assert report["engines"]["vllm-b32"]["llm"]["max_num_seqs"] == 64
    assert report["warmup_runs"] == 1 and "runs each workload 1 time(s) untimed" in (out / "peer_vllm_tiny.md").read_text()
    assert {p.name for p in out.iterdir()} == {"peer_vllm_tiny.json", "peer_vllm_tiny.md", "peer_vllm_tiny.png"}


def test_dtype_follows_the_checkpoint_and_sizes_the_vllm_kv():
    config = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}
    assert peer_sides.resolve_dtype("auto", {**config, "torch_dtype": "bfloat16"}) == "bfloat16"
    assert peer_sides.resolve_dtype("auto", {**config, "dtype": "bfloat16"}) == "bfloat16"
    assert peer_sides.resolve_dtype("auto", config) == "float32"
    assert peer_sides.resolve_dtype("float32", {**config, "dtype": "bfloat16"}) == "float32"
    tokens = 2**30 // (24 * 2 * 2 * 64 * 2)  # 1 GiB of bf16 KV
    bf16 = peer_sides.vllm_kv_gib(tokens, config, 32, num_requests=0, dtype="bfloat16")
    fp32 = peer_sides.vllm_kv_gib(tokens, config, 32, num_requests=0, dtype="float32")
    assert (bf16, fp32) == (2, 3)  # x1.5, rounded up to whole GiB
    assert report_peer.report_name({"model": "L", "dtype": "bfloat16"}) == "peer_vllm_L_bf16"
    assert report_peer.report_name({"model": "S"}) == "peer_vllm_S"


def test_real_size_is_issue_35s_shapes():
    gsp = make_workload("gsp", "real").make_round(0, {}).requests
    assert len(gsp) == 16 and {len(r.prompt_ids) for r in gsp} == {1024 + 64}
    assert {r.max_new_tokens for r in gsp} == {64}
    long = make_workload("gsp_long", "real").make_round(0, {}).requests
    assert len(long) == 32 and {len(r.prompt_ids) for r in long} == {4096 + 64}
    for name in ("fewshot", "multiturn", "react"):
        assert {r.max_new_tokens for r in make_workload(name, "real").make_round(0, {}).requests} == {64}


def test_decode_step_bytes_by_hand():
    # 1 layer: q, o, gate, up, down 4 x 4 and k, v 4 x 2 (96) + a 4 x 4 head (16): 224 bf16 bytes;
    # K/V 2 x 2 bytes x 1 KV head x 2 dims = 8 B/token.
    config = {"hidden_size": 4, "intermediate_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 2, "num_hidden_layers": 1, "vocab_size": 4}
    # Two requests on a shared 3-token prefix, 2 and 1 output tokens: step 0 runs both, step 1 the first.
    rounds = [[([1, 2, 3, 4], [9, 9], None), ([1, 2, 3, 5], [9], None)]]
    b = roofline.decode_step_bytes(config, rounds, elem=2)
    assert b["weights"] == 224 and b["decode_steps"] == 2
    assert b["kv_per_request"] == pytest.approx(8 * ((4 + 4) + (4 + 1)) / 2)
    # step 0: the tree of both prompts holds 5 tokens; step 1: the first prompt's 4 + its first output token
    assert b["kv_prefix_once"] == pytest.approx(8 * ((5 + 0) + (4 + 1)) / 2)
    md = "\n".join(report_peer._step_bytes_lines({"gsp": b}, {"gsp": {"ours_over_best": 1.25}}))
    assert "| gsp | 0 | 0 | 0 | 1.25x |" in md
