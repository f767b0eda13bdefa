# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vllm_boot_check module shell.

systemctl/journalctl are small scripts on PATH and the engine is the
unit-test double of `vllm serve` from test_vllm_engine (not an engine).
"""
from __future__ import annotations

import hashlib
import json
import os
import textwrap
from typing import Any

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _engine_process
from ansible_collections.gpufleet.vllm.plugins.module_utils._gate import _boot_gate
from ansible_collections.gpufleet.vllm.plugins.modules import vllm_boot_check
from ansible_collections.gpufleet.vllm.tests.unit.plugins.module_utils.test_vllm_engine import write_fake_vllm

UNIT = "[Service]\nExecStart=/opt/vllm/venv/bin/vllm serve m\n"


@pytest.fixture
def fake_vllm(tmp_path) -> str:
    """`vllm` running the unit-test double (not an engine)."""
    return write_fake_vllm(tmp_path)


def run(capsys, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        vllm_boot_check.main()
    return exc.value.code or 0, json.loads(capsys.readouterr().out)


@pytest.fixture
def engine(tmp_path, fake_vllm):
    port = _engine_process.free_port()
    proc = _engine_process.EngineProcess([fake_vllm, "serve", "m", "--port", str(port), "--kv-cache-memory-bytes", "100000000"],
                                         dict(os.environ, FAKE_ENGINE="serving"), str(tmp_path / "engine.log"))
    proc.start()
    health = _engine_process.wait_healthy("127.0.0.1", port, timeout=20, is_alive=proc.alive, interval=0.05)
    assert health.status == "healthy"
    yield proc, port
    proc.stop(3)


@pytest.fixture
def systemd_bin(tmp_path, monkeypatch):
    """systemctl/journalctl stand-ins on PATH; journalctl prints $FAKE_JOURNAL and logs its argv."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "systemctl").write_text(textwrap.dedent("""\
        #!/bin/sh
        case "$*" in *"-p InvocationID"*) echo "${FAKE_INVOCATION:-}"; exit 0;; esac
        printf 'LoadState=loaded\\nActiveState=%s\\nSubState=%s\\nResult=success\\nNRestarts=0\\n' \\
            "${FAKE_ACTIVE:-active}" "${FAKE_SUB:-running}"
        printf 'ExecMainStartTimestamp=@1764450249\\nInvocationID=%s\\n' "${FAKE_INVOCATION:-}"
        """))
    (bindir / "journalctl").write_text('#!/bin/sh\necho "$@" > "$FAKE_JOURNAL.args"\ncat "$FAKE_JOURNAL"\n')
    for name in ("systemctl", "journalctl"):
        (bindir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return bindir


def test_check_mode_lists_checks_and_contacts_nothing(capsys):
    rc, out = run(capsys, {"_ansible_check_mode": True, "unit": "vllm-main.service", "port": 1,
                           "expected_kv_cache_memory_bytes": "1GiB", "free_floor_bytes": {"0": "40GiB", "1": 1},
                           "min_tokens": 4096})
    assert rc == 0 and out["changed"] is False
    names = [c["check"] for c in out["checks"]]
    assert names == ["health", "engine_error", "reserved_kv_bytes", "metrics_kv_cache_memory_bytes", "free_floor",
                     "min_tokens"]
    assert out["checks"][2]["expected"] == 1 << 30
    assert out["checks"][4]["floor"] == {"0": 40 << 30, "1": 1}


def test_journal_boot_check_passes(capsys, engine, systemd_bin, tmp_path, monkeypatch):
    proc, port = engine
    journal = tmp_path / "journal.txt"
    journal.write_text(proc.read_log())
    monkeypatch.setenv("FAKE_JOURNAL", str(journal))
    rc, out = run(capsys, {"unit": "vllm-main.service", "port": port, "expected_kv_cache_memory_bytes": 100000000,
                           "min_tokens": 195000, "timeout": 10})
    assert rc == 0, out.get("msg")
    assert out["ok"] is True and out["changed"] is False
    assert out["kv_cache_tokens"] == (100_000_000 // 65536) * 128
    assert (tmp_path / "journal.txt.args").read_text().split() == [
        "-u", "vllm-main.service", "-o", "cat", "--no-pager", "--since", "@1764450249"]


def test_journal_boot_check_names_rank_and_figures(capsys, engine, systemd_bin, tmp_path, monkeypatch):
    proc, port = engine
    journal = tmp_path / "journal.txt"
    journal.write_text(proc.read_log())
    monkeypatch.setenv("FAKE_JOURNAL", str(journal))
    rc, out = run(capsys, {"unit": "vllm-main.service", "url": f"http://127.0.0.1:{port}",
                           "expected_kv_cache_memory_bytes": "0.5GiB", "free_floor_bytes": "1GiB", "timeout": 10})
    assert rc == 1 and out["failed"] is True
    assert out["msg"].startswith("vLLM boot check of vllm-main.service failed: rank 0: reserved")
    assert "expected 536870912" in out["msg"]
    # The simulated engine speaks the CPU build's wording, which logs no initial free memory: the
    # floor is reported as not applicable, neither a reason to fail nor a pass.
    assert "floor" not in out["msg"]
    assert [w.startswith("rank 0: free-memory floor of 1073741824 bytes not applicable: ") for w in out["not_applicable"]] == [True]


def test_an_engine_bound_to_one_address_is_asked_there(capsys, fake_vllm, systemd_bin, tmp_path, monkeypatch):
    """A unit that listens on one address (vllm_service_listen_host) answers there only: the boot
    check asks that address, and a wildcard address is asked on the loopback address."""
    port = _engine_process.free_port()
    proc = _engine_process.EngineProcess([fake_vllm, "serve", "m", "--host", "127.0.0.2", "--port", str(port),
                                          "--kv-cache-memory-bytes", "100000000"],
                                         dict(os.environ, FAKE_ENGINE="serving"), str(tmp_path / "engine.log"))
    proc.start()
    try:
        assert _engine_process.wait_healthy("127.0.0.2", port, timeout=20, is_alive=proc.alive, interval=0.05).status == "healthy"
        journal = tmp_path / "journal.txt"
        journal.write_text(proc.read_log())
        monkeypatch.setenv("FAKE_JOURNAL", str(journal))
        args = {"unit": "vllm-main.service", "port": port, "expected_kv_cache_memory_bytes": 100000000, "timeout": 10}
        rc, out = run(capsys, dict(args, host="127.0.0.2"))
        assert rc == 0, out.get("msg")
        assert out["ok"] is True
        rc, out = run(capsys, dict(args, host="0.0.0.0", timeout=2))
        # a wildcard address is asked on 127.0.0.1, where nothing answers
        assert rc == 1 and "/health unreachable: [Errno 111] Connection refused" in out["msg"], out["msg"]
    finally:
        proc.stop(3)
    for host, url in (("fd00::13", "http://[fd00::13]:8001/health"), ("0.0.0.0", "http://127.0.0.1:8001/health"),
                      ("::", "http://127.0.0.1:8001/health")):
        rc, out = run(capsys, {"_ansible_check_mode": True, "unit": "vllm-main.service", "host": host, "port": 8001})
        assert rc == 0 and out["checks"][0]["url"] == url, (host, out["checks"][0])


def test_failed_unit_fails_fast(capsys, systemd_bin, tmp_path, monkeypatch):
    journal = tmp_path / "journal.txt"
    journal.write_text("(EngineCore pid=3) ERROR 11-29 21:16:27 [core.py:1510] ValueError: To serve at least one "
                       "request with the model's max seq len (256), (0.0 GiB KV cache is needed, which is larger "
                       "than the available KV cache memory (0.0 GiB). Try increasing\n")
    monkeypatch.setenv("FAKE_JOURNAL", str(journal))
    monkeypatch.setenv("FAKE_ACTIVE", "failed")
    monkeypatch.setenv("FAKE_SUB", "failed")
    rc, out = run(capsys, {"unit": "vllm-main.service", "port": _engine_process.free_port(), "timeout": 600})
    assert rc == 1 and out["health"] == "failed_state"
    assert "unit vllm-main.service is failed (failed)" in out["msg"]
    assert "To serve at least one request with the model's max seq len (256)" in out["msg"]


@pytest.mark.parametrize("args, message", [
    ({"journal": True}, "journal is True but all of the following are missing: unit"),
    ({"journal": False}, "journal is False but all of the following are missing: log_path"),
    ({"unit": "u", "url": "https://h:1"}, "only http://host[:port] is supported"),
    ({"unit": "u", "host": "10.0.0.1 x"}, "host: expected an address or a host name, got '10.0.0.1 x'"),
    ({"unit": "u", "free_floor_bytes": {"zero": 1}}, "free_floor_bytes: rank 'zero' is not an integer"),
    ({"unit": "u", "expected_kv_cache_memory_bytes": "1.5XB"}, "expected_kv_cache_memory_bytes: invalid size"),
])
def test_bad_arguments(capsys, args, message):
    rc, out = run(capsys, args)
    assert rc == 1 and message in out["msg"]


def test_a_passing_boot_records_its_plan_once_with_the_unit_checksum(capsys, engine, systemd_bin, tmp_path, monkeypatch):
    proc, port = engine
    journal = tmp_path / "journal.txt"
    journal.write_text(proc.read_log())
    monkeypatch.setenv("FAKE_JOURNAL", str(journal))
    units, state = tmp_path / "systemd", tmp_path / "gpufleet"
    units.mkdir()
    (state / "units").mkdir(parents=True)
    (units / "vllm-main.service").write_text(UNIT)
    (state / "units" / "vllm-main.service.changing").write_text("")  # the snapshot opened a change
    args = {"unit": "vllm-main.service", "port": port, "expected_kv_cache_memory_bytes": 100000000, "timeout": 10,
            "record": {"name": "main", "plan": {"format": 3, "instance": "main"}, "unit_dir": str(units), "state_dir": str(state)}}
    rc, out = run(capsys, args)
    assert rc == 0, out.get("msg")
    assert out["changed"] is True and out["recorded"]["name"] == "main"
    plan = json.loads((state / "main.plan.json").read_text())
    assert plan == {"format": 3, "instance": "main", "unit_checksum": out["recorded"]["unit_checksum"]}
    assert out["recorded"]["unit_checksum"] == hashlib.sha1(UNIT.encode()).hexdigest()
    assert not (state / "units" / "vllm-main.service.changing").exists(), "the change is closed"
    rc, again = run(capsys, args)
    assert rc == 0 and again["changed"] is False, "the same plan and unit: nothing to write"


def test_a_failed_boot_records_nothing_and_leaves_the_change_open(capsys, engine, systemd_bin, tmp_path, monkeypatch):
    proc, port = engine
    journal = tmp_path / "journal.txt"
    journal.write_text(proc.read_log())
    monkeypatch.setenv("FAKE_JOURNAL", str(journal))
    (tmp_path / "systemd").mkdir()
    (tmp_path / "systemd" / "vllm-main.service").write_text("[Service]\n")
    (tmp_path / "gpufleet" / "units").mkdir(parents=True)
    (tmp_path / "gpufleet" / "units" / "vllm-main.service.changing").write_text("")
    rc, out = run(capsys, {"unit": "vllm-main.service", "port": port, "expected_kv_cache_memory_bytes": "0.5GiB", "timeout": 10,
                           "record": {"name": "main", "plan": {"format": 3}, "unit_dir": str(tmp_path / "systemd"),
                                      "state_dir": str(tmp_path / "gpufleet")}})
    assert rc == 1 and "recorded" not in out
    assert not (tmp_path / "gpufleet" / "main.plan.json").exists()
    assert (tmp_path / "gpufleet" / "units" / "vllm-main.service.changing").exists()


@pytest.mark.parametrize("record, message", [
    ({"name": "other", "plan": {}}, "record.name: instance 'other' runs vllm-other.service, not the checked unit vllm-main.service"),
    ({"name": "main"}, "missing required arguments: plan found in record"),
])
def test_a_record_for_another_instance_is_refused_by_name(capsys, record, message):
    rc, out = run(capsys, {"_ansible_check_mode": True, "unit": "vllm-main.service", "record": record})
    assert rc == 1 and message in out["msg"], out


@pytest.mark.parametrize("fail_degraded", [False, True])
def test_a_start_the_boot_gate_shrank_fails_only_with_fail_degraded(capsys, engine, systemd_bin, tmp_path, monkeypatch, fail_degraded):
    proc, port = engine
    journal = tmp_path / "journal.txt"
    journal.write_text(proc.read_log())
    monkeypatch.setenv("FAKE_JOURNAL", str(journal))
    monkeypatch.setenv("FAKE_INVOCATION", "0123abcd")
    (tmp_path / "systemd").mkdir()
    (tmp_path / "systemd" / "vllm-main.service").write_text(UNIT)
    (tmp_path / "gpufleet" / "units").mkdir(parents=True)
    (tmp_path / "gpufleet" / "units" / "vllm-main.service.changing").write_text("")
    # the gate's record of this start: shrunk from the plan's 0.2 GB to the 100 MB the engine runs
    state = tmp_path / "main.boot-gate.json"
    state.write_text(json.dumps({
        "format": _boot_gate.STATE_FORMAT, "invocation_id": "0123abcd", "action": "shrink", "policy": "shrink",
        "message": "boot gate (shrink) starts degraded: 200000000 -> 100000000 B", "started": {"kv_cache_memory_bytes": 100000000},
        "degraded": {"kv_cache_memory_bytes_before": 200000000, "kv_cache_memory_bytes_after": 100000000}}))
    rc, out = run(capsys, {"unit": "vllm-main.service", "port": port, "expected_kv_cache_memory_bytes": 200000000, "timeout": 10,
                           "boot_gate_state": str(state), "fail_degraded": fail_degraded,
                           "record": {"name": "main", "plan": {"format": 3}, "unit_dir": str(tmp_path / "systemd"),
                                      "state_dir": str(tmp_path / "gpufleet")}})
    # the boot itself passed against what the gate started; a degraded start records nothing either way
    assert out["ok"] is True and out["degraded"]["kv_cache_memory_bytes_after"] == 100000000
    assert "recorded" not in out and not (tmp_path / "gpufleet" / "main.plan.json").exists()
    assert (tmp_path / "gpufleet" / "units" / "vllm-main.service.changing").exists()
    if fail_degraded:
        assert rc == 1 and out["msg"] == ("vllm-main.service: the boot gate started it degraded instead of the plan: "
                                          "boot gate (shrink) starts degraded: 200000000 -> 100000000 B")
    else:
        assert rc == 0 and out["changed"] is False


def test_fail_degraded_needs_the_boot_gate_state(capsys):
    rc, out = run(capsys, {"_ansible_check_mode": True, "unit": "vllm-main.service", "fail_degraded": True})
    assert rc == 1 and "fail_degraded is True but all of the following are missing: boot_gate_state" in out["msg"], out
