# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""_lease: one controller at a time per host class, on real files, with real processes racing for it."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils import _lease


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += max(seconds, 1.0)


def test_a_second_run_is_refused_with_the_holder_and_the_holder_renews_and_releases(tmp_path):
    clock = Clock()
    got = _lease.acquire(str(tmp_path), "l40s", "run-a", 600, owner="sre@bastion", details={"awx_job_id": 42}, clock=clock)
    assert got["taken_over"] is None and got["lease"]["expires"] == clock.now + 600
    with pytest.raises(_lease.LeaseHeld, match=r"host class l40s is being changed by rollout run run-a of sre@bastion, "
                                               r"started .* \(awx_job_id 42\); this run stops before touching any host") as held:
        _lease.acquire(str(tmp_path), "l40s", "run-b", 600, clock=clock)
    assert held.value.holder["run_id"] == "run-a"
    clock.now += 500
    assert _lease.renew(str(tmp_path), "l40s", "run-a", 600, clock=clock)["lease"]["expires"] == clock.now + 600
    assert _lease.release(str(tmp_path), "l40s", "run-b")["released"] is False, "not run-b's to release"
    assert _lease.release(str(tmp_path), "l40s", "run-a")["released"] is True
    assert _lease.acquire(str(tmp_path), "l40s", "run-b", 600, clock=clock)["lease"]["run_id"] == "run-b"


def test_an_expired_lease_is_taken_over_and_named_and_its_run_can_no_longer_renew(tmp_path):
    clock = Clock()
    _lease.acquire(str(tmp_path), "l40s", "run-a", 60, owner="awx@node-1", clock=clock)
    clock.now += 61  # run-a's controller was killed
    got = _lease.acquire(str(tmp_path), "l40s", "run-b", 600, clock=clock)
    assert got["taken_over"]["run_id"] == "run-a" and got["lease"]["run_id"] == "run-b"
    assert sorted(p.name for p in (tmp_path / ".leases").iterdir()) == ["l40s.json"], "nothing left aside"
    with pytest.raises(_lease.LeaseError, match=r"this run \(run-a\) no longer holds its lease; rollout run run-b"):
        _lease.renew(str(tmp_path), "l40s", "run-a", 600, clock=clock)


def test_waiting_gets_the_lease_once_it_is_released_or_gives_up_naming_the_wait(tmp_path):
    clock = Clock()
    _lease.acquire(str(tmp_path), "l40s", "run-a", 3600, clock=clock)
    with pytest.raises(_lease.LeaseHeld, match="after waiting 30 s"):
        _lease.acquire(str(tmp_path), "l40s", "run-b", 600, wait=30, clock=clock, sleep=clock.sleep, poll=10)
    assert clock.slept, "it waited"

    def release_then_sleep(seconds: float) -> None:
        _lease.release(str(tmp_path), "l40s", "run-a")
        clock.sleep(seconds)

    got = _lease.acquire(str(tmp_path), "l40s", "run-b", 600, wait=30, clock=clock, sleep=release_then_sleep, poll=10)
    assert got["lease"]["run_id"] == "run-b"


def test_a_lease_nobody_can_read_is_never_taken_over_silently(tmp_path):
    path = tmp_path / ".leases" / "l40s.json"
    path.parent.mkdir()
    path.write_text("{half a lease", encoding="utf-8")
    with pytest.raises(_lease.LeaseError, match=r"l40s.json: the lease cannot be read .*remove it once no controller runs"):
        _lease.acquire(str(tmp_path), "l40s", "run-b", 600)
    assert path.read_text(encoding="utf-8") == "{half a lease"


@pytest.mark.parametrize("ttl, wait, field", [(10, 0, "gpufleet_lease_ttl"), (10**9, 0, "gpufleet_lease_ttl"),
                                              (600, -1, "gpufleet_lease_wait"), ("x", 0, "whole seconds")])
def test_bounds_name_the_setting(ttl, wait, field):
    with pytest.raises(_lease.LeaseError, match=field):
        _lease.check_inputs(ttl, wait)


@pytest.mark.parametrize("scope", ["../etc", "a/b", "", ".hidden"])
def test_a_scope_never_names_a_path_outside_the_lease_directory(tmp_path, scope):
    with pytest.raises(_lease.LeaseError, match="lease scope"):
        _lease.acquire(str(tmp_path), scope, "run-a", 600)


def _race(store: str, run_id: str, queue: "multiprocessing.Queue[str]") -> None:
    try:
        _lease.acquire(store, "l40s", run_id, 600)
        queue.put(run_id)
    except _lease.LeaseHeld:
        queue.put("refused")


def test_controllers_racing_for_one_class_see_exactly_one_winner(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[str] = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), f"run-{i}", queue)) for i in range(8)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    results = sorted(queue.get(timeout=5) for _proc in procs)
    winners = [r for r in results if r != "refused"]
    assert len(winners) == 1, results
    assert json.loads((tmp_path / ".leases" / "l40s.json").read_text())["run_id"] == winners[0]


def test_a_lease_whose_controller_no_longer_runs_on_this_machine_is_taken_over_at_once(tmp_path):
    """A killed ansible-playbook (or one whose play a lost host ended before it could release) holds nothing."""
    clock = Clock()
    _lease.acquire(str(tmp_path), "l40s", "run-a", 3600, clock=clock)
    path = tmp_path / ".leases" / "l40s.json"
    held = json.loads(path.read_text())
    assert held["pid"] == os.getppid() and held["pid_start"] and held["host"]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    path.write_text(json.dumps(dict(held, pid=int(gone.stdout))))
    got = _lease.acquire(str(tmp_path), "l40s", "run-b", 600, clock=clock)
    assert got["taken_over"]["run_id"] == "run-a" and _lease.holder_gone(got["taken_over"])
    # a pid reused by another process since (another start time) is gone too; another machine's is not judged
    assert _lease.holder_gone(dict(held, pid_start="1"))
    assert not _lease.holder_gone(dict(held, host="another-controller", pid=int(gone.stdout)))
    assert not _lease.holder_gone(held), "this test's own controller still runs"


def _args(**over):
    args = {"state": "present", "run_id": "run-b", "ttl": 600, "wait": 0, "purpose": "rollout", "details": {},
            "superseded": [], "owner": None}
    args.update(over)
    return args


def test_a_host_lease_refuses_another_run_and_names_the_host_not_a_class(tmp_path):
    controller = {"host": "controller-1", "pid": 4242, "pid_start": "77"}
    got = _lease.apply(str(tmp_path), [_lease.HOST_SCOPE], _args(run_id="run-a", details={"host_class": "l40s"}),
                       process=controller)
    assert got["leases"][0]["host"] == "controller-1" and got["leases"][0]["host_class"] == "l40s"
    assert (tmp_path / ".leases" / "host.json").is_file()
    with pytest.raises(_lease.LeaseHeld, match=r"^this host is being changed by rollout run run-a of .*; "
                                               r"this run stops before touching it \(gpufleet_lease_wait"):
        _lease.apply(str(tmp_path), [_lease.HOST_SCOPE], _args(), process=controller)
    # another machine's controller pid is never judged from here: only expiry or supersession frees it
    assert _lease.holder_gone(got["leases"][0]) is False


def test_a_host_lease_of_a_run_whose_class_lease_was_taken_over_is_taken_over_at_once(tmp_path):
    controller = {"host": "controller-1", "pid": 4242, "pid_start": "77"}
    _lease.apply(str(tmp_path), [_lease.HOST_SCOPE], _args(run_id="killed-run"), process=controller)
    got = _lease.apply(str(tmp_path), [_lease.HOST_SCOPE], _args(superseded=["killed-run"]), process=controller)
    assert got["leases"][0]["run_id"] == "run-b"
    assert [entry["msg"] for entry in got["taken_over"]] == [
        f"this host: took over the lease of {_lease.describe(got['taken_over'][0]['holder'])} (its run no longer holds its class lease)"]
    assert _lease.apply(str(tmp_path), [_lease.HOST_SCOPE], _args(state="absent"))["released"] == ["host"]
    assert _lease.apply(str(tmp_path), [_lease.HOST_SCOPE], _args(state="absent"))["changed"] is False


def test_check_mode_writes_nothing_and_names_the_holder(tmp_path):
    _lease.apply(str(tmp_path), ["l40s"], _args(run_id="run-a"), process={"host": "c", "pid": 1, "pid_start": "1"})
    before = sorted(p.name for p in (tmp_path / ".leases").iterdir())
    got = _lease.apply(str(tmp_path), ["l40s", "h200"], _args(), check_mode=True)
    assert [entry["scope"] for entry in got["held_by"]] == ["l40s"] and got["leases"] == []
    assert sorted(p.name for p in (tmp_path / ".leases").iterdir()) == before


@pytest.mark.parametrize("field,value,match", [
    ("ttl", 10, r"gpufleet_lease_ttl: 10 s is outside"),
    ("wait", -1, r"gpufleet_lease_wait: -1 s is outside"),
    ("run_id", "a\nb", r"run_id 'a\\nb': expected letters, digits"),
    # it names the file an expired lease is moved aside to
    ("run_id", "run/1", r"run_id 'run/1': expected letters, digits"),
    ("run_id", "run-1\n", r"run_id 'run-1\\n': expected letters, digits"),
])
def test_bad_inputs_name_the_field_and_write_nothing(tmp_path, field, value, match):
    with pytest.raises(_lease.LeaseError, match=match):
        _lease.apply(str(tmp_path), [_lease.HOST_SCOPE], _args(**{field: value}))
    assert not (tmp_path / ".leases").exists()


def test_a_scope_with_a_trailing_newline_is_refused(tmp_path):
    with pytest.raises(_lease.LeaseError, match=r"lease scope 'c1\\n': expected a host class name"):
        _lease.apply(str(tmp_path), ["c1\n"], _args())
    assert not (tmp_path / ".leases").exists()


def test_a_lease_that_cannot_be_written_leaves_no_file_behind(tmp_path, monkeypatch):
    _lease.apply(str(tmp_path), ["l40s"], _args(run_id="run-a"))
    before = sorted(p.name for p in (tmp_path / ".leases").iterdir())

    def full(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_lease.os, "fsync", full)
    for attempt in range(3):
        with pytest.raises(_lease.LeaseError, match=r"cannot write the lease: No space left on device"):
            _lease.apply(str(tmp_path), ["h200"], _args(run_id=f"run-{attempt}"))
    assert sorted(p.name for p in (tmp_path / ".leases").iterdir()) == before


def test_a_store_has_one_id_and_a_host_lease_of_its_ended_run_counts_as_over(tmp_path):
    store = str(tmp_path / "store")
    own = _lease.store_id(store)
    assert own == _lease.store_id(store) and len(own) == 32, "made once, then read"
    holder = {"run_id": "run-a", "host_class": "l40s", "store_id": own}
    _lease.acquire(store, "l40s", "run-a", 600)
    assert _lease.run_ended(store, holder, own) is False, "run-a still holds its class: it may still change the host"
    _lease.release(store, "l40s", "run-a")
    assert _lease.run_ended(store, holder, own) is True, "run-a ended (its class lease is gone)"
    _lease.acquire(store, "l40s", "run-b", 600)
    assert _lease.run_ended(store, holder, own) is True, "another run holds the class now"
    _lease.release(store, "l40s", "run-b")
    _lease.acquire(store, "l40s", "run-a", 600, process={"host": "elsewhere", "pid": 1, "pid_start": "1"})
    assert _lease.run_ended(store, holder, own) is False, "its controller may run elsewhere"
    _lease.release(store, "l40s", "run-a")
    _lease.acquire(store, "l40s", "run-a", 60, clock=lambda: 1_000.0)
    assert _lease.run_ended(store, holder, own) is True, "its class lease expired"
    # a run of another store (or one that names no store) is never judged from this one
    assert _lease.run_ended(store, dict(holder, store_id="0" * 32), own) is False
    assert _lease.run_ended(store, {"run_id": "run-a", "host_class": "l40s"}, own) is False


def test_a_store_id_that_is_not_one_is_an_error_naming_the_file(tmp_path):
    (tmp_path / ".leases").mkdir()
    (tmp_path / ".leases" / "store-id").write_text("garbage\n", encoding="ascii")
    with pytest.raises(_lease.LeaseError, match=r"store-id: not a store id"):
        _lease.store_id(str(tmp_path))
