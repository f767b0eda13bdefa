# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vllm_canary module shell: arguments, check mode, failures, secrets.

Boots use the unit-test double of `vllm serve` from test_vllm_engine (not an
engine); the real engine is exercised by the integration tests.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpufleet.vllm.plugins.module_utils._units import _gang
from ansible_collections.gpufleet.vllm.plugins.modules import vllm_canary
from ansible_collections.gpufleet.vllm.tests.unit.plugins.module_utils.test_canary_takeover import FakeSystemd
from ansible_collections.gpufleet.vllm.tests.unit.plugins.module_utils.test_vllm_engine import write_fake_vllm

SMALL_LOAD = {"requests": 4, "concurrency": 2, "prompt_tokens": 8, "max_tokens": 3, "warmup": 1}


@pytest.fixture
def fake_vllm(tmp_path) -> str:
    """`vllm` running the unit-test double (not an engine)."""
    return write_fake_vllm(tmp_path)


def run(capsys, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        vllm_canary.main()
    return exc.value.code or 0, json.loads(capsys.readouterr().out)


def test_check_mode_returns_argv_and_starts_nothing(capsys, tmp_path):
    rc, out = run(capsys, {
        "_ansible_check_mode": True, "executable": str(tmp_path / "missing-vllm"), "model": "/m", "mode": "manual",
        "kv_cache_memory_bytes": "0.5GiB", "port": 18123, "gpu_memory_utilization": 0.8,
        "serve_args": {"max_model_len": 8192, "enforce_eager": True, "api_key": "k-secret"},
    })
    assert rc == 0 and out["changed"] is False
    assert out["argv"] == [str(tmp_path / "missing-vllm"), "serve", "/m", "--host", "127.0.0.1", "--port", "18123",
                           "--kv-cache-memory-bytes", "536870912", "--gpu-memory-utilization", "0.8",
                           "--enforce-eager", "--max-model-len", "8192"]  # the key goes in VLLM_API_KEY
    assert "verdict" not in out
    assert "k-secret" not in json.dumps(out)


@pytest.mark.parametrize("args, message", [
    ({"mode": "manual"}, "missing: kv_cache_memory_bytes"),
    ({"mode": "manual", "kv_cache_memory_bytes": "30GB!"}, "kv_cache_memory_bytes: invalid size"),
    ({"mode": "manual", "kv_cache_memory_bytes": 0}, "treats 0 as unset"),
    ({"serve_args": {"port": 1}}, "option 'port' is set by the module itself"),
    ({"env": {"VLLM_CPU_KVCACHE_SPACE": "4"}, "mode": "manual", "kv_cache_memory_bytes": 10}, "VLLM_CPU_KVCACHE_SPACE"),
    ({"load": {"concurrency": 0}}, "load.concurrency must be an integer >= 1"),
])
def test_bad_arguments_fail_clearly(capsys, args, message):
    rc, out = run(capsys, {"executable": "/nonexistent/vllm", "model": "m", **args})
    assert rc == 1 and out["failed"] is True
    assert message in out["msg"]
    assert "exception" not in out


def test_a_secret_option_other_than_the_api_key_is_refused_and_no_secret_is_logged_on_the_host(capsys, monkeypatch):
    logged: list[str] = []
    monkeypatch.setattr(vllm_canary.AnsibleModule, "log", lambda self, msg, log_args=None: logged.append(msg))
    rc, out = run(capsys, {"executable": "/nonexistent/vllm", "model": "m", "mode": "manual", "kv_cache_memory_bytes": 10,
                           "serve_args": {"hf_token": "hf-should-not-leak", "api_key": "k-should-not-leak"}})
    assert rc == 1 and out["failed"] is True
    assert out["msg"] == ("serve_args hf_token would put a secret on the engine's command line (/proc/PID/cmdline, readable "
                          "by every user of the host); give it in secret_env instead (for example HF_TOKEN for hf_token)")
    # the invocation Ansible logs on the host (the journal) names the options and masks their values
    (invocation,) = [msg for msg in logged if msg.startswith("Invoked with")]
    assert "hf_token" in invocation and "api_key" in invocation, invocation
    assert "should-not-leak" not in invocation + json.dumps(out), invocation


@pytest.mark.parametrize("serve_args", [{"api_key": "k-should-not-leak"}, '{"api_key": "k-should-not-leak"}'])
def test_a_parameter_that_fails_validation_returns_no_secret_serve_arg(capsys, serve_args):
    # Ansible validates the parameters, and returns them with its failure, before the module's own code runs
    rc, out = run(capsys, {"executable": "/nonexistent/vllm", "model": "m", "port": "not-a-port", "serve_args": serve_args})
    assert rc == 1 and out["failed"] is True and "port" in out["msg"], out
    assert "should-not-leak" not in json.dumps(out), out


def test_the_canary_never_runs_as_root(capsys):
    rc, out = run(capsys, {"executable": "/nonexistent/vllm", "model": "m", "user": "root"})
    assert rc == 1 and out["msg"] == "user: must not be root; the canary runs as the unprivileged user its instance runs as"


def test_pass_through_double_hides_env(capsys, fake_vllm, tmp_path):
    log = tmp_path / "engine.log"
    rc, out = run(capsys, {
        "executable": fake_vllm, "model": "m", "mode": "manual", "kv_cache_memory_bytes": "100000000",
        "secret_env": {"HF_TOKEN": "tok-should-not-leak"}, "load": SMALL_LOAD,
        "startup_timeout": 20, "stop_timeout": 3, "log_path": str(log),
    })
    assert rc == 0, out.get("msg")
    assert out["verdict"] == "pass" and out["changed"] is True
    assert out["kv_cache_tokens"] == (100_000_000 // 65536) * 128
    assert out["load"]["completed"] == 4
    assert out["log_path"] == str(log) and log.exists()
    assert "tok-should-not-leak" not in json.dumps(out)


def test_a_plain_environment_value_masks_nothing_in_the_result(capsys, fake_vllm):
    """A common value in the engine's plain environment (a 0 or a 1) is not masked wherever it appears in the
    result: rank 0, the preemptions and the exit code stay figures the reference profile reads."""
    rc, out = run(capsys, {"executable": fake_vllm, "model": "m", "mode": "manual", "kv_cache_memory_bytes": 100_000_000,
                           "env": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "0", "OMP_NUM_THREADS": "1"}, "load": SMALL_LOAD,
                           "startup_timeout": 20, "stop_timeout": 3})
    assert rc == 0, out.get("msg")
    assert out["ranks"][0]["rank"] == 0 and out["preemptions"] == 0 and out["load"]["warmup"] == 1, out
    assert "VALUE_SPECIFIED_IN_NO_LOG_PARAMETER" not in json.dumps(out)


def test_refused_boot_fails_task_with_engine_error(capsys, fake_vllm):
    rc, out = run(capsys, {
        "executable": fake_vllm, "model": "m", "mode": "manual", "kv_cache_memory_bytes": 100000000,
        "env": {"FAKE_ENGINE": "die_at_boot"}, "load": SMALL_LOAD, "startup_timeout": 20, "fail_on": [],
    })
    assert rc == 1 and out["failed"] is True
    assert out["verdict"] == "fail"
    assert out["msg"].startswith("vLLM canary (manual) did not boot: the engine exited while booting (exit code 1)")
    assert "Available memory on node 0 (8.59/10.09 GiB)" in out["msg"]
    assert out["engine_error"].startswith("rank 0: ValueError: Available memory")


def test_fail_on_controls_task_result(capsys, fake_vllm):
    common = {"executable": fake_vllm, "model": "m", "env": {"FAKE_ENGINE": "preempting"}, "load": SMALL_LOAD,
              "startup_timeout": 20, "stop_timeout": 3}
    rc, out = run(capsys, common)
    assert rc == 1 and out["verdict"] == "fail" and "4 preemptions" in out["msg"]
    rc, out = run(capsys, dict(common, fail_on=[]))
    assert rc == 0 and out["verdict"] == "fail"
    rc, out = run(capsys, dict(common, env={}, load=dict(SMALL_LOAD, requests=0),
                               fail_on=["fail", "inconclusive"]))
    assert rc == 1 and out["verdict"] == "inconclusive" and "no load test was run" in out["msg"]


def taken_over(monkeypatch, tmp_path, states: dict[str, str], fail: tuple[tuple[str, str], ...] = ()) -> tuple[FakeSystemd, dict[str, Any]]:
    """A fake systemctl behind the module's runner, and the takeover option of instance main."""
    systemd = FakeSystemd(states, fail=fail)
    monkeypatch.setattr(vllm_canary, "module_runner", lambda _module: systemd)
    return systemd, {"instance": "main", "state_dir": str(tmp_path / "gpufleet")}


def test_a_canary_that_cannot_start_its_engine_gives_the_instance_back_and_says_it_served(capsys, monkeypatch, tmp_path):
    """The engine's account does not exist: the instance was stopped for it, is started again, and the failure
    says it served (its caller waits for it before the host goes back to its load balancer)."""
    systemd, takeover = taken_over(monkeypatch, tmp_path, {"vllm-main.service": "active"})
    rc, out = run(capsys, {"executable": "/nonexistent/vllm", "model": "m", "mode": "manual", "kv_cache_memory_bytes": 10**8,
                           "user": "no-such-user-xyz", "takeover": takeover})
    assert rc == 1 and "no-such-user-xyz" in out["msg"], out["msg"]
    assert systemd.verbs() == ["stop vllm-main.service", "start vllm-main.service"]
    assert out["takeover"]["instance_serving"] is True and out["takeover"]["hold_removed"] is True and out["changed"] is True


def test_a_failed_boot_and_a_failed_restart_are_both_said(capsys, monkeypatch, tmp_path, fake_vllm):
    systemd, takeover = taken_over(monkeypatch, tmp_path, {"vllm-main.service": "active"}, fail=(("start", "vllm-main.service"),))
    rc, out = run(capsys, {"executable": fake_vllm, "model": "m", "mode": "manual", "kv_cache_memory_bytes": 100000000,
                           "env": {"FAKE_ENGINE": "die_at_boot"}, "load": SMALL_LOAD, "startup_timeout": 20, "takeover": takeover})
    assert rc == 1
    assert out["msg"].startswith("vLLM canary (manual) did not boot: the engine exited while booting"), out["msg"]
    assert "what it stopped did not all start again (systemctl start vllm-main.service failed (rc 1)" in out["msg"]
    assert "the hold on vllm-main.service stays" in out["msg"] and out["engine_error"].startswith("rank 0: ValueError")
    assert (tmp_path / "gpufleet" / "units" / "vllm-main.canary-hold.json").exists()
    assert systemd.states["vllm-main.service"] == "inactive"


def test_a_model_config_that_cannot_be_read_stops_nothing(capsys, monkeypatch, tmp_path):
    systemd, takeover = taken_over(monkeypatch, tmp_path, {"vllm-main.service": "active"})
    rc, out = run(capsys, {"executable": "/nonexistent/vllm", "model": str(tmp_path / "no-model"), "takeover": takeover,
                           "read_model_config": True})
    assert rc == 1 and out["msg"].startswith(f"read_model_config: cannot read {tmp_path / 'no-model' / 'config.json'}")
    assert systemd.verbs() == [] and out["takeover"]["instance_serving"] is True


def test_check_mode_reads_what_the_canary_would_stop_and_stops_nothing(capsys, monkeypatch, tmp_path):
    systemd, takeover = taken_over(monkeypatch, tmp_path, {"vllm-main.service": "active", "old.service": "active"})
    takeover["stop_units"] = ["old.service"]
    rc, out = run(capsys, {"_ansible_check_mode": True, "executable": "/nonexistent/vllm", "model": "m", "takeover": takeover})
    assert rc == 0 and out["changed"] is False
    assert out["takeover"]["stopped_units"] == ["old.service"] and out["takeover"]["instance_serving"] is True
    assert systemd.verbs() == [] and not (tmp_path / "gpufleet").exists()


def test_a_gang_member_takes_its_launch_as_gang_member_launch_gives_it(capsys, tmp_path, fake_vllm):
    gang = _gang.parse({"mode": "mp", "members": ["gpu-a1", "gpu-a2"], "address": "10.0.0.1", "port": 29501}, field="gang",
                       serve_args={"tensor_parallel_size": 2}, gpus={"gpu-a1": 1, "gpu-a2": 1}, member_addresses={"gpu-a2": "10.0.0.2"})
    # every key the filter gives (the module's argument spec takes each of them)
    launch = _gang.member_launch(gang, "gpu-a2")
    assert set(launch) == set(_gang.LAUNCH_KEYS) and launch["args"][-1] == "--headless"
    rc, out = run(capsys, {"_ansible_check_mode": True, "executable": fake_vllm, "model": "/m", "port": 18124,
                           "gang": dict(launch, ranks=1, stop_file=str(tmp_path / "stop"))})
    assert rc == 0 and out["argv"][-9:] == launch["args"]
    # told to stop only after its hold: the task fails, saying why, and nothing is left running
    rc, out = run(capsys, {"executable": fake_vllm, "model": "/m", "mode": "manual", "kv_cache_memory_bytes": 100_000_000,
                           "gang": dict(launch, ranks=1, stop_file=str(tmp_path / "stop"), hold_timeout=1)})
    assert rc == 1 and out["health"] == "joined" and out["held"] == "timeout", out
    assert out["msg"].startswith("vLLM canary (manual) verdict fail: no stop file within hold_timeout (1 s)"), out["msg"]
    assert out["stop"]["leftover_pids"] == []
    rc, out = run(capsys, {"executable": fake_vllm, "model": "/m", "gang": {"args": ["--headless"], "serves_api": False, "ranks": 1}})
    assert rc == 1 and out["msg"].startswith("gang.stop_file: a member that serves no API needs"), out["msg"]
