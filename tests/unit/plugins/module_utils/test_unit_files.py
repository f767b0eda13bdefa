# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""_unit_files: status, snapshot, write, record and restore of the files of vLLM instances.

A rollback restores exactly what was on disk before the instances were stopped: the
unit (even when it did not change, e.g. the service had failed), the plan file and the
secret environment file, and the running state; it removes only the files that did not
exist then (stopping and disabling such a unit), and leaves alone files a snapshot
knows nothing about. systemctl is a recorded fake here; the role runs it for real on
systemd hosts (molecule scenario vllm_service, tests/integration/test_rollout.py).
"""

from __future__ import annotations

import json
import os
import stat

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import plan_checksum
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._unit_files import (
    Layout,
    UnitFilesError,
    adopted_status,
    adoption_reasons,
    atomic_write,
    canary_hold_path,
    kept_file,
    load_snapshot,
    parse_show,
    record,
    restart_services,
    restore,
    restore_adopted,
    runtime_to_restore,
    service_input_problems,
    sha1,
    snapshot,
    snapshot_adopted,
    status,
    stop_services,
    validate_adopted,
    validate_name,
    write,
)

UNIT_A = "[Service]\nExecStart=/opt/vllm/venv/bin/vllm serve m --kv-cache-memory-bytes 1000\n"
UNIT_B = "[Service]\nExecStart=/opt/vllm/venv/bin/vllm serve m --kv-cache-memory-bytes 2000\n"
ENV_A = 'HF_TOKEN="hf_old_secret"\n'
ENV_B = 'HF_TOKEN="hf_new_secret"\n'


class FakeSystemd:
    """ActiveState/NeedDaemonReload per unit, and a log of systemctl calls."""

    def __init__(self) -> None:
        self.active: dict[str, str] = {}
        self.reload: dict[str, str] = {}
        self.calls: list[list[str]] = []

    def show(self, units: list[str]) -> dict[str, dict[str, str]]:
        self.calls.append(["show", *units])
        return {u: {"LoadState": "loaded", "ActiveState": self.active.get(u, "inactive"),
                    "NeedDaemonReload": self.reload.get(u, "no")} for u in units}

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        self.calls.append(argv[1:])
        return 0, "", ""


@pytest.fixture()
def layout(tmp_path) -> Layout:
    (tmp_path / "systemd").mkdir()
    return Layout(unit_dir=str(tmp_path / "systemd"), state_dir=str(tmp_path / "gpufleet"),
                  uid=os.getuid(), gid=os.getgid(), plan_gid=os.getgid())


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def put(path: str, text: str, file_mode: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, text.encode(), os.getuid(), os.getgid(), file_mode)


def parse_plan_checksum(text: str | None) -> str:
    """The checksum of a plan file's text, as the boot gate computes it."""
    return plan_checksum(json.loads(text or "{}"))


def kept(layout: Layout, name: str, kind: str) -> str | None:
    data = kept_file(layout, name, kind)
    return None if data is None else data.decode()


def deployed(layout: Layout, systemd: FakeSystemd, name: str = "a", unit: str = UNIT_A, env: str = ENV_A) -> None:
    """An instance as a successful deploy leaves it: files written, plan recorded, service active."""
    plan = {"instance": name, "kv_cache_memory_bytes": 1000}
    write(layout, [{"name": name, "unit": unit, "env": env, "plan": plan}], check=False)  # the drop-in with the plan
    record(layout, [{"name": name, "plan": plan}], check=False)
    systemd.active[layout.unit_name(name)] = "active"


# ------------------------------------------------------------------ status
def test_first_deploy_is_pending_for_every_reason(layout):
    systemd = FakeSystemd()
    (entry,) = status(layout, [{"name": "a", "unit": UNIT_A, "env": ENV_A}], systemd.show)
    assert entry["pending"]
    assert entry["reasons"] == ["unit differs from the plan", "environment file differs", "service is inactive",
                                "the unit on disk has not passed a boot check"]
    assert entry["unit_checksum"] == sha1(UNIT_A.encode())
    assert systemd.calls == [["show", "vllm-a.service"]], "one systemctl call for all instances"


def test_deployed_instance_is_not_pending_and_each_difference_is_named(layout):
    systemd = FakeSystemd()
    deployed(layout, systemd)
    want = [{"name": "a", "unit": UNIT_A, "env": ENV_A}]
    assert status(layout, want, systemd.show)[0]["pending"] is False

    assert status(layout, [{"name": "a", "unit": UNIT_B, "env": ENV_A}], systemd.show)[0]["reasons"] == [
        "unit differs from the plan"]
    assert status(layout, [{"name": "a", "unit": UNIT_A, "env": ENV_B}], systemd.show)[0]["reasons"] == [
        "environment file differs"]
    os.chmod(layout.path("a", "env"), 0o644)  # a secret file readable by all is a difference too
    assert status(layout, want, systemd.show)[0]["reasons"] == ["environment file differs"]
    os.chmod(layout.path("a", "env"), 0o600)
    systemd.reload["vllm-a.service"] = "yes"
    assert status(layout, want, systemd.show)[0]["reasons"] == ["systemd has not loaded the unit on disk"]
    systemd.reload.clear()
    systemd.active["vllm-a.service"] = "failed"
    assert status(layout, want, systemd.show)[0]["reasons"] == ["service is failed"]


def test_a_unit_changed_by_hand_has_not_passed_a_boot_check(layout):
    systemd = FakeSystemd()
    deployed(layout, systemd)
    put(layout.path("a", "unit"), UNIT_B, 0o644)
    reasons = status(layout, [{"name": "a", "unit": UNIT_B, "env": ENV_A}], systemd.show)[0]["reasons"]
    assert reasons == ["the unit on disk has not passed a boot check"]


def test_diff_shows_the_unit_and_never_the_secret(layout):
    systemd = FakeSystemd()
    deployed(layout, systemd)
    entries = status(layout, [{"name": "a", "unit": UNIT_B, "env": ENV_B}], systemd.show, want_diff=True)
    assert entries[0]["diff"]["before"] == UNIT_A and entries[0]["diff"]["after"] == UNIT_B
    assert "hf_" not in json.dumps(entries)
    written = write(layout, [{"name": "a", "unit": UNIT_B, "env": ENV_B}], check=False, want_diff=True)
    assert written[0]["written"] == ["env", "unit"]
    assert written[0]["diff"]["before"] == UNIT_A
    assert "hf_" not in json.dumps(written)


def test_a_new_compatibility_key_under_an_unchanged_unit_restarts_the_instance(layout):
    """New weights under the same model path: same unit, new key; the running engine holds the old weights."""
    systemd = FakeSystemd()
    write(layout, [{"name": "a", "unit": UNIT_A, "env": ENV_A}], check=False)
    record(layout, [{"name": "a", "plan": {"compat_key_hash": "a" * 64}}], check=False)
    systemd.active["vllm-a.service"] = "active"
    same = [{"name": "a", "unit": UNIT_A, "env": ENV_A, "plan": {"compat_key_hash": "a" * 64}}]
    assert status(layout, same, systemd.show)[0]["pending"] is False
    moved = [{"name": "a", "unit": UNIT_A, "env": ENV_A, "plan": {"compat_key_hash": "b" * 64}}]
    (entry,) = status(layout, moved, systemd.show)
    assert entry["pending"] and entry["reasons"] == [
        f"the compatibility key changed since its boot check (compat_key_hash {'a' * 12} -> {'b' * 12})"]
    # a plan without a key (the role on its own) or a record without one restarts nothing
    assert not status(layout, [dict(moved[0], plan={})], systemd.show)[0]["pending"]
    record(layout, [{"name": "a", "plan": {}}], check=False)
    assert not status(layout, moved, systemd.show)[0]["pending"]


# ------------------------------------------------------------------ write and record
def test_write_is_idempotent_and_sets_owner_and_mode(layout):
    first = write(layout, [{"name": "a", "unit": UNIT_A, "env": ENV_A}], check=False)
    assert first[0]["changed"] and first[0]["written"] == ["env", "unit"]
    assert mode(layout.path("a", "unit")) == 0o644 and mode(layout.path("a", "env")) == 0o600
    assert mode(layout.state_dir) == 0o750
    again = write(layout, [{"name": "a", "unit": UNIT_A, "env": ENV_A}], check=False)
    assert not again[0]["changed"] and again[0]["written"] == []
    assert not [p for p in os.listdir(layout.state_dir) if p.startswith(".")], "no temporary file left"


def test_check_mode_writes_nothing(layout):
    result = write(layout, [{"name": "a", "unit": UNIT_A, "env": ENV_A}], check=True)
    assert result[0]["changed"]
    assert not os.path.exists(layout.state_dir) and read(layout.path("a", "unit")) is None
    assert snapshot(layout, ["a"], FakeSystemd().show, check=True)[0]["changed"]
    assert not os.path.exists(layout.kept_dir)


def test_record_names_the_unit_on_disk(layout):
    write(layout, [{"name": "a", "unit": UNIT_A}], check=False)
    (entry,) = record(layout, [{"name": "a", "plan": {"kv_cache_memory_bytes": 1000, "unit_checksum": "stale"}}],
                      check=False)
    doc = json.loads(read(layout.path("a", "plan")))
    assert doc == {"kv_cache_memory_bytes": 1000, "unit_checksum": sha1(UNIT_A.encode())}
    assert entry["changed"] and mode(layout.path("a", "plan")) == 0o640
    assert not record(layout, [{"name": "a", "plan": {"kv_cache_memory_bytes": 1000}}], check=False)[0]["changed"]
    with pytest.raises(UnitFilesError, match="no unit at .*vllm-b.service"):
        record(layout, [{"name": "b", "plan": {}}], check=False)


def test_write_puts_the_plan_file_before_the_boot_check_without_a_unit_checksum(layout):
    plan = {"compat_key_hash": "k", "kv_cache_memory_bytes": 1000, "unit_checksum": "from an older record"}
    (entry,) = write(layout, [{"name": "a", "unit": UNIT_A, "plan": plan}], check=False)
    assert entry["written"] == ["unit", "plan", "dropin"]
    assert json.loads(read(layout.path("a", "plan"))) == {"compat_key_hash": "k", "kv_cache_memory_bytes": 1000}
    assert mode(layout.path("a", "plan")) == 0o640
    # beside the unit, root's: the checksum systemd hands the boot gate (as the gate reads the plan file)
    checksum = parse_plan_checksum(read(layout.path("a", "plan")))
    assert read(layout.path("a", "dropin")).endswith(f"[Service]\nEnvironment=GPUFLEET_PLAN_SHA256={checksum}\n")
    assert mode(layout.path("a", "dropin")) == 0o644 and layout.path("a", "dropin").endswith("/vllm-a.service.d/gpufleet-plan.conf")
    # not recorded yet: the instance is pending until its boot check passes and record() names the unit
    assert "the unit on disk has not passed a boot check" in status(
        layout, [{"name": "a", "unit": UNIT_A, "plan": plan}], FakeSystemd().show)[0]["reasons"]
    assert write(layout, [{"name": "a", "unit": UNIT_A, "plan": plan}], check=False)[0]["written"] == []
    with pytest.raises(UnitFilesError, match="instance b: plan must be a mapping"):
        write(layout, [{"name": "b", "unit": UNIT_A, "plan": "not a mapping"}], check=False)
    assert read(layout.path("b", "unit")) is None, "nothing written when an input is wrong"
    # the boot check's record adds the unit's checksum: the plan file's checksum stays the drop-in's
    record(layout, [{"name": "a", "plan": plan}], check=False)
    assert parse_plan_checksum(read(layout.path("a", "plan"))) == checksum


# ------------------------------------------------------------------ snapshot and restore
def test_failed_service_with_an_unchanged_unit_keeps_its_unit_and_gets_its_env_back(layout):
    systemd = FakeSystemd()
    deployed(layout, systemd)
    plan_before = read(layout.path("a", "plan"))
    # A stale copy from an older release's snapshot must not come back.
    put(layout.kept("a", "unit") + ".previous", "[Service]\nExecStart=/old\n", 0o600)
    systemd.active["vllm-a.service"] = "failed"

    (taken,) = snapshot(layout, ["a"], systemd.show, check=False)
    assert taken["kept"] == ["unit", "plan", "env", "dropin"] and taken["absent"] == [] and taken["active_state"] == "failed"
    assert kept(layout, "a", "unit") == UNIT_A
    assert kept(layout, "a", "env") == ENV_A
    assert not os.path.exists(layout.kept("a", "unit") + ".previous"), "the document replaces an older release's files"
    assert mode(os.path.join(layout.kept_dir, "vllm-a.snapshot.json")) == 0o600 and mode(layout.kept_dir) == 0o700

    # The run changes the environment file, rewrites the same unit, then the boot fails.
    write(layout, [{"name": "a", "unit": UNIT_A, "env": ENV_B}], check=False)
    (back,) = restore(layout, ["a"], systemd.run, check=False)
    assert back["restored"] == ["env"], "the unit is the same; only the environment file comes back"
    assert read(layout.path("a", "unit")) == UNIT_A and read(layout.path("a", "env")) == ENV_A
    assert read(layout.path("a", "plan")) == plan_before
    assert mode(layout.path("a", "env")) == 0o600 and mode(layout.path("a", "unit")) == 0o644
    # it was not running before the change: stopped, not restarted
    assert back["restart"] is False and back["stop"] is True


def test_a_running_service_is_restarted_after_restore(layout):
    systemd = FakeSystemd()
    deployed(layout, systemd)
    snapshot(layout, ["a"], systemd.show, check=False)
    write(layout, [{"name": "a", "unit": UNIT_B, "env": ENV_B}], check=False)
    (back,) = restore(layout, ["a"], systemd.run, check=False)
    assert sorted(back["restored"]) == ["env", "unit"]
    assert back["restart"] is True and back["stop"] is False
    assert read(layout.path("a", "unit")) == UNIT_A
    assert not [c for c in systemd.calls if c[0] != "show"], "restarting is left to the role"
    # restoring again changes nothing
    assert restore(layout, ["a"], systemd.run, check=False)[0]["changed"] is False


def test_the_snapshot_stops_what_runs_in_one_call_and_the_units_it_takes_over_in_another(layout, tmp_path):
    systemd = FakeSystemd()
    deployed(layout, systemd, "a")
    deployed(layout, systemd, "b")
    systemd.active[layout.unit_name("b")] = "inactive"
    systemd.active[layout.unit_name("c")] = "failed"
    legacy = FakeLegacy(tmp_path)
    kept = snapshot(layout, ["a", "b", "c"], systemd.show, check=False)
    adopted = snapshot_adopted(layout, ["vllm.service"], legacy.show, check=False)
    assert [k["active_state"] for k in kept] == ["active", "inactive", "failed"], "the snapshot keeps what ran before the stop"
    stopped = stop_services(layout, ["a", "b", "c"], adopted, systemd.show, systemd.run, check=False)
    assert stopped == ["vllm-a.service", "vllm-c.service", "vllm.service"]
    assert [c for c in systemd.calls if c[0] != "show"] == [["stop", "vllm-a.service", "vllm-c.service"],
                                                            ["disable", "--now", "vllm.service"]]


def test_stopping_in_check_mode_or_with_nothing_running_calls_no_systemctl(layout):
    systemd = FakeSystemd()
    deployed(layout, systemd, "a")
    assert stop_services(layout, ["a"], [], systemd.show, systemd.run, check=True) == ["vllm-a.service"]
    systemd.active[layout.unit_name("a")] = "inactive"
    assert stop_services(layout, ["a"], [{"unit": "vllm.service", "holds": False}], systemd.show, systemd.run, check=False) == []
    assert not [c for c in systemd.calls if c[0] != "show"]


def test_a_failing_stop_names_the_units_and_the_error(layout):
    systemd = FakeSystemd()
    deployed(layout, systemd, "a")
    with pytest.raises(UnitFilesError, match=r"systemctl stop vllm-a.service failed \(rc 1\): access denied"):
        stop_services(layout, ["a"], [], systemd.show, lambda argv: (1, "", "access denied\n"), check=False,
                      systemctl_bin="systemctl")


def test_written_units_are_reloaded_enabled_and_restarted_together(layout):
    systemd = FakeSystemd()
    assert restart_services(layout, ["a", "b"], systemd.run, check=False) == ["vllm-a.service", "vllm-b.service"]
    assert systemd.calls == [["daemon-reload"], ["enable", "--no-reload", "vllm-a.service", "vllm-b.service"],
                             ["restart", "vllm-a.service", "vllm-b.service"]]
    assert restart_services(layout, ["a"], systemd.run, check=True) == ["vllm-a.service"]
    assert len(systemd.calls) == 3, "check mode restarts nothing"


def test_new_instance_is_stopped_disabled_and_removed_and_an_unknown_one_left_alone(layout):
    systemd = FakeSystemd()
    # b is new in this run; c has a unit but no snapshot (it was not part of the change).
    put(layout.path("c", "unit"), UNIT_A, 0o644)
    (taken,) = snapshot(layout, ["b"], systemd.show, check=False)
    assert taken["absent"] == ["unit", "plan", "env", "dropin"]
    assert sorted(os.listdir(layout.kept_dir)) == ["vllm-b.snapshot.json"]
    doc = load_snapshot(layout, "b")
    assert doc["files"] == {"unit": None, "plan": None, "env": None, "dropin": None} and doc["open"] and not doc["serving"]

    deployed(layout, systemd, name="b")
    back = restore(layout, ["b", "c"], systemd.run, check=False)
    assert back[0]["removed"] == ["unit", "plan", "env", "dropin"] and back[0]["stopped"] is True
    assert ["disable", "--now", "vllm-b.service"] in systemd.calls
    assert back[0]["restart"] is False and back[0]["stop"] is False
    for kind in ("unit", "plan", "env", "dropin"):
        assert read(layout.path("b", kind)) is None
    assert back[1]["unknown"] == ["unit", "plan", "env", "dropin"] and not back[1]["changed"]
    assert read(layout.path("c", "unit")) == UNIT_A, "no snapshot of c: its unit stays"


def test_a_later_snapshot_replaces_absent_markers(layout):
    systemd = FakeSystemd()
    snapshot(layout, ["a"], systemd.show, check=False)
    assert load_snapshot(layout, "a")["files"]["unit"] is None
    # The first deploy succeeded (its plan recorded); the next change snapshots the files that now exist.
    deployed(layout, systemd)
    snapshot(layout, ["a"], systemd.show, check=False)
    for kind in ("unit", "plan", "env"):
        assert kept_file(layout, "a", kind) is not None, kind
    assert load_snapshot(layout, "a")["serving"] is True

    plan_before = read(layout.path("a", "plan"))
    write(layout, [{"name": "a", "unit": UNIT_B}], check=False)
    (back,) = restore(layout, ["a"], systemd.run, check=False)
    assert read(layout.path("a", "unit")) == UNIT_A and read(layout.path("a", "env")) == ENV_A
    assert read(layout.path("a", "plan")) == plan_before and back["restored"] == ["unit"]
    assert back["restart"] is True


def test_restore_in_check_mode_changes_nothing(layout):
    systemd = FakeSystemd()
    deployed(layout, systemd)
    snapshot(layout, ["a"], systemd.show, check=False)
    write(layout, [{"name": "a", "unit": UNIT_B}], check=False)
    (back,) = restore(layout, ["a"], systemd.run, check=True)
    assert back["restored"] == ["unit"] and back["changed"]
    assert read(layout.path("a", "unit")) == UNIT_B


def test_an_interrupted_change_keeps_its_snapshot_until_it_completes(layout):
    """A run killed after writing the new unit: the next run must not keep the half-applied unit as 'previous'."""
    systemd = FakeSystemd()
    deployed(layout, systemd)
    want = [{"name": "a", "unit": UNIT_B, "env": ENV_A}]
    assert snapshot(layout, ["a"], systemd.show, check=False)[0]["resumed"] is False
    # the interrupted run stopped the service and wrote the new unit, then the controller died
    systemd.active["vllm-a.service"] = "inactive"
    write(layout, want, check=False)

    entry = status(layout, want, systemd.show)[0]
    assert "an earlier change was interrupted" in entry["reasons"]
    again = snapshot(layout, ["a"], systemd.show, check=False)[0]
    assert again["resumed"] is True and again["active_state"] == "active" and again["kept"] == ["unit", "plan", "env", "dropin"]
    assert kept(layout, "a", "unit") == UNIT_A, "the unit from before the interrupted run"

    # the resumed run passes its boot check: the change is complete, the next snapshot is a fresh one
    record(layout, [{"name": "a", "plan": {"kv_cache_memory_bytes": 2000}}], check=False)
    systemd.active["vllm-a.service"] = "active"
    assert status(layout, want, systemd.show)[0]["pending"] is False
    assert snapshot(layout, ["a"], systemd.show, check=False)[0]["resumed"] is False
    assert kept(layout, "a", "unit") == UNIT_B


def test_a_rollback_closes_the_change_once_its_units_run_again(layout):
    systemd = FakeSystemd()
    deployed(layout, systemd)
    snapshot(layout, ["a"], systemd.show, check=False)
    write(layout, [{"name": "a", "unit": UNIT_B}], check=False)
    systemd.active["vllm-a.service"] = "failed"
    # files back, the restart not done yet (a rollback cut off here): the change stays open
    assert restore(layout, ["a"], systemd.run, check=False, close=False)[0]["restart"] is True
    assert load_snapshot(layout, "a")["open"]
    assert snapshot(layout, ["a"], systemd.show, check=False)[0]["resumed"] is True, "still what ran before the change"
    assert load_snapshot(layout, "a")["serving"], "the service ran before the change"
    systemd.active["vllm-a.service"] = "active"
    (closed,) = restore(layout, ["a"], systemd.run, check=False, close=True)
    assert closed["changed"] and closed["restored"] == []
    assert not load_snapshot(layout, "a")["open"]
    assert status(layout, [{"name": "a", "unit": UNIT_A, "env": ENV_A}], systemd.show)[0]["pending"] is False


# ------------------------------------------------------------------ inputs
@pytest.mark.parametrize("name", ["", "..", "a/b", "../etc/x", "a b", 3])
def test_bad_instance_names_are_refused(name):
    with pytest.raises(UnitFilesError, match="instance name"):
        validate_name(name)


def test_systemctl_show_blocks_follow_the_units():
    out = "LoadState=loaded\nActiveState=active\nNeedDaemonReload=no\n\nLoadState=not-found\nActiveState=inactive\n"
    parsed = parse_show(out, ["vllm-a.service", "vllm-b.service"])
    assert parsed["vllm-a.service"]["ActiveState"] == "active"
    assert parsed["vllm-b.service"]["LoadState"] == "not-found"
    with pytest.raises(UnitFilesError, match="expected 3 blocks"):
        parse_show(out, ["a", "b", "c"])


def test_unwritable_directory_is_a_clear_error(layout, tmp_path):
    target = tmp_path / "missing" / "vllm-a.service"
    with pytest.raises(UnitFilesError, match="cannot write"):
        atomic_write(str(target), b"x", os.getuid(), os.getgid(), 0o644)


# ------------------------------------------------------------------ units taken over
HAND_UNIT = "[Unit]\nDescription=hand-written vLLM\n[Service]\nExecStart=/usr/local/bin/vllm serve m --port 8000\n"
HAND_DROP_IN = "[Service]\nEnvironment=HF_HOME=/data/hf\n"


class FakeLegacy:
    """systemctl show of a hand-written unit: running/enabled as set, its file and drop-ins as written."""

    def __init__(self, tmp_path) -> None:
        self.fragment = str(tmp_path / "systemd" / "vllm.service")
        self.drop_in = str(tmp_path / "systemd" / "vllm.service.d" / "10-cache.conf")
        put(self.fragment, HAND_UNIT, 0o644)
        put(self.drop_in, HAND_DROP_IN, 0o640)
        self.active, self.enabled = "active", "enabled"

    def show(self, units: list[str]) -> dict[str, dict[str, str]]:
        return {u: {"LoadState": "loaded", "ActiveState": self.active, "UnitFileState": self.enabled,
                    "FragmentPath": self.fragment, "DropInPaths": self.drop_in} for u in units}


def test_a_running_hand_written_unit_makes_the_instances_pending(layout, tmp_path):
    legacy = FakeLegacy(tmp_path)
    adopted = adopted_status(["vllm.service"], legacy.show)
    assert adoption_reasons(adopted) == ["takes over vllm.service (running and enabled)"]
    legacy.active = "inactive"
    assert adoption_reasons(adopted_status(["vllm.service"], legacy.show)) == ["takes over vllm.service (enabled)"]
    legacy.enabled = "disabled"
    assert adoption_reasons(adopted_status(["vllm.service"], legacy.show)) == [], "taken over: nothing left to do"
    gone = adopted_status(["old.service"], lambda units: {u: {"LoadState": "not-found"} for u in units})
    assert gone[0]["found"] is False and adoption_reasons(gone) == []


def test_taking_over_keeps_the_unit_and_drop_ins_and_rollback_puts_them_back(layout, tmp_path):
    legacy = FakeLegacy(tmp_path)
    snapshot(layout, ["main"], FakeSystemd().show, check=False)
    (kept,) = snapshot_adopted(layout, ["vllm.service"], legacy.show, check=False)
    assert kept["kept"] and kept["changed"] and kept["files"] == sorted([legacy.fragment, legacy.drop_in])
    assert mode(os.path.join(layout.kept_dir, "adopted-vllm.service.json")) == 0o600
    # the change stops and disables it; someone edits the drop-in and removes the unit file meanwhile
    legacy.active, legacy.enabled = "inactive", "disabled"
    put(legacy.drop_in, "[Service]\nEnvironment=HF_HOME=/elsewhere\n", 0o644)
    os.unlink(legacy.fragment)
    (back,) = restore_adopted(layout, ["vllm.service"], check=False)
    assert back["enable"] is True and back["start"] is True
    assert sorted(back["restored"]) == sorted([legacy.fragment, legacy.drop_in])
    assert read(legacy.fragment) == HAND_UNIT and read(legacy.drop_in) == HAND_DROP_IN
    assert mode(legacy.drop_in) == 0o640, "the drop-in's own mode comes back"
    assert restore_adopted(layout, ["vllm.service"], check=False)[0]["restored"] == [], "a second restore changes nothing"


def test_a_later_change_does_not_bring_the_taken_over_unit_back(layout, tmp_path):
    legacy = FakeLegacy(tmp_path)
    snapshot_adopted(layout, ["vllm.service"], legacy.show, check=False)
    legacy.active, legacy.enabled = "inactive", "disabled"
    # an interrupted change keeps what it took over
    (resumed,) = snapshot_adopted(layout, ["vllm.service"], legacy.show, check=False, resumed=True)
    assert resumed["kept"] and resumed["resumed"]
    # the next change (a new budget) is not the one that took it over: restoring it leaves the unit off
    (later,) = snapshot_adopted(layout, ["vllm.service"], legacy.show, check=False)
    assert not later["kept"] and later["changed"]
    assert restore_adopted(layout, ["vllm.service"], check=False) == [
        {"unit": "vllm.service", "restored": [], "enable": False, "start": False, "changed": False}]


def test_snapshot_of_a_unit_to_take_over_in_check_mode_writes_nothing(layout, tmp_path):
    legacy = FakeLegacy(tmp_path)
    (kept,) = snapshot_adopted(layout, ["vllm.service"], legacy.show, check=True)
    assert kept["changed"] and not os.path.exists(os.path.join(layout.kept_dir, "adopted-vllm.service.json"))


@pytest.mark.parametrize(("units", "message"), [
    (["vllm-main.service"], "adopt[0]: vllm-main.service is the unit of one of this host's instances"),
    (["vllm.socket"], "adopt[0]: vllm.socket is not a service unit"),
    (["vllm.service", "vllm.service"], "adopt[1]: vllm.service is named twice"),
    (["vllm service"], "adopt[0]: "),
    ("vllm.service", "adopt: expected a list"),
])
def test_bad_units_to_take_over_are_refused_naming_the_entry(units, message):
    with pytest.raises(UnitFilesError, match="^" + message.replace("[", "\\[").replace("]", "\\]")):
        validate_adopted(units, ["main"], "adopt")


def test_the_role_refuses_a_bad_unit_to_take_over_naming_the_variable():
    inputs = {"vllm_service_instances": [{"name": "main", "gpus": [0], "port": 8000}],
              "vllm_service_adopt_units": ["vllm.service", "vllm-main.service"]}
    problems = [p for p in service_input_problems(inputs) if "adopt" in p]
    assert problems == ["vllm_service_adopt_units[1]: vllm-main.service is the unit of one of this host's instances, "
                        "not one to take over"]


GANG_INSTANCE = {"name": "dsv3", "gpus": [0, 1], "port": 8000, "gang": {"mode": "mp", "members": ["a1", "a2"]}}
GANG_LAUNCH = {"args": ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29501", "--headless"],
               "environment": {"VLLM_HOST_IP": "10.0.0.2"}, "limit_memlock": "infinity", "device_allow": [], "first_rank": 2, "ranks": 2}


@pytest.mark.parametrize(("launch", "expected"), [
    ({}, ["vllm_service_instances[0].gang: an instance that spans hosts needs its member's rank: vllm_service_gang_launch.dsv3 "
          "(docs/multi-host.md)"]),
    ({"dsv3": GANG_LAUNCH}, []),
    ({"dsv3": GANG_LAUNCH, "other": GANG_LAUNCH}, ["vllm_service_gang_launch.other: no instance of this name in vllm_service_instances"]),
    ({"dsv3": dict(GANG_LAUNCH, args=[])}, ["vllm_service_gang_launch.dsv3.args: expected the member's rank arguments, a non-empty list"]),
    ({"dsv3": dict(GANG_LAUNCH, args=["--node-rank", "1\n"])}, ["vllm_service_gang_launch.dsv3.args[1]"]),
    ({"dsv3": dict(GANG_LAUNCH, environment={"BAD NAME": "x"})}, ["vllm_service_gang_launch.dsv3.environment name"]),
    ({"dsv3": dict(GANG_LAUNCH, limit_memlock="lots")}, ["vllm_service_gang_launch.dsv3.limit_memlock"]),
    ({"dsv3": dict(GANG_LAUNCH, device_allow="char-x rw")}, ["vllm_service_gang_launch.dsv3.device_allow: expected a list"]),
    ({"dsv3": dict(GANG_LAUNCH, rank=1)}, ["vllm_service_gang_launch.dsv3: unknown key(s) rank"]),
    ({"dsv3": {k: v for k, v in GANG_LAUNCH.items() if k != "first_rank"}},
     ["vllm_service_gang_launch.dsv3: first_rank missing (gpufleet.vllm.gang_member_launch gives where the member's ranks lie in the gang)"]),
    ({"dsv3": dict(GANG_LAUNCH, ranks=3)}, ["vllm_service_gang_launch.dsv3.ranks: 3 ranks, but the instance has 2 GPU(s)"]),
    (["dsv3"], ["vllm_service_instances[0].gang: an instance that spans hosts needs its member's rank",
                "vllm_service_gang_launch: expected a mapping of instance name -> launch"]),
])
def test_the_role_takes_a_gang_member_only_with_its_launch_and_names_a_bad_one(launch, expected):
    problems = service_input_problems({"vllm_service_instances": [GANG_INSTANCE], "vllm_service_gang_launch": launch})
    problems = [p for p in problems if "gang" in p]
    assert len(problems) == len(expected) and all(p.startswith(e) for p, e in zip(problems, expected)), problems


def test_a_gang_members_plan_must_hold_the_floors_of_its_ranks():
    """The follower's ranks are 2 and 3 of the gang: a plan keyed by its own GPUs (0, 1) gives it no floors."""
    plan = {"decision": "deploy", "kv_cache_memory_bytes": 2 << 30, "gpu_memory_utilization": 0.5,
            "free_floor_bytes": {"0": 6 << 30, "1": 6 << 30}}
    inputs = {"vllm_service_instances": [GANG_INSTANCE], "vllm_service_gang_launch": {"dsv3": GANG_LAUNCH}, "vllm_service_plan": plan}
    assert [p for p in service_input_problems(inputs) if "floor" in p] == [
        "vllm_service_plan.free_floor_bytes: no floor for rank(s) 2, 3 of this member (its ranks 2-3 of the instance; the plan has "
        "rank(s) 0, 1): plan the gang across all of its members"]
    gang_plan = dict(plan, free_floor_bytes={str(r): 6 << 30 for r in range(4)})
    assert not [p for p in service_input_problems(dict(inputs, vllm_service_plan=gang_plan)) if "floor" in p]


# ------------------------------------------------------------------ snapshots that cannot go stale
def test_a_snapshot_that_cannot_be_written_leaves_the_last_one_and_its_rollback_restores_nothing(layout, monkeypatch):
    """The read-only snapshot directory of an SRE's report: the first deploy's snapshot (files absent)
    must not be restored by the next change, whose own snapshot failed: the instance serves on."""
    systemd = FakeSystemd()
    snapshot(layout, ["a"], systemd.show, check=False, change_id="run-1")
    deployed(layout, systemd)  # the first change passed its boot check
    before = load_snapshot(layout, "a")
    real_write = atomic_write

    def read_only(path: str, data: bytes, uid: int, gid: int, file_mode: int) -> None:
        if path.startswith(layout.kept_dir):
            raise UnitFilesError(f"{path}: cannot write: Read-only file system")
        real_write(path, data, uid, gid, file_mode)

    monkeypatch.setattr("ansible_collections.gpufleet.vllm.plugins.module_utils._units._unit_files.atomic_write", read_only)
    with pytest.raises(UnitFilesError, match="Read-only file system"):
        snapshot(layout, ["a"], systemd.show, check=False, change_id="run-2")
    assert load_snapshot(layout, "a") == before, "the last snapshot is as it was"
    (back,) = restore(layout, ["a"], systemd.run, check=False, change_id="run-2")
    assert "belongs to change run-1" in back["skipped"] and not back["changed"]
    assert not back["restart"] and not back["stop"] and not back.get("stopped")
    for kind, text in (("unit", UNIT_A), ("env", ENV_A)):
        assert read(layout.path("a", kind)) == text, kind
    assert read(layout.path("a", "plan")) is not None
    assert [c for c in systemd.calls if c[0] != "show"] == [], "nothing stopped or disabled"


def test_a_rollback_removes_only_the_files_its_change_wrote(layout):
    systemd = FakeSystemd()
    want = {"name": "a", "unit": UNIT_A, "env": ENV_A, "plan": {"kv_cache_memory_bytes": 1000}}
    snapshot(layout, ["a"], systemd.show, check=False, change_id="run-1")
    write(layout, [want], check=False)  # notes what it writes in the snapshot before it writes
    assert sorted(load_snapshot(layout, "a")["written"]) == ["dropin", "env", "plan", "unit"]
    # someone puts their own environment file in place before the rollback
    put(layout.path("a", "env"), ENV_B, 0o600)
    (back,) = restore(layout, ["a"], systemd.run, check=False, change_id="run-1")
    assert back["removed"] == ["unit", "plan", "dropin"] and back["left"] == ["env"], back
    assert read(layout.path("a", "env")) == ENV_B, "a file the change did not write is never deleted"
    assert back["stopped"] is True


def test_an_instance_a_cut_off_canary_left_stopped_was_serving(layout):
    """SIGKILL during the profiled canary: the next run's snapshot must not record 'not running'."""
    systemd = FakeSystemd()
    deployed(layout, systemd)
    put(canary_hold_path(layout, "a"), '{"change_id": "canary-1"}\n', 0o600)
    systemd.active["vllm-a.service"] = "inactive"
    entry = status(layout, [{"name": "a", "unit": UNIT_A, "env": ENV_A}], systemd.show)[0]
    assert "a canary that was cut off left it stopped" in entry["reasons"]
    (taken,) = snapshot(layout, ["a"], systemd.show, check=False, change_id="run-2")
    assert taken["serving"] is True and load_snapshot(layout, "a")["held_by_canary"] == "canary-1"
    write(layout, [{"name": "a", "unit": UNIT_B}], check=False)
    (back,) = restore(layout, ["a"], systemd.run, check=False)
    assert back["restart"] is True and back["stop"] is False, "the rollback starts what served before the canary"
    assert not os.path.exists(canary_hold_path(layout, "a")), "it serves again: the hold is over"
    # a deploy whose boot check passed ends the hold too
    put(canary_hold_path(layout, "a"), '{"change_id": "canary-2"}\n', 0o600)
    record(layout, [{"name": "a", "plan": {"kv_cache_memory_bytes": 1000}}], check=False)
    assert not os.path.exists(canary_hold_path(layout, "a"))


def test_a_resumed_change_is_restored_by_the_run_that_carried_it_on(layout):
    systemd = FakeSystemd()
    deployed(layout, systemd)
    snapshot(layout, ["a"], systemd.show, check=False, change_id="run-1")
    write(layout, [{"name": "a", "unit": UNIT_B}], check=False)  # run-1 killed here
    assert snapshot(layout, ["a"], systemd.show, check=False, change_id="run-2")[0]["resumed"] is True
    (back,) = restore(layout, ["a"], systemd.run, check=False, change_id="run-2")
    assert back["restored"] == ["unit"] and read(layout.path("a", "unit")) == UNIT_A


def test_a_snapshot_kept_by_an_older_release_is_read_and_replaced(layout):
    systemd = FakeSystemd()
    deployed(layout, systemd)
    put(layout.kept("a", "unit") + ".previous", UNIT_B, 0o600)
    for kind in ("plan", "env"):
        put(layout.kept("a", kind) + ".absent", "", 0o600)
    put(layout.changing_marker("a"), "", 0o600)
    assert status(layout, [{"name": "a", "unit": UNIT_A, "env": ENV_A}], systemd.show)[0]["pending"]
    assert kept(layout, "a", "unit") == UNIT_B
    assert snapshot(layout, ["a"], systemd.show, check=False, change_id="run-3")[0]["resumed"] is True
    assert sorted(os.listdir(layout.kept_dir)) == ["vllm-a.snapshot.json"]
    (back,) = restore(layout, ["a"], systemd.run, check=False, change_id="run-3")
    assert back["restored"] == ["unit"] and sorted(back["removed"]) == ["env", "plan"]
    assert "dropin" in back["unknown"], "an older release's snapshot knows nothing of the drop-in: left alone"


def test_a_snapshot_that_cannot_be_read_is_named_and_kept(layout):
    systemd = FakeSystemd()
    snapshot(layout, ["a"], systemd.show, check=False)
    path = os.path.join(layout.kept_dir, "vllm-a.snapshot.json")
    put(path, '{"format": 1, "instance": "a", "files": {"unit": {"data": "eA==", "sha1": "0"}}}', 0o600)
    with pytest.raises(UnitFilesError, match=r"vllm-a.snapshot.json: the snapshot cannot be read \(the kept unit file"):
        restore(layout, ["a"], systemd.run, check=False)
    assert status(layout, [{"name": "a", "unit": UNIT_A}], systemd.show)[0]["pending"]
    assert os.path.exists(path)


# ------------------------------------------------------------------ runtime switch
def releases(tmp_path, *names: str) -> list[str]:
    out = []
    for name in names:
        (tmp_path / "releases" / name).mkdir(parents=True)
        out.append(str(tmp_path / "releases" / name))
    return out


def test_a_runtime_switch_keeps_the_release_and_its_rollback_switches_back_to_it(layout, tmp_path):
    systemd = FakeSystemd()
    deployed(layout, systemd, "a")
    deployed(layout, systemd, "b")
    old, new = releases(tmp_path, "vllm-0.33.1-aaaa", "vllm-0.33.2-bbbb")
    venv = str(tmp_path / "venv")
    os.symlink(old, venv)
    kept_now = snapshot(layout, ["a", "b"], systemd.show, check=False, change_id="run-1", runtime_venv=venv)
    assert [k["runtime_release"] for k in kept_now] == [old, old]
    os.unlink(venv)
    os.symlink(new, venv)  # the change switched the runtime
    write(layout, [{"name": "a", "unit": UNIT_B}, {"name": "b", "unit": UNIT_B}], check=False)
    assert runtime_to_restore(layout, ["a", "b"], venv) == {"release": old, "current": new, "instances": ["a", "b"]}
    (back, _b) = restore(layout, ["a", "b"], systemd.run, check=False)
    assert back["runtime_release"] == old
    os.unlink(venv)
    os.symlink(old, venv)  # switched back: nothing more to switch
    assert runtime_to_restore(layout, ["a", "b"], venv) == {"release": "", "current": old, "instances": ["a", "b"]}


def test_a_change_without_a_runtime_switch_keeps_no_release(layout, tmp_path):
    systemd = FakeSystemd()
    deployed(layout, systemd)
    (old,) = releases(tmp_path, "vllm-0.33.1-aaaa")
    venv = str(tmp_path / "venv")
    os.symlink(old, venv)
    assert snapshot(layout, ["a"], systemd.show, check=False)[0]["runtime_release"] == ""
    assert runtime_to_restore(layout, ["a"], venv) == {"release": "", "current": old, "instances": []}
    # a venv that is a plain directory has no release to switch back to by name
    plain = tmp_path / "plain-venv"
    plain.mkdir()
    assert snapshot(layout, ["a"], systemd.show, check=False, runtime_venv=str(plain))[0]["runtime_release"] == ""


def test_a_resumed_change_keeps_the_release_from_before_the_interrupted_one(layout, tmp_path):
    systemd = FakeSystemd()
    deployed(layout, systemd)
    old, new = releases(tmp_path, "r1", "r2")
    venv = str(tmp_path / "venv")
    os.symlink(old, venv)
    snapshot(layout, ["a"], systemd.show, check=False, change_id="run-1", runtime_venv=venv)
    os.unlink(venv)
    os.symlink(new, venv)  # run-1 switched, then was killed
    again = snapshot(layout, ["a"], systemd.show, check=False, change_id="run-2", runtime_venv=venv)[0]
    assert again["resumed"] is True and again["runtime_release"] == old


def test_snapshots_that_keep_two_releases_are_refused_before_anything_is_restored(layout, tmp_path):
    systemd = FakeSystemd()
    deployed(layout, systemd, "a")
    deployed(layout, systemd, "b")
    one, two, now = releases(tmp_path, "r1", "r2", "r3")
    venv = str(tmp_path / "venv")
    for name, release in (("a", one), ("b", two)):
        if os.path.lexists(venv):
            os.unlink(venv)
        os.symlink(release, venv)
        snapshot(layout, [name], systemd.show, check=False, runtime_venv=venv)
        record(layout, [{"name": name, "plan": {"kv_cache_memory_bytes": 1}}], check=False)
    os.unlink(venv)
    os.symlink(now, venv)
    with pytest.raises(UnitFilesError, match=rf"different engine releases to switch back to: a: {one}; b: {two}"):
        runtime_to_restore(layout, ["a", "b"], venv)
    assert runtime_to_restore(layout, ["a"], venv)["release"] == one


def test_a_restore_names_the_launch_record_its_boot_is_checked_against(layout):
    systemd = FakeSystemd()
    launch = {"schema": 1, "decision": "deploy", "manual": True, "kv_cache_memory_bytes": 1000}
    plan = {"instance": "a", "port": 8001, "launch": launch, "boot_gate": {"policy": "refuse", "state_file": "/run/gpufleet/a.boot-gate.json"}}
    write(layout, [{"name": "a", "unit": UNIT_A, "env": ENV_A, "plan": plan}], check=False)
    record(layout, [{"name": "a", "plan": plan}], check=False)
    systemd.active["vllm-a.service"] = "active"
    snapshot(layout, ["a"], systemd.show, check=False)
    write(layout, [{"name": "a", "unit": UNIT_B}], check=False)
    (back,) = restore(layout, ["a"], systemd.run, check=False)
    assert back["restart"] is True
    assert back["launch"] == launch and back["boot_gate_state"] == "/run/gpufleet/a.boot-gate.json" and back["port"] == 8001
    # a unit kept without a plan file: its boot is checked for health and errors only
    snapshot(layout, ["b"], systemd.show, check=False)
    (none,) = restore(layout, ["b"], systemd.run, check=False)
    assert none["launch"] is None and none["boot_gate_state"] == "" and none["port"] is None
