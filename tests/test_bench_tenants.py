"""bench/tenants.py: the threshold accuracy, and a tiny run with fair share on and off end to end."""
import json

from radixserve.bench import tenants
from radixserve.bench.tenants import best_threshold_accuracy


def test_best_threshold_accuracy_is_half_without_signal_and_one_with_a_clean_split():
    assert best_threshold_accuracy([(0.1, True), (0.2, False), (0.3, True), (0.4, False)]) == 0.75
    assert best_threshold_accuracy([(0.1, False), (0.1, True)] * 10) == 0.5  # equal times tell nothing
    assert best_threshold_accuracy([(0.01, True)] * 5 + [(0.5, False)] * 5) == 1.0
    assert best_threshold_accuracy([(0.5, True)] * 5 + [(0.01, False)] * 5) == 0.5  # only "fast = sent" is a rule


def test_a_tiny_run_measures_both_settings_and_the_shared_prompt(tmp_path):
    report = tenants.main(["--model", "tiny", "--duration", "1.5", "--min-light", "0", "--probes", "4", "--repeats",
                           "1", "--threads", "1", "--out", str(tmp_path)])
    s = report["summary"]
    assert {r["fair_share"] for r in report["runs"]} == {True, False}
    for name in ("alone", "fair_on", "fair_off"):
        assert s[name]["light_ttft_p99_s"] > 0 and 0.9 <= s[name]["hit_vs_optimal"] <= 1.0 + 1e-9
        # The engine's own TTFT (meta_info.engine_ttft) is a part of the client's, its queue time a part of that.
        assert 0 <= s[name]["light_queue_p99_s"] <= s[name]["light_engine_ttft_p99_s"] <= s[name]["light_ttft_p99_s"]
    # 64 tenants salted after one system prompt compute it once, and each private suffix.
    assert s["shared"]["computed"] == s["shared"]["one_system_prompt_plus_suffixes"] == 1024 + 64 * 64
    assert json.loads((tmp_path / "tenants_tiny.json").read_text())["summary"]["shared"] == s["shared"]


def test_a_phase_lasts_until_the_light_stream_offered_its_minimum():
    cfg = tenants.TenantsConfig(duration_s=30.0, min_light=100)
    assert tenants.phase_seconds(cfg, 10.0) == 30.0  # 300 light requests in the duration already
    assert tenants.phase_seconds(cfg, 0.4) == 250.0  # model L's light rate: 100 requests take 250 s
    assert tenants.phase_seconds(tenants.TenantsConfig(min_light=0), 0.4) == 30.0
