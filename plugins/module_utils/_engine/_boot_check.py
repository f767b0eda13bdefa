# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Judging a boot: an engine log summarised as plain data, the capacity from ``/metrics`` (exact)
then the log, and the post-restart boot check of ``vllm_boot_check`` (health while watching the
unit, this start's journal, the plan's expectations: reserved bytes, free-memory floors, tokens).

Plain Python (no Ansible import).
"""

from __future__ import annotations

import math
import subprocess
import time
import typing as t
from dataclasses import dataclass, field

from .._gate._floor_check import rank_floor
from ._engine_process import HealthResult, base_url, scrape_metrics, wait_healthy
from ._serve_argv import LOOPBACK, EngineSpecError
from ._vllm_log import GIB_ROUNDING_BYTES, EngineLog, member_rank_offset, parse_engine_log
from ._vllm_metrics import EngineMetrics

# How long a start may take to answer /health when the inventory does not say (timeout 0): the
# class's profiled canary measured this model's boot on this runtime, and a unit's start is the
# same boot (weights, torch.compile, CUDA graphs) on a host that may be busier or whose compile
# cache is cold after a runtime switch: three times that, never under ten minutes. Without a
# measurement: 15 minutes for an eager engine, 30 with torch.compile and CUDA-graph capture,
# which on a 70B+ model takes longer than loading its weights.
BOOT_TIMEOUT_FACTOR = 3
BOOT_TIMEOUT_MIN_SECONDS = 600
UNMEASURED_BOOT_TIMEOUT_SECONDS = {True: 900, False: 1800}  # by --enforce-eager


def boot_timeout(configured: t.Any, measured_seconds: t.Any = None, enforce_eager: t.Any = False,
                 field: str = "boot_timeout") -> tuple[int, str]:
    """Seconds a start may take to answer /health, and where that figure comes from.

    ``configured`` > 0 is the operator's and wins; 0 derives it: from ``measured_seconds`` (the
    class's profiled canary's boot) when known, else from ``enforce_eager``.
    """
    if isinstance(configured, bool):
        raise EngineSpecError(f"{field}: expected a number of seconds (0 derives it), got {configured!r}")
    try:
        seconds = float(configured)
    except (TypeError, ValueError):
        raise EngineSpecError(f"{field}: expected a number of seconds (0 derives it), got {configured!r}") from None
    if seconds < 0 or math.isnan(seconds):
        raise EngineSpecError(f"{field}: expected 0 (derived) or a positive number of seconds, got {configured!r}")
    if seconds > 0:
        return int(-(-seconds // 1)), f"{field} {int(-(-seconds // 1))} s (set in the inventory)"
    measured = None
    if measured_seconds is not None and not isinstance(measured_seconds, bool):
        try:
            measured = float(measured_seconds)
        except (TypeError, ValueError):
            measured = None
    if measured is not None and measured > 0:
        derived = max(BOOT_TIMEOUT_MIN_SECONDS, int(-(-(BOOT_TIMEOUT_FACTOR * measured) // 1)))
        return derived, (f"{field} {derived} s: {BOOT_TIMEOUT_FACTOR} x the {round(measured, 1)} s the class's profiled canary "
                         f"took to boot, at least {BOOT_TIMEOUT_MIN_SECONDS} s")
    eager = enforce_eager is True or str(enforce_eager).lower() in ("true", "yes", "1")
    derived = UNMEASURED_BOOT_TIMEOUT_SECONDS[eager]
    return derived, (f"{field} {derived} s: no measured boot of this class"
                     + (" (--enforce-eager)" if eager else " (torch.compile and CUDA-graph capture: not --enforce-eager)"))


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


def capacity_figures(log: dict[str, t.Any], metrics: EngineMetrics | None) -> dict[str, t.Any]:
    """Blocks, block size, tokens and concurrency of one engine: ``/metrics`` (exact) first, then the log.

    A data-parallel head's ``/metrics`` lists every engine of the instance (over every host of a gang) and
    sums their blocks and tokens; a plan's and a reference's figures are one engine's (each engine takes the
    same budget), so with several engines the least engine's count (``engines``: how many reported)."""
    out: dict[str, t.Any] = {
        "num_blocks": None,
        "block_size": None,
        "kv_cache_tokens": None,
        "max_concurrency": None,
        "kv_cache_memory_bytes": None,
        "source": None,
    }
    if metrics is not None and metrics.cache_config:
        per_engine = list(metrics.engine_kv_cache_tokens) if len(metrics.engine_kv_cache_tokens) > 1 else []
        tokens = min(per_engine) if per_engine else metrics.kv_cache_size_tokens
        blocks = min(per_engine) // metrics.block_size if per_engine and metrics.block_size else metrics.num_gpu_blocks
        out.update(
            num_blocks=blocks,
            block_size=metrics.block_size,
            kv_cache_tokens=tokens,
            max_concurrency=metrics.kv_cache_max_concurrency,
            kv_cache_memory_bytes=metrics.kv_cache_memory_bytes,
            source="metrics",
        )
        if per_engine:
            out["engines"] = len(per_engine)
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


def log_tail(text: str, lines: int = 60, limit: int = 12000) -> str:
    tail = "\n".join(text.splitlines()[-lines:])
    return tail[-limit:]


def _rank_floor(floor: int | t.Mapping[t.Any, t.Any] | None, rank: int) -> int | None:
    """The floor of ``rank``: one floor for every rank, or a per-rank map read as both gates read it."""
    if floor is None:
        return None
    if isinstance(floor, t.Mapping):
        return rank_floor(floor, rank)
    return int(floor)


def _cpu_build(log: t.Mapping[str, t.Any], rank: t.Mapping[str, t.Any]) -> bool:
    """Whether this boot's log is the CPU build's (its KV line per node, or a CPU capacity line)."""
    return bool(rank.get("cpu_kv_mode")) or log.get("device") == "CPU"


def reserved_kv_by_rank(ranks: t.Iterable[t.Mapping[str, t.Any]], expected: int) -> list[tuple[t.Any, int | None, bool]]:
    """Each rank's logged KV reservation against the byte budget: ``(rank, logged bytes or None, ok)``.

    The log prints GiB with two decimals, so a figure within ``GIB_ROUNDING_BYTES`` of
    ``expected`` is the budget; a rank whose log shows no figure is not ok.
    """
    out: list[tuple[t.Any, int | None, bool]] = []
    for rank in ranks:
        got = rank.get("reserved_kv_bytes")
        logged = None if got is None else int(got)
        out.append((rank.get("rank"), logged, logged is not None and abs(logged - int(expected)) <= GIB_ROUNDING_BYTES))
    return out


@dataclass
class _BootChecks:
    """The boot check's findings as they are made: every check, the failed ones' reasons, and
    the reasons of the checks that do not apply to this engine."""

    checks: list[dict[str, t.Any]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    not_applicable: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, reason: str, rank: int | None = None, **figures: t.Any) -> None:
        self.checks.append({"check": name, "rank": rank, "ok": ok, **figures})
        if not ok:
            self.reasons.append(reason)


def evaluate_boot(
    log: t.Mapping[str, t.Any],
    metrics: EngineMetrics | None,
    *,
    expected_kv_cache_memory_bytes: int | None = None,
    free_floor_bytes: int | t.Mapping[t.Any, t.Any] | None = None,
    min_tokens: int | None = None,
    metrics_error: str = "",
    serves_metrics: bool = True,
) -> dict[str, t.Any]:
    """Judge one boot from its parsed log (``summarise_log``) and ``/metrics``.

    ``serves_metrics``: false for a member of an instance over several hosts that runs no API server
    (``--headless``): there is no ``/metrics`` to cross-check, and its log may hold no capacity line
    (the API member's engine counts the tokens); both are noted as not applicable.

    Logged GiB figures carry two decimals, so log comparisons allow half a unit
    (``GIB_ROUNDING_BYTES``); ``/metrics`` figures are exact and compared exactly.
    A floor the log cannot show because the engine does not measure it (the CPU build) is a
    check with ``applicable: false`` and its reason in ``not_applicable``, neither passed nor failed.
    Returns ``{"ok": bool, "reasons": [...], "checks": [...], "not_applicable": [...]}``.
    """
    found = _BootChecks()
    for err in log.get("errors") or []:
        found.check("engine_error", False, f"rank {err.get('rank')}: engine error ({err.get('kind')}): {err.get('message')}",
                    rank=err.get("rank"), kind=err.get("kind"))
    ranks = list(log.get("ranks") or [])
    if not log.get("recognised"):
        found.check("log_recognised", False, "no vLLM startup line was recognised in this boot's log")
    if expected_kv_cache_memory_bytes is not None:
        _check_reserved_kv(found, ranks, int(expected_kv_cache_memory_bytes), metrics, metrics_error, serves_metrics)
    if free_floor_bytes is not None:
        _check_free_floors(found, log, ranks, free_floor_bytes)
    if not serves_metrics and log.get("kv_cache_tokens") is None:
        if min_tokens is not None:
            found.not_applicable.append(f"KV cache tokens (at least {min_tokens}): this member runs no engine core of its own; "
                                        "the member that serves the API counts them")
        min_tokens = None
    tokens = _check_tokens(found, log, metrics, min_tokens)
    return {"ok": not found.reasons, "reasons": found.reasons, "checks": found.checks, "kv_cache_tokens": tokens,
            "not_applicable": found.not_applicable}


def _check_reserved_kv(found: _BootChecks, ranks: list[t.Any], expected: int, metrics: EngineMetrics | None,
                       metrics_error: str, serves_metrics: bool = True) -> None:
    """Each rank's logged KV reservation (GiB-rounded), then ``/metrics``' exact figure, against ``expected``."""
    if not ranks:
        found.check("reserved_kv_bytes", False,
                    f"this boot's log has no per-rank KV cache line; cannot confirm {expected} bytes were reserved")
    for num, got, ok in reserved_kv_by_rank(ranks, expected):
        if got is None:
            found.check("reserved_kv_bytes", False,
                        f"rank {num}: the log shows no KV cache reserved from kv_cache_memory_bytes "
                        f"(expected {expected} bytes); the engine did not use the manual budget",
                        rank=num, expected=expected, actual=None)
        else:
            found.check("reserved_kv_bytes", ok,
                        f"rank {num}: reserved {got} bytes for KV cache (log, +/- {GIB_ROUNDING_BYTES}), "
                        f"expected {expected}", rank=num, expected=expected, actual=got)
    if not serves_metrics:
        found.not_applicable.append("kv_cache_memory_bytes in /metrics: this member runs no API server (headless)")
    elif metrics is not None and metrics.cache_config:
        got = metrics.kv_cache_memory_bytes
        found.check("metrics_kv_cache_memory_bytes", got == expected,
                    f"/metrics cache_config_info kv_cache_memory_bytes={got}, expected {expected}",
                    expected=expected, actual=got)
    else:
        found.check("metrics_kv_cache_memory_bytes", False,
                    "cannot cross-check kv_cache_memory_bytes: " + (metrics_error or "no cache_config_info in /metrics"),
                    expected=expected, actual=None)


def _check_free_floors(found: _BootChecks, log: t.Mapping[str, t.Any], ranks: list[t.Any],
                       free_floor_bytes: int | t.Mapping[t.Any, t.Any]) -> None:
    """Each logged rank's initial free memory against its floor (rank 0 when the log shows none),
    then every rank that has a floor but printed nothing."""
    for rank in ranks or [{"rank": 0}]:
        _check_rank_floor(found, log, rank, free_floor_bytes)
    if isinstance(free_floor_bytes, t.Mapping) and ranks:
        seen = {int(r.get("rank") or 0) for r in ranks}
        for key in free_floor_bytes:
            if int(key) not in seen:
                found.check("free_floor", False, f"rank {int(key)}: has a floor but printed no figures in this boot's log",
                            rank=int(key))


def _check_rank_floor(found: _BootChecks, log: t.Mapping[str, t.Any], rank: t.Mapping[str, t.Any],
                      free_floor_bytes: int | t.Mapping[t.Any, t.Any]) -> None:
    num = int(rank.get("rank") or 0)
    floor = _rank_floor(free_floor_bytes, num)
    if floor is None:
        found.check("free_floor", False, f"rank {num}: no free-memory floor given for this rank", rank=num)
        return
    free = rank.get("initial_free_bytes")
    if free is None and _cpu_build(log, rank):
        # vLLM's CPU build sizes its KV cache from the NUMA node's memory and logs no
        # initial free memory of a device: there is no figure to hold against the floor.
        # Say so (never a silent pass): the NVML floor is the boot gate's job before the start.
        why = (f"rank {num}: free-memory floor of {floor} bytes not applicable: the CPU build logs no "
               "initial free device memory (it sizes its KV cache from the NUMA node's memory)")
        found.checks.append({"check": "free_floor", "rank": num, "ok": True, "applicable": False,
                             "floor": floor, "actual": None, "why": why})
        found.not_applicable.append(why)
        return
    if free is None:
        found.check("free_floor", False,
                    f"rank {num}: the log shows no initial free memory; cannot verify the floor of {floor} bytes",
                    rank=num, floor=floor, actual=None)
    else:
        ok = int(free) + GIB_ROUNDING_BYTES >= floor
        found.check("free_floor", ok,
                    f"rank {num}: initial free memory {free} bytes (log) is below the floor {floor} bytes",
                    rank=num, floor=floor, actual=int(free))


def _check_tokens(found: _BootChecks, log: t.Mapping[str, t.Any], metrics: EngineMetrics | None,
                  min_tokens: int | None) -> t.Any:
    """The log's and /metrics' KV cache tokens agree, and hold ``min_tokens``; returns the tokens (/metrics first).

    With several engines (data parallel) the figures are per engine: the log holds the first engine's line
    and a data-parallel head's /metrics every engine's, over every host of the instance (each engine of it
    takes the same budget); every engine must report the log's figure, and the least of them counts."""
    log_tokens = log.get("kv_cache_tokens")
    per_engine = list(metrics.engine_kv_cache_tokens) if metrics is not None and len(metrics.engine_kv_cache_tokens) > 1 else []
    metric_tokens = min(per_engine) if per_engine else metrics.kv_cache_size_tokens if metrics is not None else None
    tokens = metric_tokens if metric_tokens is not None else log_tokens
    if per_engine and log_tokens is not None:
        found.check("tokens_consistent", all(t == log_tokens for t in per_engine),
                    f"the log reports {log_tokens} KV cache tokens per engine, /metrics {per_engine} for its {len(per_engine)} engines",
                    log=log_tokens, metrics=per_engine)
    elif log_tokens is not None and metric_tokens is not None:
        found.check("tokens_consistent", log_tokens == metric_tokens,
                    f"the log reports {log_tokens} KV cache tokens, /metrics {metric_tokens}",
                    log=log_tokens, metrics=metric_tokens)
    if min_tokens is not None:
        if tokens is None:
            found.check("min_tokens", False,
                        f"the KV cache size in tokens is in neither the log nor /metrics; cannot verify >= {min_tokens}",
                        expected=int(min_tokens), actual=None)
        else:
            found.check("min_tokens", int(tokens) >= int(min_tokens),
                        f"KV cache holds {tokens} tokens, fewer than the {min_tokens} the plan needs",
                        expected=int(min_tokens), actual=int(tokens))
    return tokens


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
             "ExecMainStartTimestamp", "ActiveEnterTimestamp", "ExecMainPID", "InvocationID")

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
        """(text of this start's journal, which entries were read).

        The entries of the unit's current ``InvocationID``: a clock stepped back (an NTP
        correction) or a restart within the same second never mixes in an earlier start's
        lines, as selecting by time would. Without one (a unit that never started), the
        entries since its main process started.
        """
        props = self.show(unit)
        invocation = props.get("InvocationID", "")
        if invocation and all(c in "0123456789abcdef" for c in invocation):
            argv = [self.journalctl, f"_SYSTEMD_INVOCATION_ID={invocation}", "-o", "cat", "--no-pager"]
            selected = f"invocation {invocation}"
        else:
            since = props.get("ExecMainStartTimestamp") or props.get("ActiveEnterTimestamp") or ""
            argv = [self.journalctl, "-u", unit, "-o", "cat", "--no-pager"]
            selected = "the beginning"
            if since and since not in ("n/a", "0"):
                argv += ["--since", since]
                selected = since
        rc, out, err = self.runner(argv)
        if rc != 0:
            raise EngineSpecError(f"{' '.join(argv[:2])} failed (rc {rc}): {err.strip()}")
        return out, selected


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
    # seconds between two /health polls (each also reads the unit's state): a short one keeps
    # the wait after the engine is up, which every host of a rollout pays, small
    interval: float = 0.25
    # a member of an instance over several hosts that runs no API server (--headless): it is up once each of
    # its ``local_ranks`` ranks logged its KV cache line (after every rank of the instance joined), not at /health
    headless: bool = False
    local_ranks: int = 1
    # a member of an instance over several hosts: its first rank in the whole instance (None: a member without
    # an API numbers its ranks by their order in the log; a one-host instance's ranks are its own)
    first_rank: int | None = None


def logged_ranks(log: t.Mapping[str, t.Any]) -> int:
    """How many ranks of this boot's log reported their KV cache (a budget or a profiled figure)."""
    return len({r.get("rank") for r in log.get("ranks") or []
                if r.get("reserved_kv_bytes") is not None or r.get("current_kv_bytes") is not None
                or r.get("auto_kv_bytes") is not None})


def _local_ranks(log: dict[str, t.Any], first_rank: int | None = None, local_ranks: int = 1) -> dict[str, t.Any]:
    """A gang member's ranks as its plan keys them: its log names each rank by its place in the whole instance
    (node rank x ranks per node + local rank: 8-15 on the second host of two with 8 GPUs each; a data-parallel
    engine's from its start rank), the plan file and its floors by its place among this member's GPUs (0-7).
    With ``first_rank`` a rank is renumbered from it, so a rank missing from the log stays missing (a log that
    numbers them within the member already, as the CPU build's data-parallel worker does, is taken as it is:
    ``member_rank_offset``); without, by its order in the log (a member's ranks are contiguous). Each keeps its
    instance-wide number as ``global_rank``."""
    ranks = sorted(log.get("ranks") or [], key=lambda r: r.get("rank") if isinstance(r.get("rank"), int) else 0)
    if first_rank is not None:
        offset = member_rank_offset((r.get("rank") for r in ranks), first_rank, local_ranks)
        return dict(log, ranks=[dict(r, rank=r["rank"] + offset - first_rank, global_rank=r["rank"] + offset)
                                if isinstance(r.get("rank"), int) else dict(r, global_rank=None) for r in ranks])
    return dict(log, ranks=[dict(r, rank=i, global_rank=r.get("rank")) for i, r in enumerate(ranks)])


def wait_ranks_logged(systemd: Systemd, unit: str, ranks: int, *, timeout: float, interval: float = 1.0,
                      clock: t.Callable[[], float] = time.monotonic,
                      sleep: t.Callable[[float], None] = time.sleep) -> tuple[HealthResult, str, str]:
    """Poll a headless member's journal until ``ranks`` ranks logged their KV cache line, the deadline, or the
    unit failing; returns (the outcome as ``wait_healthy`` gives it, the journal text, which entries were read)."""
    start = clock()
    deadline = start + float(timeout)
    while True:
        state = systemd.failed_state(unit)
        text, selected = systemd.journal(unit)
        if state:
            return HealthResult("failed_state", round(clock() - start, 3), None, state), text, selected
        logged = logged_ranks(summarise_log(parse_engine_log(text)))
        if logged >= ranks:
            return HealthResult("healthy", round(clock() - start, 3)), text, selected
        if clock() >= deadline:
            return (HealthResult("timeout", round(clock() - start, 3), None,
                                 f"{logged} of its {ranks} rank(s) logged their KV cache (it runs no API server)"), text, selected)
        sleep(interval)


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
    if spec.headless and not (unit and spec.journal):
        raise EngineSpecError("headless needs a unit and its journal: a member without an API server is read from its log")
    failed_state = (lambda: systemd.failed_state(unit)) if unit else None
    if spec.headless:
        health, text, selected = wait_ranks_logged(systemd, unit or "", spec.local_ranks, timeout=spec.timeout,
                                                   interval=max(spec.interval, 1.0))
    else:
        health = wait_healthy(spec.host, spec.port, timeout=spec.timeout, failed_state=failed_state, interval=spec.interval)
    result: dict[str, t.Any] = {"health": health.status, "startup_wait_seconds": health.seconds,
                                "url": None if spec.headless else base_url(spec.host, spec.port)}
    if health.detail:
        result["health_detail"] = health.detail
    if spec.headless:
        result["log_source"] = f"journal of {spec.unit}, {selected}"
    elif spec.journal:
        text, selected = systemd.journal(spec.unit or "")
        result["log_source"] = f"journal of {spec.unit}, {selected}"
    else:
        try:
            with open(spec.log_path or "", "rb") as handle:
                text = last_boot(handle.read().decode("utf-8", "replace"))
        except OSError as exc:
            raise EngineSpecError(f"log_path {spec.log_path}: {exc.strerror or exc}") from exc
        result["log_source"] = f"{spec.log_path} (latest boot)"
    log = summarise_log(parse_engine_log(text))
    if spec.headless or spec.first_rank:
        log = _local_ranks(log, spec.first_rank, spec.local_ranks)
    result["engine_errors"] = log["errors"]
    result["ranks"] = log["ranks"]
    if health.status != "healthy":
        root = primary_error(log["errors"] + log["exceptions"])
        what = {
            "timeout": f"not healthy within {spec.timeout} s ({health.detail})",
            "failed_state": health.detail,
        }.get(health.status, health.detail)
        result.update(ok=False, reasons=[what + (f": {root}" if root else "")], checks=[],
                      log_tail=log_tail(text))
        return result
    metrics, why = scrape_metrics(spec.host, spec.port) if not spec.headless else (None, "")
    verdict = evaluate_boot(
        log, metrics, expected_kv_cache_memory_bytes=spec.expected_kv_cache_memory_bytes,
        free_floor_bytes=spec.free_floor_bytes, min_tokens=spec.min_tokens, metrics_error=why,
        serves_metrics=not spec.headless,
    )
    result.update(verdict)
    result["kv_cache_memory_bytes"] = metrics.kv_cache_memory_bytes if metrics else None
    result["num_blocks"] = (metrics.num_gpu_blocks if metrics else None) or log["num_blocks"]
    if not verdict["ok"]:
        result["log_tail"] = log_tail(text)
    return result
