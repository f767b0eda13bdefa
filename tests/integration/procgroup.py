# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Commands a test starts (playbooks, engines) that never outlive the test.

``subprocess.run(..., timeout=...)`` kills only the process it started: ``ansible-playbook``'s
workers and their SSH clients, or an engine's ranks, go on as orphans (parent pid 1), and a
test that fails while it reads a playbook's output leaves the whole playbook running against
hosts that are being torn down. Here every command is the leader of a session of its own, and
its whole process group is killed whenever the call returns or raises: after a normal exit
(stragglers), at the timeout, and on any exception, a failed assertion in ``on_line`` included.

A process group is not enough: Ansible's task workers call ``setsid`` (a session of their own)
and are orphaned when ``ansible-playbook`` dies, SSH control masters detach the same way, and a
test that kills the controller on purpose kills only its group. So each command also gets a
token of its own in its environment, which every process it starts inherits, and every process
that carries it is killed at the end (``tests/tools/leftovers.py`` finds them, as it finds what a
whole stage left behind).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import leftovers  # noqa: E402  pylint: disable=wrong-import-position,import-error

TOKEN_VARIABLE = "GPUFLEET_COMMAND_TOKEN"


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` that is still there."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pgid: int, token: str) -> None:
    """SIGKILL the group, then every process that carries the command's token, until none is left.

    Test hosts are spared: a command may boot hosts that outlive it (``make demo``, a fleet a test
    creates through fleetctl); the harness ends them, and the stage's own check fails on any that
    is still up when the stage ends."""
    kill_group(pgid)
    for _round in range(20):  # a dying process can fork once more; each round kills what is left
        procs = [p for p in leftovers.carrying(token, variable=TOKEN_VARIABLE) if not p.test_host]
        if not procs:
            return
        for proc in procs:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        threading.Event().wait(0.05)


def run(argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None, on_start: Callable[[subprocess.Popen[str]], None] | None = None,
        on_line: Callable[[str], None] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (stdin closed, stderr into stdout) as the leader of a new session.

    Returns the finished process with its whole output in ``stdout`` (``stderr`` is empty);
    raises :class:`subprocess.TimeoutExpired` (with the output so far) once ``timeout`` seconds
    have passed. ``on_start`` gets the process as soon as it runs, ``on_line`` every output line.
    Whatever happens, no process of its group is left when this returns or raises.
    """
    lines: list[str] = []
    timed_out = threading.Event()
    token = uuid.uuid4().hex
    environment = dict(os.environ if env is None else env, **{TOKEN_VARIABLE: token})
    with subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=environment, cwd=cwd, start_new_session=True) as proc:

        def expire() -> None:
            timed_out.set()
            kill_tree(proc.pid, token)

        timer = threading.Timer(timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            if on_start is not None:
                on_start(proc)
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if on_line is not None:
                    on_line(line)
            rc = proc.wait()
        finally:
            timer.cancel()
            # workers outlive their controller (their own sessions), and everything is still
            # there when we leave early (an exception, a timeout)
            kill_tree(proc.pid, token)
            if proc.poll() is None:
                proc.wait()
    output = "".join(lines)
    if timed_out.is_set():
        raise subprocess.TimeoutExpired(list(argv), timeout, output=output)
    return subprocess.CompletedProcess(list(argv), rc, output, "")
