#!/usr/bin/env python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""leftovers.py TOKEN [--grace S]: list, end and fail on the processes a test stage left behind.

``tests/tools/run-stage.sh`` puts ``GPUFLEET_STAGE_TOKEN=<TOKEN>`` into the environment of the
stage it runs; every process the stage starts inherits it (playbooks and their workers, SSH
clients, engines, the test hosts' ``systemd-nspawn``), and nothing outside the stage has it.
Once the stage's command has exited, any process that still carries the token was left
behind: after ``--grace`` seconds for those that are on their way out, each is listed (pid,
parent, command line), sent SIGTERM, then SIGKILL, and the exit status is 1.

One kind is ended without failing the stage: an SSH control master (``ssh: ... [mux]``),
the connection cache that Ansible's ``ControlPersist`` keeps for a while after the last
command and that exits by itself; its host is gone once the stage has torn it down.

Standard library only (it runs with the machine's python3, before any venv may exist).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass

VARIABLE = "GPUFLEET_STAGE_TOKEN"


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    cmdline: str

    @property
    def test_host(self) -> bool:
        """A test host's ``systemd-nspawn`` (tests/hosts/testhosts.py): the harness, not the command
        that booted it, ends it (``make demo`` leaves its fleet up on purpose)."""
        return self.cmdline.split(" ", 1)[0].endswith("systemd-nspawn")

    @property
    def connection_cache(self) -> bool:
        """An SSH control master: ``ssh: <control path> [mux]``."""
        return self.cmdline.startswith("ssh: ") and self.cmdline.endswith("[mux]")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def carrying(token: str, proc_root: str = "/proc", exclude: frozenset[int] = frozenset(),
             variable: str = VARIABLE) -> list[Proc]:
    """Every process whose environment holds ``<variable>=<token>``, oldest pid first.

    The environment a process was started with is inherited by its forks and whatever they
    run, also by those that left its session (Ansible's task workers call ``setsid``) or were
    orphaned (their parent is 1 once it died): the token follows the whole tree."""
    wanted = f"{variable}={token}".encode()
    found = []
    for name in os.listdir(proc_root):
        if not name.isdigit() or int(name) in exclude:
            continue
        if wanted not in _read(f"{proc_root}/{name}/environ").split(b"\0"):
            continue
        stat = _read(f"{proc_root}/{name}/stat").decode(errors="replace")
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2:].split()
        ppid = int(fields[1]) if len(fields) > 1 else 0
        cmdline = _read(f"{proc_root}/{name}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        found.append(Proc(int(name), ppid, cmdline or f"[{stat[stat.find('(') + 1:stat.rfind(')')]}]"))
    return sorted(found, key=lambda p: p.pid)


def end(procs: list[Proc], wait: float = 5.0) -> None:
    """SIGTERM, then SIGKILL what is still there after ``wait`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            try:
                os.kill(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while any(os.path.exists(f"/proc/{p.pid}") for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("token")
    parser.add_argument("--grace", type=float, default=15.0, help="seconds for processes on their way out")
    args = parser.parse_args(argv)
    if not args.token.strip():
        parser.error("an empty token matches nothing")
    me = frozenset({os.getpid()})
    deadline = time.monotonic() + args.grace
    left = carrying(args.token, exclude=me)
    while any(not p.connection_cache for p in left) and time.monotonic() < deadline:
        time.sleep(0.5)
        left = carrying(args.token, exclude=me)
    caches = [p for p in left if p.connection_cache]
    strays = [p for p in left if not p.connection_cache]
    if caches:
        print(f"leftovers: ended {len(caches)} SSH control master(s) of hosts the stage tore down")
        end(caches)
    if not strays:
        return 0
    print(f"leftovers: the stage left {len(strays)} process(es) running; ending them:", file=sys.stderr)
    for proc in strays:
        print(f"  pid {proc.pid} (parent {proc.ppid}): {proc.cmdline[:300]}", file=sys.stderr)
    end(strays)
    return 1


if __name__ == "__main__":
    sys.exit(main())
