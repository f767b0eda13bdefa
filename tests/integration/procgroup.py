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

SSH control masters (``ControlPersist``) detach into sessions of their own and exit by
themselves once idle; ``tests/tools/leftovers.py`` ends them at the end of a stage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` that is still there."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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
    with subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=dict(env) if env is not None else None, cwd=cwd,
                          start_new_session=True) as proc:

        def expire() -> None:
            timed_out.set()
            kill_group(proc.pid)

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
            # the group outlives its leader when a worker was forked and not reaped, and every
            # member is still there when we leave early (an exception, a timeout)
            kill_group(proc.pid)
            if proc.poll() is None:
                proc.wait()
    output = "".join(lines)
    if timed_out.is_set():
        raise subprocess.TimeoutExpired(list(argv), timeout, output=output)
    return subprocess.CompletedProcess(list(argv), rc, output, "")
