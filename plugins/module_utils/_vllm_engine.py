# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Run one vLLM engine on loopback and judge it.

Plain Python (no Ansible import): ``vllm serve`` argv rendering, process
start/stop by process group, health wait that notices a dying engine, the
canary driver (boot, warm-up, load test, ``/metrics`` scrape, log parse,
stop), the canary verdict and its comparison with a profiled reference, and
the post-restart boot check used by ``vllm_boot_check``.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import typing as t
from dataclasses import dataclass, field

from ._load_test import LoadSpec, run_load_test
from ._validate import ValidationError, env_name, integer, is_secret_option, number, port as valid_port, text as v_text
from ._vllm_log import GIB_ROUNDING_BYTES, EngineLog, parse_engine_log
from ._vllm_metrics import EngineMetrics, MetricsParseError, parse_metrics

# Options the canary sets itself; a caller must not pass them in serve_args.
CONTROLLED_OPTIONS = frozenset(
    {
        "kv-cache-memory-bytes",
        "kv-cache-memory",
        "host",
        "port",
        "gpu-memory-utilization",
    }
)

# Environment variables that silently replace a manual KV byte budget.
BUDGET_OVERRIDING_ENV = ("VLLM_CPU_KVCACHE_SPACE",)

LOOPBACK = "127.0.0.1"
GIB = 1 << 30


class EngineSpecError(ValueError):
    """An argument the caller gave cannot produce a valid ``vllm serve`` call."""


# --------------------------------------------------------------------- argv


def option_name(key: str) -> str:
    """``max_model_len`` / ``--max-model-len`` -> ``max-model-len``."""
    name = str(key).strip()
    while name.startswith("-"):
        name = name[1:]
    return name.replace("_", "-")


def render_serve_args(serve_args: t.Mapping[str, t.Any] | None) -> list[str]:
    """Render a dict of ``vllm serve`` options as argv words.

    ``True`` gives a bare flag, ``False`` gives ``--no-<flag>`` (vLLM's boolean options
    are ``BooleanOptionalAction``s, and several default to on, e.g. prefix caching, so
    omitting a ``False`` would silently keep the default), ``None`` omits the option, a list gives
    the flag followed by its items (vLLM's ``nargs='+'`` options), a dict gives
    compact JSON (``--compilation-config '{...}'``), anything else ``str()``.
    Options the canary controls itself are refused.
    """
    argv: list[str] = []
    seen: dict[str, t.Any] = {}
    for key, value in sorted((serve_args or {}).items(), key=lambda item: option_name(item[0])):
        try:
            v_text(key, "serve_args option name")
        except ValidationError as exc:
            raise EngineSpecError(str(exc)) from None
        name = option_name(key)
        if not name or not _OPTION_RE.fullmatch(name):
            raise EngineSpecError(f"serve_args: option name {key!r}: use letters, digits, '-' and '_'")
        if not name:
            raise EngineSpecError(f"serve_args: empty option name {key!r}")
        if name in seen:
            raise EngineSpecError(f"serve_args: {seen[name]!r} and {key!r} are the same option")
        seen[name] = key
        if name in CONTROLLED_OPTIONS:
            raise EngineSpecError(
                f"serve_args: option {key!r} is set by the module itself "
                f"(use the module's own argument, not serve_args)"
            )
        flag = "--" + name
        if value is None:
            continue
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + name)
        elif isinstance(value, (list, tuple)):
            if not value:
                raise EngineSpecError(f"serve_args: option {key!r} is an empty list")
            argv.append(flag)
            argv.extend(_scalar(v, key) for v in value)
        elif isinstance(value, dict):
            argv.extend([flag, _scalar(value, key)])
        else:
            argv.extend([flag, _scalar(value, key)])
    return argv


_OPTION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")


def _scalar(value: t.Any, key: str) -> str:
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise EngineSpecError(f"serve_args.{key}: cannot be written as JSON: {exc}") from None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        raise EngineSpecError(f"serve_args: option {key!r} has a non-finite value")
    try:
        word = v_text(value, f"serve_args.{key}", allow_empty=True)
    except ValidationError as exc:
        raise EngineSpecError(str(exc)) from None
    if word.startswith("--"):
        # vLLM's argument parser would take it for an option of its own (--port, --api-key)
        raise EngineSpecError(f"serve_args.{key}: a value must not start with '--', got {word[:40]!r}")
    return word


def build_argv(
    executable: str,
    model: str,
    *,
    mode: str,
    port: int,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    serve_args: t.Mapping[str, t.Any] | None = None,
    host: str = LOOPBACK,
) -> list[str]:
    """The full ``vllm serve`` argv of one canary boot."""
    if mode not in ("profiled", "manual"):
        raise EngineSpecError(f"mode must be 'profiled' or 'manual', not {mode!r}")
    if not executable:
        raise EngineSpecError("executable is required")
    if not model:
        raise EngineSpecError("model is required")
    try:
        v_text(executable, "executable")
        v_text(model, "model")
        v_text(host, "host")
    except ValidationError as exc:
        raise EngineSpecError(str(exc)) from None
    if str(model).startswith("-"):
        raise EngineSpecError(f"model: must not start with '-' (vLLM would read it as an option), got {str(model)[:40]!r}")
    try:
        port = valid_port(port)
    except ValidationError as exc:
        raise EngineSpecError(str(exc)) from None
    argv = [str(executable), "serve", str(model), "--host", host, "--port", str(port)]
    if mode == "manual":
        if kv_cache_memory_bytes is None:
            raise EngineSpecError("mode=manual needs kv_cache_memory_bytes")
        if int(kv_cache_memory_bytes) <= 0:
            raise EngineSpecError(
                f"kv_cache_memory_bytes must be positive (vLLM treats {kv_cache_memory_bytes} as unset)"
            )
        argv += ["--kv-cache-memory-bytes", str(int(kv_cache_memory_bytes))]
    elif kv_cache_memory_bytes is not None:
        raise EngineSpecError("kv_cache_memory_bytes is only valid with mode=manual")
    if gpu_memory_utilization is not None:
        try:
            util = number(gpu_memory_utilization, "gpu_memory_utilization", low=0, high=1, low_open=True)
        except ValidationError as exc:
            raise EngineSpecError(f"{exc} (must be in (0, 1])") from None
        argv += ["--gpu-memory-utilization", repr(util)]
    argv += render_serve_args(serve_args)
    return argv


def engine_env(
    extra: t.Mapping[str, t.Any] | None,
    *,
    mode: str,
    cuda_visible_devices: str | None = None,
    base: t.Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Child environment: inherited + ``extra`` (+ ``CUDA_VISIBLE_DEVICES``).

    In manual mode a variable that silently replaces the byte budget is refused
    when given explicitly and dropped when merely inherited.
    """
    env = dict(os.environ if base is None else base)
    extra = dict(extra or {})
    if mode == "manual":
        for name in BUDGET_OVERRIDING_ENV:
            if name in extra:
                raise EngineSpecError(
                    f"env: {name} overrides --kv-cache-memory-bytes silently; "
                    "it cannot be used with mode=manual"
                )
            env.pop(name, None)
    for key, value in extra.items():
        try:
            name = env_name(key, "env")
        except ValidationError as exc:
            raise EngineSpecError(str(exc)) from None
        if isinstance(value, str) and "\0" in value:
            raise EngineSpecError(f"env.{name}: must not contain a NUL character")
        env[name] = "" if value is None else str(value)
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(cuda_visible_devices)
    return env


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, int(port))) == 0


# ------------------------------------------------------------------ process


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


class EngineProcess:
    """One ``vllm serve`` process started in its own session/process group, as ``account`` when given."""

    def __init__(self, argv: list[str], env: dict[str, str], log_file: str, account: Account | None = None) -> None:
        self.argv = list(argv)
        self.env = env
        self.log_file = log_file
        self.account = account
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
        try:
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


# ------------------------------------------------------------------- health


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


# ------------------------------------------------------------ log / metrics


def summarise_log(log: EngineLog) -> dict[str, t.Any]:
    """Per-rank figures, capacity and errors of a parsed engine log, as plain data."""
    ranks = []
    for rank, figs in sorted(log.ranks.items()):
        reserved = figs.reserved_kv_bytes
        if reserved is None and figs.cpu_kv_mode == "explicit":
            reserved = figs.cpu_kv_bytes
        ranks.append(
            {
                "rank": rank,
                "initial_free_bytes": figs.initial_free_bytes,
                "total_bytes": figs.total_bytes,
                "suggested_kv_bytes_fit": figs.suggested_kv_bytes_fit,
                "suggested_kv_bytes_full": figs.suggested_kv_bytes_full,
                "reserved_kv_bytes": reserved,
                "current_kv_bytes": figs.current_kv_bytes,
                "auto_kv_bytes": figs.cpu_kv_bytes if figs.cpu_kv_mode == "auto" else None,
                # the CPU build's way of sizing (explicit | auto); None on GPU builds
                "cpu_kv_mode": figs.cpu_kv_mode,
                "requested_bytes": figs.requested_bytes,
                "consumed_bytes": figs.consumed_bytes,
            }
        )
    capacity = log.capacity
    return {
        "recognised": log.recognised,
        "version": log.version,
        "ranks": ranks,
        "kv_cache_tokens": capacity.tokens if capacity else None,
        "max_concurrency": capacity.max_concurrency if capacity else None,
        "max_model_len": capacity.max_model_len if capacity else None,
        "device": capacity.device if capacity else None,
        "block_size": log.block_size,
        "num_blocks": log.num_gpu_blocks,
        "server_started": log.server_started,
        "errors": [
            {"kind": e.kind, "rank": e.rank, "message": e.message, "details": dict(e.details)}
            for e in log.errors
        ],
        "exceptions": [{"kind": e.kind, "rank": e.rank, "message": e.message} for e in log.exceptions],
        "suggestion_problems": [
            {"rank": p.rank, "kind": p.kind, "message": p.message} for p in log.suggestion_problems
        ],
        "init_engine_seconds": log.timings.init_engine_seconds,
    }


def primary_error(errors: t.Sequence[t.Mapping[str, t.Any]]) -> str | None:
    """The engine's own root-cause message: a recognised kind, else the first other exception
    of a traceback, before the generic "Engine core initialization failed"."""
    specific = [e for e in errors if e.get("kind") not in ("engine_init_failed", "exception")]
    other = [e for e in errors if e.get("kind") == "exception"]
    chosen = (specific or other or list(errors))[:1]
    if not chosen:
        return None
    err = chosen[0]
    return f"rank {err.get('rank', 0)}: {err.get('message')}"


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


def capacity_figures(log: dict[str, t.Any], metrics: EngineMetrics | None) -> dict[str, t.Any]:
    """Blocks, block size, tokens and concurrency: ``/metrics`` (exact) first, then the log."""
    out: dict[str, t.Any] = {
        "num_blocks": None,
        "block_size": None,
        "kv_cache_tokens": None,
        "max_concurrency": None,
        "kv_cache_memory_bytes": None,
        "source": None,
    }
    if metrics is not None and metrics.cache_config:
        out.update(
            num_blocks=metrics.num_gpu_blocks,
            block_size=metrics.block_size,
            kv_cache_tokens=metrics.kv_cache_size_tokens,
            max_concurrency=metrics.kv_cache_max_concurrency,
            kv_cache_memory_bytes=metrics.kv_cache_memory_bytes,
            source="metrics",
        )
    for key, log_key in (
        ("num_blocks", "num_blocks"),
        ("block_size", "block_size"),
        ("kv_cache_tokens", "kv_cache_tokens"),
        ("max_concurrency", "max_concurrency"),
    ):
        if out[key] is None and log.get(log_key) is not None:
            out[key] = log[log_key]
            out["source"] = out["source"] or "log"
    if out["num_blocks"] is None and out["kv_cache_tokens"] and out["block_size"]:
        out["num_blocks"] = out["kv_cache_tokens"] // out["block_size"]
    return out


# ------------------------------------------------------------------ verdict


@dataclass
class Tolerances:
    token_ratio: float = 0.9
    latency_ratio: float = 1.5
    preemptions: int = 0

    @classmethod
    def from_dict(cls, data: t.Mapping[str, t.Any] | None) -> Tolerances:
        data = {k: v for k, v in (data or {}).items() if v is not None}
        unknown = sorted(set(data) - {"token_ratio", "latency_ratio", "preemptions"})
        if unknown:
            raise EngineSpecError(f"tolerances: unknown field(s) {', '.join(map(str, unknown))}")
        try:
            if "token_ratio" in data:
                data["token_ratio"] = number(data["token_ratio"], "tolerances.token_ratio", low=0)
            if "latency_ratio" in data:
                data["latency_ratio"] = number(data["latency_ratio"], "tolerances.latency_ratio", low=0, low_open=True)
            if "preemptions" in data:
                data["preemptions"] = integer(data["preemptions"], "tolerances.preemptions", low=0)
        except ValidationError as exc:
            raise EngineSpecError(str(exc)) from None
        return cls(**data)


def _ratio(value: t.Any, ref: t.Any) -> float | None:
    if not isinstance(value, (int, float)) or not isinstance(ref, (int, float)) or ref <= 0:
        return None
    return round(float(value) / float(ref), 4)


def compare_with_reference(
    result: t.Mapping[str, t.Any],
    reference: t.Mapping[str, t.Any],
    tolerances: Tolerances,
) -> dict[str, t.Any]:
    """Compare a canary with a profiled canary under the same request mix.

    Returns ``{"verdict": pass|fail|inconclusive, "reasons": [...], ...figures}``.
    """
    fails: list[str] = []
    unsure: list[str] = []
    load = result.get("load") or {}
    ref_load = reference.get("load") or {}
    out: dict[str, t.Any] = {
        "reference_mode": reference.get("mode"),
        "token_ratio": _ratio(result.get("kv_cache_tokens"), reference.get("kv_cache_tokens")),
        "ttft_p95_ratio": _ratio(load.get("ttft_p95"), ref_load.get("ttft_p95")),
        "e2e_p95_ratio": _ratio(load.get("e2e_p95"), ref_load.get("e2e_p95")),
        "preemptions": result.get("preemptions"),
        "reference_preemptions": reference.get("preemptions"),
        "tolerances": {
            "token_ratio": tolerances.token_ratio,
            "latency_ratio": tolerances.latency_ratio,
            "preemptions": tolerances.preemptions,
        },
    }
    if reference.get("mode") not in (None, "profiled"):
        unsure.append(f"the reference is a {reference.get('mode')} canary, not a profiled one")
    if reference.get("verdict") not in (None, "pass"):
        unsure.append(f"the reference canary's own verdict is {reference.get('verdict')!r}")
    mix = ("requests", "concurrency", "prompt_tokens", "max_tokens")
    diff = [f"{k} {load.get(k)} vs {ref_load.get(k)}" for k in mix if load.get(k) != ref_load.get(k)]
    if diff:
        unsure.append("request mix differs from the reference: " + ", ".join(diff))
    ratio = out["token_ratio"]
    if ratio is None:
        unsure.append("KV cache tokens missing here or in the reference")
    elif ratio < tolerances.token_ratio:
        fails.append(
            f"KV cache tokens {result.get('kv_cache_tokens')} are {ratio:.4f} of the reference's "
            f"{reference.get('kv_cache_tokens')}, below the tolerated {tolerances.token_ratio}"
        )
    if isinstance(load.get("failed"), int) and isinstance(ref_load.get("failed"), int) and load["failed"] > ref_load["failed"]:
        fails.append(f"{load['failed']} failed requests, the reference had {ref_load['failed']}")
    pre, ref_pre = result.get("preemptions"), reference.get("preemptions")
    if isinstance(pre, (int, float)) and isinstance(ref_pre, (int, float)):
        if pre > ref_pre + tolerances.preemptions:
            fails.append(
                f"{int(pre)} preemptions against the reference's {int(ref_pre)} "
                f"(tolerated extra: {tolerances.preemptions})"
            )
    else:
        unsure.append("preemption counts missing here or in the reference")
    for name, label in (("ttft_p95_ratio", "TTFT p95"), ("e2e_p95_ratio", "e2e latency p95")):
        value = out[name]
        if value is None:
            unsure.append(f"{label} missing here or in the reference")
        elif value > tolerances.latency_ratio:
            fails.append(
                f"{label} is {value:.2f}x the reference's, above the tolerated {tolerances.latency_ratio}x"
            )
    out["verdict"] = "fail" if fails else ("inconclusive" if unsure else "pass")
    out["reasons"] = fails + unsure
    return out


def _seconds(value: t.Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def judge_canary(
    result: t.Mapping[str, t.Any],
    *,
    requested_kv_bytes: int | None,
    tolerances: Tolerances,
    reference: t.Mapping[str, t.Any] | None = None,
) -> tuple[str, list[str], dict[str, t.Any] | None]:
    """Verdict of one canary run from its figures: (verdict, reasons, comparison)."""
    fails: list[str] = []
    unsure: list[str] = []
    health = result.get("health")
    errors = result.get("engine_errors") or []
    root = primary_error(errors)
    if health != "healthy":
        what = {
            "exited": f"the engine exited while booting (exit code {result.get('exit_code')})",
            "timeout": f"the engine was not healthy within {_seconds(result.get('startup_timeout'))} s",
        }.get(str(health), f"the engine did not become healthy ({health})")
        fails.append(what + (f": {root}" if root else ""))
        return "fail", fails, None
    if root:
        fails.append(f"the engine reported an error: {root}")
    for problem in result.get("suggestion_problems") or []:
        fails.append(problem.get("message", ""))
    if result.get("died_during_load"):
        fails.append(f"the engine died during the load test (exit code {result.get('exit_code')})")
    load = result.get("load") or {}
    if load.get("warmup_ok") is False:
        fails.append("a warm-up request failed: " + "; ".join((load.get("errors") or [])[:1]))
    if load.get("failed"):
        fails.append(f"{load['failed']} of {load.get('requests')} load-test requests failed: "
                     + "; ".join((load.get("errors") or [])[:3]))
    pre = result.get("preemptions")
    if isinstance(pre, (int, float)) and pre > tolerances.preemptions:
        fails.append(f"{int(pre)} preemptions during the load test (tolerated: {tolerances.preemptions})")
    if requested_kv_bytes is not None:
        exact = result.get("kv_cache_memory_bytes")
        if exact is not None and int(exact) != int(requested_kv_bytes):
            fails.append(
                f"/metrics reports kv_cache_memory_bytes={exact}, the canary requested {requested_kv_bytes}"
            )
        for rank in result.get("ranks") or []:
            reserved = rank.get("reserved_kv_bytes")
            if reserved is not None and abs(int(reserved) - int(requested_kv_bytes)) > GIB_ROUNDING_BYTES:
                fails.append(
                    f"rank {rank.get('rank')}: the log reports {reserved} bytes reserved for KV cache, "
                    f"the canary requested {requested_kv_bytes}"
                )
        if exact is None and not any(r.get("reserved_kv_bytes") is not None for r in result.get("ranks") or []):
            unsure.append("neither /metrics nor the log confirmed the reserved KV bytes")
    if result.get("kv_cache_tokens") is None:
        unsure.append("the KV cache size (tokens) was found neither in /metrics nor in the log")
    if not load.get("requests"):
        unsure.append("no load test was run")
    elif not load.get("completed") and not load.get("failed"):
        unsure.append("the load test produced no result")
    if result.get("preemptions") is None and load.get("requests"):
        unsure.append("preemptions unknown (/metrics not readable before and after the load test)")
    comparison = None
    if reference:
        comparison = compare_with_reference(result, reference, tolerances)
        if comparison["verdict"] == "fail":
            fails.extend(comparison["reasons"])
        elif comparison["verdict"] == "inconclusive":
            unsure.extend(comparison["reasons"])
    if fails:
        return "fail", fails + unsure, comparison
    if unsure:
        return "inconclusive", unsure, comparison
    return "pass", [], comparison


# ------------------------------------------------------------------- canary

def redact_argv(argv: t.Sequence[str]) -> list[str]:
    """argv with the value of every secret-looking option replaced."""
    out: list[str] = []
    hide_next = False
    for word in argv:
        if hide_next:
            out.append("********")
            hide_next = False
            continue
        if word.startswith("--") and is_secret_option(word):
            if "=" in word:
                out.append(word.split("=", 1)[0] + "=********")
                continue
            hide_next = True
        out.append(word)
    return out


def api_key_of(serve_args: t.Mapping[str, t.Any] | None, env: t.Mapping[str, t.Any] | None) -> str | None:
    """The API key the engine will demand on ``/v1`` routes, if any."""
    for key, value in (serve_args or {}).items():
        if option_name(key) == "api-key" and value:
            return str(value[0] if isinstance(value, (list, tuple)) else value)
    value = (env or {}).get("VLLM_API_KEY")
    return str(value) if value else None


@dataclass
class CanarySpec:
    executable: str
    model: str
    mode: str = "profiled"
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    serve_args: dict[str, t.Any] = field(default_factory=dict)
    env: dict[str, t.Any] = field(default_factory=dict)
    port: int | None = None
    startup_timeout: float = 900.0
    stop_timeout: float = 30.0
    load: LoadSpec = field(default_factory=LoadSpec)
    reference: dict[str, t.Any] | None = None
    tolerances: Tolerances = field(default_factory=Tolerances)
    log_path: str | None = None
    cuda_visible_devices: str | None = None
    host: str = LOOPBACK
    health_interval: float = 0.5
    # the service's account (user, optional group): the engine runs as it, with its caches
    user: str | None = None
    group: str | None = None


def _without_api_key(serve_args: t.Mapping[str, t.Any] | None) -> dict[str, t.Any]:
    """serve_args less ``api_key``: the canary hands the key over in ``VLLM_API_KEY`` (never in argv)."""
    return {k: v for k, v in (serve_args or {}).items() if option_name(k) != "api-key"}


def canary_argv(spec: CanarySpec, port: int) -> list[str]:
    """The canary's argv; an ``api_key`` serve option is not in it (see :func:`canary_env`)."""
    return build_argv(
        spec.executable,
        spec.model,
        mode=spec.mode,
        port=port,
        kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        serve_args=_without_api_key(spec.serve_args),
        host=spec.host,
    )


def canary_env(spec: CanarySpec, base: t.Mapping[str, str] | None = None) -> dict[str, str]:
    """The canary's environment: ``spec.env``, plus ``VLLM_API_KEY`` from an ``api_key`` serve option.

    vLLM reads the key from ``VLLM_API_KEY``; in argv it would be readable by every user
    of the host in ``/proc/PID/cmdline``.
    """
    extra = dict(spec.env or {})
    key = api_key_of(spec.serve_args, None)
    if key:
        extra["VLLM_API_KEY"] = key
    return engine_env(extra, mode=spec.mode, cuda_visible_devices=spec.cuda_visible_devices, base=base)


def _tail(text: str, lines: int = 60, limit: int = 12000) -> str:
    tail = "\n".join(text.splitlines()[-lines:])
    return tail[-limit:]


def _place_log(partial: str, final: str) -> str | None:
    """Move the finished log to ``final`` atomically; keep an existing one as ``.previous``.

    ``rename(2)`` replaces a symlink at ``final`` (or ``.previous``) by the file itself,
    it never writes through it; the private directory of the partial log is removed.
    """
    previous = None
    try:
        if os.path.lexists(final):
            previous = final + ".previous"
            os.replace(final, previous)
        os.replace(partial, final)
    except OSError as exc:
        raise EngineSpecError(f"log_path {final}: cannot place the engine log: {exc.strerror or exc}") from None
    finally:
        _remove_private_dir(os.path.dirname(partial))
    return previous


def _private_log(directory: str | None) -> str:
    """A log path inside a new private (0700) directory: nothing there can be a planted link."""
    try:
        private = tempfile.mkdtemp(prefix=".vllm-canary-", dir=directory)
    except OSError as exc:
        raise EngineSpecError(f"log_path: cannot create a private directory in {directory}: {exc.strerror or exc}") from None
    return os.path.join(private, "engine.log")


def _remove_private_dir(private: str) -> None:
    try:
        for name in os.listdir(private):
            os.unlink(os.path.join(private, name))
        os.rmdir(private)
    except OSError:
        pass


class Terminated(Exception):
    """The canary itself was asked to stop (SIGTERM/SIGHUP) while an engine ran."""


def _raise_on_termination() -> t.Callable[[], None]:
    """Turn SIGTERM/SIGHUP into an exception so ``finally`` stops the engine; returns the restorer."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, _frame: t.Any) -> None:
        raise Terminated(f"the canary received signal {signum}; the engine was stopped")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def run_canary(
    spec: CanarySpec,
    *,
    after_healthy: t.Callable[[EngineProcess, int], None] | None = None,
    during_load: t.Callable[[EngineProcess], None] | None = None,
) -> dict[str, t.Any]:
    """Boot one engine on loopback, warm it up, load it, scrape it, stop it, judge it.

    Nothing is left running whatever happens (the process group is stopped in
    ``finally``). ``after_healthy`` runs once the engine answers ``/health``;
    ``during_load`` runs in a thread when the measured load starts.
    """
    spec.load.validate()
    account = Account.lookup(spec.user, spec.group) if spec.user else None
    wall_start = time.monotonic()
    port = int(spec.port) if spec.port else free_port(spec.host)
    if port_in_use(port, spec.host):
        raise EngineSpecError(f"port {port} on {spec.host} is already in use")
    argv = canary_argv(spec, port)
    env = canary_env(spec)
    headers = None
    key = api_key_of(spec.serve_args, spec.env)
    if key:
        headers = {"Authorization": f"Bearer {key}"}

    if spec.log_path:
        directory = os.path.dirname(os.path.abspath(spec.log_path))
        if not os.path.isdir(directory):
            raise EngineSpecError(f"log_path: directory {directory} does not exist")
        if os.path.isdir(spec.log_path) and not os.path.islink(spec.log_path):
            raise EngineSpecError(f"log_path: {spec.log_path} is a directory")
        partial = _private_log(directory)
    else:
        partial = _private_log(None)

    result: dict[str, t.Any] = {
        "mode": spec.mode,
        "argv": redact_argv(argv),
        "port": port,
        "startup_timeout": spec.startup_timeout,
        "requested_kv_cache_memory_bytes": spec.kv_cache_memory_bytes,
        "load": {**spec.load.shape(), "completed": 0, "failed": 0},
        "preemptions": None,
        "died_during_load": False,
    }
    engine = EngineProcess(argv, env, partial, account)
    metrics_after: EngineMetrics | None = None
    metrics_notes: list[str] = []
    load_seconds = 0.0
    restore = _raise_on_termination()
    try:
        engine.start()
        result["pid"] = engine.pid
        health = wait_healthy(
            spec.host, port, timeout=spec.startup_timeout, is_alive=engine.alive,
            returncode=engine.poll, interval=spec.health_interval,
        )
        result["health"] = health.status
        result["startup_seconds"] = health.seconds
        if health.status == "healthy":
            if after_healthy is not None:
                after_healthy(engine, port)
            scraped: list[EngineMetrics | None] = []

            def start_hook() -> None:
                # After warm-up, before the measured requests.
                before_metrics, why = scrape_metrics(spec.host, port)
                scraped.append(before_metrics)
                if why:
                    metrics_notes.append("before load: " + why)
                if during_load is not None:
                    threading.Thread(target=during_load, args=(engine,), daemon=True).start()

            load_start = time.monotonic()
            load = run_load_test(spec.host, port, spec.model, spec.load, on_start=start_hook, headers=headers)
            load_seconds = time.monotonic() - load_start
            result["load"] = load.as_dict()
            result["died_during_load"] = not engine.alive()
            metrics_after, why = scrape_metrics(spec.host, port)
            if why:
                metrics_notes.append("after load: " + why)
            before = scraped[0] if scraped else None
            if (
                before is not None and metrics_after is not None
                and before.preemptions_total is not None and metrics_after.preemptions_total is not None
            ):
                result["preemptions"] = int(metrics_after.preemptions_total - before.preemptions_total)
        else:
            result["health_detail"] = health.detail
    finally:
        stop = engine.stop(spec.stop_timeout)
        restore()
        result["stop"] = {
            "signal": stop.signal_used,
            "seconds": stop.seconds,
            "leftover_pids": stop.leftover_pids,
        }
        result["exit_code"] = stop.returncode if stop.returncode is not None else engine.poll()
        text = engine.read_log()
        if spec.log_path:
            result["log_path"] = spec.log_path
            result["previous_log_path"] = _place_log(partial, spec.log_path)
        else:
            _remove_private_dir(os.path.dirname(partial))

    log = summarise_log(parse_engine_log(text))
    result["log_recognised"] = log["recognised"]
    result["vllm_version"] = log["version"]
    result["ranks"] = [
        {k: r[k] for k in ("rank", "initial_free_bytes", "suggested_kv_bytes_fit", "suggested_kv_bytes_full",
                           "reserved_kv_bytes", "current_kv_bytes", "auto_kv_bytes", "total_bytes")}
        for r in log["ranks"]
    ]
    result["engine_errors"] = log["errors"]
    result["suggestion_problems"] = log["suggestion_problems"]
    capacity = capacity_figures(log, metrics_after)
    result.update(
        num_blocks=capacity["num_blocks"],
        block_size=capacity["block_size"],
        kv_cache_tokens=capacity["kv_cache_tokens"],
        max_concurrency=capacity["max_concurrency"],
        kv_cache_memory_bytes=capacity["kv_cache_memory_bytes"],
        capacity_source=capacity["source"],
        log_kv_cache_tokens=log["kv_cache_tokens"],
        max_model_len=log["max_model_len"],
    )
    if metrics_notes:
        result["metrics_notes"] = metrics_notes
    if stop.leftover_pids:
        result.setdefault("engine_errors", []).append(
            {"kind": "leftover_processes", "rank": None, "details": {},
             "message": f"processes {stop.leftover_pids} of the engine survived SIGKILL"}
        )
    verdict, reasons, comparison = judge_canary(
        result, requested_kv_bytes=spec.kv_cache_memory_bytes if spec.mode == "manual" else None,
        tolerances=spec.tolerances, reference=spec.reference,
    )
    result["verdict"] = verdict
    result["reasons"] = reasons
    result["comparison"] = comparison
    result["load_seconds"] = round(load_seconds, 3)
    result["wall_seconds"] = round(time.monotonic() - wall_start, 3)
    if verdict != "pass":
        result["log_tail"] = _tail(text)
    return result


# --------------------------------------------------------------- boot check


def _rank_floor(floor: int | t.Mapping[t.Any, t.Any] | None, rank: int) -> int | None:
    if floor is None:
        return None
    if isinstance(floor, t.Mapping):
        for key, value in floor.items():
            if int(key) == rank:
                return int(value)
        return None
    return int(floor)


def _cpu_build(log: t.Mapping[str, t.Any], rank: t.Mapping[str, t.Any]) -> bool:
    """Whether this boot's log is the CPU build's (its KV line per node, or a CPU capacity line)."""
    return bool(rank.get("cpu_kv_mode")) or log.get("device") == "CPU"


def evaluate_boot(
    log: t.Mapping[str, t.Any],
    metrics: EngineMetrics | None,
    *,
    expected_kv_cache_memory_bytes: int | None = None,
    free_floor_bytes: int | t.Mapping[t.Any, t.Any] | None = None,
    min_tokens: int | None = None,
    metrics_error: str = "",
) -> dict[str, t.Any]:
    """Judge one boot from its parsed log (``summarise_log``) and ``/metrics``.

    Logged GiB figures carry two decimals, so log comparisons allow half a unit
    (``GIB_ROUNDING_BYTES``); ``/metrics`` figures are exact and compared exactly.
    A floor the log cannot show because the engine does not measure it (the CPU build) is a
    check with ``applicable: false`` and its reason in ``not_applicable``, neither passed nor failed.
    Returns ``{"ok": bool, "reasons": [...], "checks": [...], "not_applicable": [...]}``.
    """
    checks: list[dict[str, t.Any]] = []
    reasons: list[str] = []
    not_applicable: list[str] = []

    def check(name: str, ok: bool, reason: str, rank: int | None = None, **figures: t.Any) -> None:
        checks.append({"check": name, "rank": rank, "ok": ok, **figures})
        if not ok:
            reasons.append(reason)

    for err in log.get("errors") or []:
        check("engine_error", False, f"rank {err.get('rank')}: engine error ({err.get('kind')}): {err.get('message')}",
              rank=err.get("rank"), kind=err.get("kind"))
    ranks = list(log.get("ranks") or [])
    if not log.get("recognised"):
        check("log_recognised", False, "no vLLM startup line was recognised in this boot's log")
    if expected_kv_cache_memory_bytes is not None:
        expected = int(expected_kv_cache_memory_bytes)
        if not ranks:
            check("reserved_kv_bytes", False,
                  f"this boot's log has no per-rank KV cache line; cannot confirm {expected} bytes were reserved")
        for rank in ranks:
            got = rank.get("reserved_kv_bytes")
            num = rank.get("rank")
            if got is None:
                check("reserved_kv_bytes", False,
                      f"rank {num}: the log shows no KV cache reserved from kv_cache_memory_bytes "
                      f"(expected {expected} bytes); the engine did not use the manual budget",
                      rank=num, expected=expected, actual=None)
            else:
                ok = abs(int(got) - expected) <= GIB_ROUNDING_BYTES
                check("reserved_kv_bytes", ok,
                      f"rank {num}: reserved {got} bytes for KV cache (log, +/- {GIB_ROUNDING_BYTES}), "
                      f"expected {expected}", rank=num, expected=expected, actual=int(got))
        if metrics is not None and metrics.cache_config:
            got = metrics.kv_cache_memory_bytes
            check("metrics_kv_cache_memory_bytes", got == expected,
                  f"/metrics cache_config_info kv_cache_memory_bytes={got}, expected {expected}",
                  expected=expected, actual=got)
        else:
            check("metrics_kv_cache_memory_bytes", False,
                  "cannot cross-check kv_cache_memory_bytes: " + (metrics_error or "no cache_config_info in /metrics"),
                  expected=expected, actual=None)
    if free_floor_bytes is not None:
        floor_ranks = ranks or [{"rank": 0}]
        for rank in floor_ranks:
            num = int(rank.get("rank") or 0)
            floor = _rank_floor(free_floor_bytes, num)
            if floor is None:
                check("free_floor", False, f"rank {num}: no free-memory floor given for this rank", rank=num)
                continue
            free = rank.get("initial_free_bytes")
            if free is None and _cpu_build(log, rank):
                # vLLM's CPU build sizes its KV cache from the NUMA node's memory and logs no
                # initial free memory of a device: there is no figure to hold against the floor.
                # Say so (never a silent pass): the NVML floor is the boot gate's job before the start.
                why = (f"rank {num}: free-memory floor of {floor} bytes not applicable: the CPU build logs no "
                       "initial free device memory (it sizes its KV cache from the NUMA node's memory)")
                checks.append({"check": "free_floor", "rank": num, "ok": True, "applicable": False,
                               "floor": floor, "actual": None, "why": why})
                not_applicable.append(why)
                continue
            if free is None:
                check("free_floor", False,
                      f"rank {num}: the log shows no initial free memory; cannot verify the floor of {floor} bytes",
                      rank=num, floor=floor, actual=None)
            else:
                ok = int(free) + GIB_ROUNDING_BYTES >= floor
                check("free_floor", ok,
                      f"rank {num}: initial free memory {free} bytes (log) is below the floor {floor} bytes",
                      rank=num, floor=floor, actual=int(free))
        if isinstance(free_floor_bytes, t.Mapping) and ranks:
            seen = {int(r.get("rank") or 0) for r in ranks}
            for key in free_floor_bytes:
                if int(key) not in seen:
                    check("free_floor", False, f"rank {int(key)}: has a floor but printed no figures in this boot's log",
                          rank=int(key))
    log_tokens = log.get("kv_cache_tokens")
    metric_tokens = metrics.kv_cache_size_tokens if metrics is not None else None
    tokens = metric_tokens if metric_tokens is not None else log_tokens
    if log_tokens is not None and metric_tokens is not None:
        check("tokens_consistent", log_tokens == metric_tokens,
              f"the log reports {log_tokens} KV cache tokens, /metrics {metric_tokens}",
              log=log_tokens, metrics=metric_tokens)
    if min_tokens is not None:
        if tokens is None:
            check("min_tokens", False,
                  f"the KV cache size in tokens is in neither the log nor /metrics; cannot verify >= {min_tokens}",
                  expected=int(min_tokens), actual=None)
        else:
            check("min_tokens", int(tokens) >= int(min_tokens),
                  f"KV cache holds {tokens} tokens, fewer than the {min_tokens} the plan needs",
                  expected=int(min_tokens), actual=int(tokens))
    return {"ok": not reasons, "reasons": reasons, "checks": checks, "kv_cache_tokens": tokens,
            "not_applicable": not_applicable}


BOOT_MARKER = "non-default args:"


def last_boot(text: str) -> str:
    """The part of a log file written by the latest boot (from its last ``non-default args`` line)."""
    lines = text.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        if BOOT_MARKER in lines[index]:
            # Keep the banner lines printed just before it by the same boot.
            start = index
            while start > 0 and "api_utils.py" in lines[start - 1]:
                start -= 1
            return "\n".join(lines[start:])
    return text


Runner = t.Callable[["list[str]"], "tuple[int, str, str]"]


def run_command(argv: list[str]) -> tuple[int, str, str]:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


class Systemd:
    """The few ``systemctl``/``journalctl`` calls a boot check needs (runner injectable)."""

    PROPS = ("LoadState", "ActiveState", "SubState", "Result", "NRestarts",
             "ExecMainStartTimestamp", "ActiveEnterTimestamp", "ExecMainPID")

    def __init__(self, runner: Runner = run_command, systemctl: str = "systemctl", journalctl: str = "journalctl") -> None:
        self.runner = runner
        self.systemctl = systemctl
        self.journalctl = journalctl

    def show(self, unit: str, unix_time: bool = True) -> dict[str, str]:
        argv = [self.systemctl, "show", unit, "--property=" + ",".join(self.PROPS)]
        if unix_time:
            argv.append("--timestamp=unix")
        rc, out, err = self.runner(argv)
        if rc != 0 and unix_time:
            return self.show(unit, unix_time=False)
        if rc != 0:
            raise EngineSpecError(f"systemctl show {unit} failed (rc {rc}): {err.strip()}")
        props: dict[str, str] = {}
        for line in out.splitlines():
            if "=" in line:
                key, value = line.split("=", 1)
                props[key] = value
        return props

    def failed_state(self, unit: str) -> str | None:
        props = self.show(unit)
        active, sub = props.get("ActiveState", ""), props.get("SubState", "")
        if props.get("LoadState") == "not-found":
            return f"unit {unit} does not exist"
        if active == "failed" or sub == "auto-restart" or active == "inactive":
            return (f"unit {unit} is {active} ({sub}), result {props.get('Result', '?')}, "
                    f"restarts {props.get('NRestarts', '?')}")
        return None

    def journal(self, unit: str) -> tuple[str, str]:
        """(text of this start's journal, the --since used)."""
        props = self.show(unit)
        since = props.get("ExecMainStartTimestamp") or props.get("ActiveEnterTimestamp") or ""
        argv = [self.journalctl, "-u", unit, "-o", "cat", "--no-pager"]
        if since and since not in ("n/a", "0"):
            argv += ["--since", since]
        rc, out, err = self.runner(argv)
        if rc != 0:
            raise EngineSpecError(f"journalctl -u {unit} failed (rc {rc}): {err.strip()}")
        return out, since


@dataclass
class BootCheckSpec:
    unit: str | None = None
    host: str = LOOPBACK
    port: int = 8000
    expected_kv_cache_memory_bytes: int | None = None
    free_floor_bytes: int | dict[t.Any, t.Any] | None = None
    min_tokens: int | None = None
    timeout: float = 900.0
    journal: bool = True
    log_path: str | None = None
    interval: float = 1.0


def run_boot_check(spec: BootCheckSpec, systemd: Systemd | None = None) -> dict[str, t.Any]:
    """Wait for health (failing fast when the unit fails), then judge this boot."""
    if spec.unit is None and spec.log_path is None:
        raise EngineSpecError("give a systemd unit (with journal) or a log_path to read the engine log from")
    if spec.journal and spec.unit is None:
        raise EngineSpecError("journal=true needs a unit")
    if not spec.journal and spec.log_path is None:
        raise EngineSpecError("journal=false needs a log_path")
    systemd = systemd or Systemd()
    unit = spec.unit
    failed_state = (lambda: systemd.failed_state(unit)) if unit else None
    health = wait_healthy(spec.host, spec.port, timeout=spec.timeout, failed_state=failed_state, interval=spec.interval)
    result: dict[str, t.Any] = {"health": health.status, "startup_wait_seconds": health.seconds,
                                "url": f"http://{spec.host}:{spec.port}"}
    if health.detail:
        result["health_detail"] = health.detail
    if spec.journal:
        text, since = systemd.journal(spec.unit or "")
        result["log_source"] = f"journal of {spec.unit} since {since or 'the beginning'}"
    else:
        try:
            with open(spec.log_path or "", "rb") as handle:
                text = last_boot(handle.read().decode("utf-8", "replace"))
        except OSError as exc:
            raise EngineSpecError(f"log_path {spec.log_path}: {exc.strerror or exc}") from exc
        result["log_source"] = f"{spec.log_path} (latest boot)"
    log = summarise_log(parse_engine_log(text))
    result["engine_errors"] = log["errors"]
    result["ranks"] = log["ranks"]
    if health.status != "healthy":
        root = primary_error(log["errors"] + log["exceptions"])
        what = {
            "timeout": f"not healthy within {spec.timeout} s ({health.detail})",
            "failed_state": health.detail,
        }.get(health.status, health.detail)
        result.update(ok=False, reasons=[what + (f": {root}" if root else "")], checks=[],
                      log_tail=_tail(text))
        return result
    metrics, why = scrape_metrics(spec.host, spec.port)
    verdict = evaluate_boot(
        log, metrics, expected_kv_cache_memory_bytes=spec.expected_kv_cache_memory_bytes,
        free_floor_bytes=spec.free_floor_bytes, min_tokens=spec.min_tokens, metrics_error=why,
    )
    result.update(verdict)
    result["kv_cache_memory_bytes"] = metrics.kv_cache_memory_bytes if metrics else None
    result["num_blocks"] = (metrics.num_gpu_blocks if metrics else None) or log["num_blocks"]
    if not verdict["ok"]:
        result["log_tail"] = _tail(text)
    return result
