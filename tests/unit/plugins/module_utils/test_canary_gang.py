# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A canary's rank of a gang (an instance over several hosts): the leader runs as any canary with its rank
arguments; a member that serves no API joins, then holds its engine until it is told to stop.

Boots use the unit-test double of `vllm serve` (test_vllm_engine); the real engine's members are run by the
real-engine lane (tests/integration/test_real_engine.py, step 9)."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _canary
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import EngineSpecError
from ansible_collections.gpufleet.vllm.tests.unit.plugins.module_utils.test_vllm_engine import spec_for, write_fake_vllm

FOLLOWER_ARGS = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29501", "--headless"]


@pytest.fixture
def fake_vllm(tmp_path) -> str:
    return write_fake_vllm(tmp_path)


def member(tmp_path, **over) -> _canary.GangMember:
    return _canary.GangMember.from_dict({"args": FOLLOWER_ARGS, "environment": {"VLLM_HOST_IP": "10.0.0.2"}, "serves_api": False,
                                         "ranks": 1, "stop_file": str(tmp_path / "stop"), "hold_timeout": 20, **over})


def stop_once_removed(path: str, seen: dict[str, bool]) -> threading.Thread:
    """Write the stop file once the member removed the stale one it found (or after 30 s, noting that it did not):
    ordered by what the member does, not by how long its engine takes to start."""
    def write() -> None:
        deadline = time.monotonic() + 30
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        seen["removed"] = not os.path.exists(path)
        with open(path, "w", encoding="utf-8"):
            pass
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_a_member_without_api_joins_holds_until_told_and_reports_its_rank(tmp_path, fake_vllm):
    gang = member(tmp_path)
    # a stop file an earlier run left must not stop this member as soon as it joins
    (tmp_path / "stop").write_text("")
    seen: dict[str, bool] = {}
    stopper = stop_once_removed(gang.stop_file, seen)
    log = tmp_path / "member.log"
    result = _canary.run_canary(spec_for(fake_vllm, gang=gang, log_path=str(log)))
    stopper.join(timeout=5)
    assert result["health"] == "joined" and result["held"] == "stop_file" and result["verdict"] == "pass", result
    assert seen == {"removed": True}, "the member did not remove the stale stop file before it held"
    # the stop file that stopped it is its caller's to remove: removing it here raced with the caller's write
    assert os.path.exists(gang.stop_file), "the member left the stop file that stopped it"
    assert result["argv"][-len(FOLLOWER_ARGS):] == FOLLOWER_ARGS
    # its rank as the instance numbers it, with the budget the gang runs
    assert [r["rank"] for r in result["ranks"]] == [1] and result["ranks"][0]["reserved_kv_bytes"] is not None
    assert "gang member at 10.0.0.2" in log.read_text(), "the member's environment reaches the engine"
    assert f"locked-memory limit {resource.getrlimit(resource.RLIMIT_MEMLOCK)!r}" in log.read_text(), "no limit given, the task's"
    assert result["load"]["completed"] == 0 and result["stop"]["leftover_pids"] == []


def _may_raise_memlock() -> bool:
    """Whether this process may raise its hard locked-memory limit (root with CAP_SYS_RESOURCE; not in every container)."""
    code = "import resource as r; r.setrlimit(r.RLIMIT_MEMLOCK, (r.RLIM_INFINITY, r.RLIM_INFINITY))"
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True).returncode == 0


def test_a_member_runs_with_the_locked_memory_limit_of_its_unit(tmp_path, fake_vllm):
    """NCCL pins its buffers: the member's unit sets LimitMEMLOCK=infinity, and its canary engine starts with the limit
    systemd would give that unit - infinity, or the hard limit where this process may not raise it (systemd's closest) -
    while the module's own limit is put back at once. A limit below the hard one sets the soft limit."""
    kept = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    infinity = resource.RLIM_INFINITY
    log = tmp_path / "member.log"
    result = _canary.run_canary(spec_for(fake_vllm, gang=member(tmp_path, limit_memlock="infinity", hold_timeout=1), log_path=str(log)))
    got = (infinity, infinity) if _may_raise_memlock() or kept[1] == infinity else (kept[1], kept[1])
    assert f"locked-memory limit {got!r}" in log.read_text(), log.read_text()[-2000:]
    assert result["locked_memory_limit"] == ("infinity" if got[0] == infinity else str(got[0])), result.get("locked_memory_limit")
    assert resource.getrlimit(resource.RLIMIT_MEMLOCK) == kept, "the module's own limit is back"

    log = tmp_path / "member-bytes.log"
    result = _canary.run_canary(spec_for(fake_vllm, gang=member(tmp_path, limit_memlock="65536", hold_timeout=1), log_path=str(log)))
    assert f"locked-memory limit {(65536, kept[1])!r}" in log.read_text(), log.read_text()[-2000:]
    assert result["locked_memory_limit"] == "65536" and resource.getrlimit(resource.RLIMIT_MEMLOCK) == kept


def test_a_member_whose_engine_dies_after_joining_fails_with_that(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE", "headless_dies")
    result = _canary.run_canary(spec_for(fake_vllm, gang=member(tmp_path)))
    assert result["health"] == "joined" and result["held"] == "died" and result["verdict"] == "fail", result
    assert "while the gang's leader ran its canary" in result["reasons"][0] and result["log_tail"]


def test_a_member_whose_ranks_never_join_times_out(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE", "never_healthy")
    result = _canary.run_canary(spec_for(fake_vllm, gang=member(tmp_path), startup_timeout=1))
    assert result["health"] == "timeout" and result["verdict"] == "fail" and "held" not in result, result
    assert result["reasons"] == ["0 of its 1 rank(s) logged their KV cache within 1 s (it runs no API server)"]


def test_a_member_never_told_to_stop_gives_up_after_its_hold(tmp_path, fake_vllm):
    result = _canary.run_canary(spec_for(fake_vllm, gang=member(tmp_path, hold_timeout=1)))
    assert result["held"] == "timeout" and result["verdict"] == "fail", result
    assert "no stop file within hold_timeout (1 s)" in result["reasons"][0]


def test_the_leader_is_a_canary_with_its_rank_arguments(tmp_path, fake_vllm):
    args = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29501"]
    leader = _canary.GangMember.from_dict({"args": args, "environment": {"VLLM_HOST_IP": "10.0.0.1"}})
    result = _canary.run_canary(spec_for(fake_vllm, gang=leader))
    assert result["health"] == "healthy" and result["verdict"] == "pass" and result["load"]["completed"] == 6, result
    assert result["argv"][-len(args):] == args
    assert _canary.canary_env(spec_for(fake_vllm, gang=leader, env={"VLLM_HOST_IP": "x", "A": "1"}), base={})["VLLM_HOST_IP"] == "10.0.0.1"


@pytest.mark.parametrize("data, message", [
    ({}, "gang.args: expected the member's rank arguments"),
    ({"args": ["--headless"], "serves_api": False, "ranks": 1}, "gang.stop_file: a member that serves no API needs"),
    ({"args": ["--headless"], "serves_api": False, "ranks": 1, "stop_file": "relative"}, "gang.stop_file"),
    ({"args": ["--headless"], "serves_api": False, "stop_file": "/s"}, "gang.ranks"),
    ({"args": ["--node-rank\n1"]}, "gang.args[0]"),
    ({"args": ["-x"], "environment": {"BAD NAME": "1"}}, "gang.environment name"),
    ({"args": ["-x"], "serves_api": "no"}, "gang.serves_api: expected true or false"),
])
def test_a_bad_member_is_named_by_its_field(data, message):
    with pytest.raises(EngineSpecError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        _canary.GangMember.from_dict(data)
