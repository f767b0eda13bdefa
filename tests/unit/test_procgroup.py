# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""tests/integration/procgroup.py: nothing a test starts outlives the call that started it.

The commands here stand in for ``ansible-playbook``: a leader that forks a worker which leaves
its session (``setsid``, as Ansible's task workers do) and writes the worker's pid, so that the
test can look for it afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration"))

import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
                if handle.read().split(") ", 1)[1].startswith("Z"):
                    return True  # a zombie waiting for init to reap it holds nothing
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _leader_with_worker(pid_file: Path, then: str) -> list[str]:
    """bash that starts a worker in a session of its own (sleeping), writes its pid, then runs ``then``."""
    return ["bash", "-c", f"setsid sleep 300 >/dev/null 2>&1 & echo $! > {pid_file}; echo started; {then}"]


def test_a_worker_in_its_own_session_does_not_outlive_a_leader_that_exited(tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"
    done = procgroup.run(_leader_with_worker(pid_file, "exit 3"), timeout=60)
    assert done.returncode == 3 and done.stdout == "started\n" and done.stderr == ""
    assert _gone(int(pid_file.read_text(encoding="ascii")))


def test_a_failing_callback_ends_the_command_and_its_workers(tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"

    def fail(line: str) -> None:
        raise AssertionError(f"the test saw {line.strip()!r}")

    with pytest.raises(AssertionError, match="the test saw 'started'"):
        procgroup.run(_leader_with_worker(pid_file, "sleep 300"), timeout=60, on_line=fail)
    assert _gone(int(pid_file.read_text(encoding="ascii")))


def test_the_timeout_ends_everything_and_keeps_the_output(tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        procgroup.run(_leader_with_worker(pid_file, "sleep 300"), timeout=2)
    assert time.monotonic() - started < 30
    assert caught.value.output == "started\n"
    assert _gone(int(pid_file.read_text(encoding="ascii")))


def test_a_controller_killed_by_the_test_leaves_no_orphan(tmp_path: Path) -> None:
    """A test that kills the controller's group (a lost controller) orphans its workers; they go too."""
    pid_file = tmp_path / "worker.pid"

    def kill(proc: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + 10
        # the whole pid written (the shell creates the file before it writes to it)
        while not (pid_file.exists() and pid_file.read_text(encoding="ascii").endswith("\n")):
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.02)
        os.killpg(proc.pid, 9)

    done = procgroup.run(_leader_with_worker(pid_file, "sleep 300"), timeout=60, on_start=kill)
    assert done.returncode == -9
    assert _gone(int(pid_file.read_text(encoding="ascii")))


def test_a_test_host_booted_by_the_command_is_left_to_the_harness(tmp_path: Path) -> None:
    """``make demo`` leaves its fleet up: a test host's systemd-nspawn outlives the command (the harness
    ends it, and the stage's leftover check fails on one still up)."""
    pid_file = tmp_path / "host.pid"
    # (the command returns once the host runs, as the harness's `up` does)
    argv = ["bash", "-c", "setsid bash -c 'exec -a systemd-nspawn sleep 300' >/dev/null 2>&1 & host=$!; "
            "until tr '\\0' ' ' < /proc/$host/cmdline | grep -q '^systemd-nspawn '; do sleep 0.02; done; "
            f"echo $host > {pid_file}"]
    procgroup.run(argv, timeout=60)
    host = int(pid_file.read_text(encoding="ascii"))
    try:
        time.sleep(0.2)
        assert not _gone(host, timeout=0.5)
    finally:
        os.kill(host, 9)
