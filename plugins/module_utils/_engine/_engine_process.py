# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""One ``vllm serve`` process: started in its own session and process group (as the service's
account when given), stopped with its whole group, its ``/health`` waited for while noticing an
engine that dies, its ``/metrics`` scraped.

Plain Python (no Ansible import).
"""

from __future__ import annotations

import http.client
import os
import resource
import signal
import socket
import subprocess
import time
import typing as t
from dataclasses import dataclass

from .._validate import ValidationError, integer
from ._serve_argv import LOOPBACK, EngineSpecError
from ._vllm_metrics import EngineMetrics, MetricsParseError, parse_metrics

# a unit that listens on every address is asked on the loopback address
WILDCARD_ADDRESSES = ("", "0.0.0.0", "::", "[::]")


def health_address(listen_host: str) -> str:
    """The address to ask an engine that listens on ``listen_host`` from its own host."""
    return LOOPBACK if listen_host.strip() in WILDCARD_ADDRESSES else listen_host.strip().strip("[]")


def base_url(host: str, port: int) -> str:
    """``http://host:port`` of an engine that listens on ``host`` (a wildcard: the loopback address; IPv6 in brackets)."""
    address = health_address(host)
    return f"http://[{address}]:{int(port)}" if ":" in address else f"http://{address}:{int(port)}"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, int(port))) == 0


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, session) of a live pid, from ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read().decode("ascii", "replace")
    except OSError:
        return None
    # comm may hold spaces/parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2:].split()
    try:
        return rest[0], int(rest[2]), int(rest[3])
    except (IndexError, ValueError):
        return None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group or session is ``pgid``."""
    members: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return members
    for name in names:
        if not name.isdigit():
            continue
        stat = _proc_stat(int(name))
        if stat is None:
            continue
        state, pgrp, session = stat
        if state in ("Z", "X"):
            continue
        if pgrp == pgid or session == pgid:
            members.append(int(name))
    return sorted(members)


@dataclass
class StopResult:
    signal_used: str
    seconds: float
    returncode: int | None
    leftover_pids: list[int]


@dataclass(frozen=True)
class Account:
    """The unprivileged account an engine runs as (the service's): ids, groups and home."""

    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @classmethod
    def lookup(cls, user: str, group: str | None = None) -> Account:
        """The account of ``user`` (and ``group``, else its primary group), with its supplementary
        groups as systemd's ``User=`` gives them; an unknown name is an error naming it."""
        import grp  # pylint: disable=import-outside-toplevel
        import pwd  # pylint: disable=import-outside-toplevel

        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise EngineSpecError(f"user: no account {user!r} on this host (create the service user first)") from None
        gid = entry.pw_gid
        if group:
            try:
                gid = grp.getgrnam(group).gr_gid
            except KeyError:
                raise EngineSpecError(f"group: no group {group!r} on this host") from None
        groups = tuple(sorted(set(os.getgrouplist(user, gid))))
        return cls(user=user, uid=entry.pw_uid, gid=gid, groups=groups, home=entry.pw_dir)


def memlock_limit(value: str | int | None, field: str) -> int | None:
    """A locked-memory limit as a unit's ``LimitMEMLOCK=`` takes it (``infinity`` or bytes, as
    ``_gang.launch_problems`` checks it) -> the ``RLIMIT_MEMLOCK`` value; ``None`` leaves the limit alone."""
    if value is None or value == "":
        return None
    if str(value).strip() == "infinity":
        return resource.RLIM_INFINITY
    try:
        return integer(value, field, low=0, high=2**62)
    except ValidationError as exc:
        raise EngineSpecError(str(exc)) from None


def _set_memlock_closest(limit: int, hard: int) -> int:
    """Set this process's RLIMIT_MEMLOCK for a child to inherit, as systemd sets a unit's ``LimitMEMLOCK=``
    and returns the soft limit set: above the hard limit, both raised to ``limit``, else as close as this
    process may (the hard limit, where raising it is not allowed: no CAP_SYS_RESOURCE, as in a container);
    at or below it, the soft limit alone, so that the caller can put its own back without privileges."""
    if limit == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and limit > hard):
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
            return limit
        except (ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
            return hard
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, hard))
    return limit


def limit_text(limit: int) -> str:
    """``infinity`` or the bytes of a resource limit."""
    return "infinity" if limit == resource.RLIM_INFINITY else str(limit)


class EngineProcess:
    """One ``vllm serve`` process started in its own session/process group, as ``account`` when given,
    with ``memlock`` as its locked-memory limit when given (:func:`memlock_limit`)."""

    def __init__(self, argv: list[str], env: dict[str, str], log_file: str, account: Account | None = None,
                 memlock: int | None = None) -> None:
        self.argv = list(argv)
        self.env = env
        self.log_file = log_file
        self.account = account
        self.memlock = memlock
        # the locked-memory limit the engine got (memlock, or the closest this process could set)
        self.memlock_applied: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.stopped: StopResult | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        # a new file only, never through a link: the log lives in a directory of its own
        try:
            fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise EngineSpecError(f"engine log {self.log_file}: cannot create: {exc.strerror or exc}") from None
        # as the service's account: its ids, groups and home (working directory), as systemd starts the unit
        as_account: dict[str, t.Any] = {}
        if self.account is not None:
            as_account = {"user": self.account.uid, "group": self.account.gid, "extra_groups": list(self.account.groups),
                          "cwd": self.account.home if os.path.isdir(self.account.home) else "/"}
        # The child inherits the limit: set here just around its start (subprocess drops to the account
        # before any hook could raise a hard limit) and put back at once.
        kept = resource.getrlimit(resource.RLIMIT_MEMLOCK) if self.memlock is not None else None
        try:
            if self.memlock is not None and kept is not None:
                self.memlock_applied = _set_memlock_closest(self.memlock, kept[1])
            self.proc = subprocess.Popen(  # pylint: disable=consider-using-with
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                close_fds=True,
                **as_account,
            )
        except OSError as exc:
            raise EngineSpecError(f"cannot start {self.argv[0]}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
            if kept is not None:
                resource.setrlimit(resource.RLIMIT_MEMLOCK, kept)
        self.started_at = time.monotonic()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def read_log(self, limit: int | None = None) -> str:
        try:
            with open(self.log_file, "rb") as handle:
                if limit is not None:
                    handle.seek(0, os.SEEK_END)
                    size = handle.tell()
                    handle.seek(max(0, size - limit))
                data = handle.read()
        except OSError:
            return ""
        return data.decode("utf-8", "replace")

    def kill_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        # Members that left the group but stayed in the session.
        for pid in group_members(self.proc.pid):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, timeout: float = 30.0) -> StopResult:
        """SIGTERM the whole group, SIGKILL after ``timeout``; verify nothing remains."""
        if self.stopped is not None:
            return self.stopped
        start = time.monotonic()
        if self.proc is None:
            self.stopped = StopResult("none", 0.0, None, [])
            return self.stopped
        pgid = self.proc.pid
        used = "none"
        if self.proc.poll() is None or group_members(pgid):
            used = "SIGTERM"
            try:
                os.killpg(pgid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = start + timeout
            while time.monotonic() < deadline:
                self.proc.poll()
                if self.proc.returncode is not None and not group_members(pgid):
                    break
                time.sleep(0.1)
            if self.proc.poll() is None or group_members(pgid):
                used = "SIGKILL"
                self.kill_group(signal.SIGKILL)
                kill_deadline = time.monotonic() + 10.0
                while time.monotonic() < kill_deadline:
                    self.proc.poll()
                    if self.proc.returncode is not None and not group_members(pgid):
                        break
                    time.sleep(0.05)
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        self.stopped = StopResult(
            used, round(time.monotonic() - start, 3), self.proc.returncode, group_members(pgid)
        )
        return self.stopped


def http_get(host: str, port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """``GET`` on the engine; returns (status, body). Raises ``OSError`` when unreachable."""
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path, headers={"Accept": "*/*"})
        response = conn.getresponse()
        body = response.read().decode("utf-8", "replace")
        return response.status, body
    except http.client.HTTPException as exc:
        raise OSError(f"bad HTTP response from {host}:{port}{path}: {exc}") from exc
    finally:
        conn.close()


@dataclass
class HealthResult:
    status: str  # healthy | exited | timeout | failed_state
    seconds: float
    returncode: int | None = None
    detail: str = ""


def wait_healthy(
    host: str,
    port: int,
    *,
    timeout: float,
    is_alive: t.Callable[[], bool] | None = None,
    returncode: t.Callable[[], int | None] | None = None,
    failed_state: t.Callable[[], str | None] | None = None,
    interval: float = 0.5,
    clock: t.Callable[[], float] = time.monotonic,
) -> HealthResult:
    """Poll ``/health`` until 200, the deadline, or the engine giving up.

    ``is_alive`` (a process we started) or ``failed_state`` (a systemd unit:
    returns a description when the unit failed) are checked on every poll, so
    an engine that dies while booting is reported at once, not at the deadline.
    """
    start = clock()
    deadline = start + float(timeout)
    last = ""
    while True:
        if is_alive is not None and not is_alive():
            return HealthResult(
                "exited", round(clock() - start, 3), returncode() if returncode else None,
                "engine process exited before it became healthy",
            )
        if failed_state is not None:
            state = failed_state()
            if state:
                return HealthResult("failed_state", round(clock() - start, 3), None, state)
        try:
            status, _body = http_get(host, port, "/health", timeout=min(5.0, max(0.5, interval * 4)))
            if status == 200:
                return HealthResult("healthy", round(clock() - start, 3))
            last = f"/health answered HTTP {status}"
        except OSError as exc:
            last = f"/health unreachable: {exc}"
        if clock() >= deadline:
            return HealthResult("timeout", round(clock() - start, 3), None, last)
        time.sleep(interval)


def scrape_metrics(host: str, port: int, timeout: float = 10.0) -> tuple[EngineMetrics | None, str]:
    """``GET /metrics`` and parse it; (None, why) when that is not possible."""
    try:
        status, body = http_get(host, port, "/metrics", timeout=timeout)
    except OSError as exc:
        return None, f"/metrics unreachable: {exc}"
    if status != 200:
        return None, f"/metrics answered HTTP {status}"
    try:
        return parse_metrics(body), ""
    except MetricsParseError as exc:
        return None, f"/metrics is not Prometheus text: {exc}"
