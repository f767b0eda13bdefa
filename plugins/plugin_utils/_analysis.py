# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A batch's bake, judged from live metrics: the hosts the batch changed (the canary) against the
class's hosts not yet changed (the baseline), in the manner of Kayenta.

Controller side, plain Python. Each host gives two ``/metrics`` scrapes of its engines, at the
start and at the end of the bake (:func:`window` turns them into what happened in between; an
engine that restarted in between counts from zero). The canary's and the baseline's windows are
summed over their hosts, then every check compares them:

- ``success_rate``: finished requests that did not end in ``abort`` or ``error``
  (``vllm:request_success_total`` by ``finished_reason``); fails when the canary's rate is more than
  ``max_drop`` below the baseline's (below ``1 - max_drop`` without a baseline);
- ``ttft_p90``, ``itl_p90``, ``e2e_p90``: the 90th percentile of time to first token, of the time
  per output token and of the whole request (vLLM's histograms); fails when the canary's is more
  than ``max_ratio`` times the baseline's (or above ``max_seconds`` when given);
- ``preemptions``: preemptions per finished request (``vllm:num_preemptions_total``); fails when
  the canary's is more than ``max_increase`` above the baseline's;
- ``kv_usage``: the canary's KV-cache usage at the end of the bake (the fullest engine); fails
  above ``max``;
- ``memory_margin``: the canary's smallest GPU memory margin at the end of the bake (NVML free memory
  less the plan's floor, per rank, as the metrics exporter writes it for node_exporter's textfile
  collector); fails below ``min_bytes``. Read from Prometheus only (``gpufleet_prometheus_url``); with
  no such series it is ``skipped``, saying so.

A check with fewer than ``min_requests`` finished requests on the canary (or, where it compares,
on the baseline) is ``inconclusive``. A latency check with no baseline host at all (every host of the
class is changed, or a one-host class) and no absolute limit is ``skipped``, saying so: there is
nothing left on the previous units to compare with, and calling that inconclusive would fail the
last batch of every class. The analysis fails when a check fails, else it is inconclusive when a
check is, else it passes; ``inconclusive`` then counts as the policy says
(:data:`INCONCLUSIVE_POLICIES`: ``fail``, the default, or ``pass``).

:func:`bake_settings` reads a class's bake settings (``gpufleet_bake_seconds``, ``gpufleet_analysis``,
``gpufleet_analysis_inconclusive``, ``gpufleet_prometheus_url``) and :func:`metrics_targets` the
``/metrics`` URLs of a host's engines as the controller reaches them; the ``rollout_bake`` action
scrapes them, or asks the Prometheus server that scrapes them (:mod:`._prometheus`).
"""
from __future__ import annotations

import ipaddress
import json
import math
import re
import typing as t
from dataclasses import dataclass, field

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_metrics import EngineMetrics, Histogram, histogram_quantile
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import SizeError, parse_size
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._gangs import api_instances
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._prometheus import MARGIN_METRIC, PrometheusError, check_url

__all__ = ["BAKE_FIELDS", "CHECKS", "INCONCLUSIVE_POLICIES", "AnalysisError", "Window", "analyse", "bake_settings",
           "check_settings", "merge", "metrics_targets", "window"]

# check -> its settings and their defaults
CHECKS: dict[str, dict[str, float | None]] = {
    "success_rate": {"max_drop": 0.01, "min_requests": 20},
    "ttft_p90": {"max_ratio": 1.5, "max_seconds": None, "min_requests": 20},
    "itl_p90": {"max_ratio": 1.5, "max_seconds": None, "min_requests": 20},
    "e2e_p90": {"max_ratio": 1.5, "max_seconds": None, "min_requests": 20},
    "preemptions": {"max_increase": 0.05, "min_requests": 20},
    "kv_usage": {"max": 0.98},
    "memory_margin": {"min_bytes": 0},
}
INCONCLUSIVE_POLICIES = ("fail", "pass")
# a class's bake settings, as its group variables name them (each alike on every host of the class)
BAKE_FIELDS = ("gpufleet_bake_seconds", "gpufleet_analysis", "gpufleet_analysis_inconclusive", "gpufleet_prometheus_url")
# the longest bake a batch may take: a day (a longer one is a typo, and holds the run's leases)
MAX_BAKE_SECONDS = 86400
FAILED_REASONS = ("abort", "error")
QUANTILE = 0.9


class AnalysisError(ValueError):
    """Bad analysis settings or scrapes; the message names the field."""


@dataclass
class Window:
    """What one host's engines (or several hosts', :func:`merge`) did during the bake."""

    finished: dict[str, float] = field(default_factory=dict)
    preemptions: float = 0.0
    ttft: Histogram | None = None
    itl: Histogram | None = None
    e2e: Histogram | None = None
    kv_usage: float | None = None
    # the smallest GPU memory margin of the host's ranks at the end (bytes; None: not read, margin_note says why)
    margin_bytes: float | None = None
    hosts: int = 1
    margin_note: str = ""

    @property
    def requests(self) -> float:
        return float(sum(self.finished.values()))

    @property
    def succeeded(self) -> float:
        return float(sum(v for k, v in self.finished.items() if k not in FAILED_REASONS))


def _delta_histogram(start: Histogram | None, end: Histogram | None, restarted: bool) -> Histogram | None:
    if end is None:
        return None
    if start is None or restarted:
        return Histogram(list(end.buckets), end.count, end.sum)
    before = dict(start.buckets)
    return Histogram([(le, max(0.0, count - before.get(le, 0.0))) for le, count in end.buckets],
                     max(0.0, end.count - start.count), max(0.0, end.sum - start.sum))


def window(start: EngineMetrics, end: EngineMetrics) -> Window:
    """What happened between two scrapes of one host. A counter that went down means the engine
    restarted in between: the end scrape alone is the window then."""
    restarted = any(end_count < start.request_success.get(reason, 0.0) for reason, end_count in end.request_success.items())
    restarted = restarted or ((end.preemptions_total or 0.0) < (start.preemptions_total or 0.0))
    finished = {reason: (count if restarted else max(0.0, count - start.request_success.get(reason, 0.0)))
                for reason, count in end.request_success.items()}
    preemptions = (end.preemptions_total or 0.0) - (0.0 if restarted else (start.preemptions_total or 0.0))
    return Window(finished=finished, preemptions=max(0.0, preemptions), ttft=_delta_histogram(start.ttft, end.ttft, restarted),
                  itl=_delta_histogram(start.itl, end.itl, restarted), e2e=_delta_histogram(start.e2e, end.e2e, restarted),
                  kv_usage=end.kv_cache_usage)


def _merge_histograms(parts: t.Sequence[Histogram | None]) -> Histogram | None:
    present = [h for h in parts if h is not None]
    if not present:
        return None
    bounds = sorted({le for h in present for le, _count in h.buckets})
    merged = []
    for le in bounds:
        total = 0.0
        for h in present:
            # the cumulative count at ``le``: the count of the highest bucket at or below it
            total += max((count for bound, count in h.buckets if bound <= le), default=0.0)
        merged.append((le, total))
    return Histogram(merged, float(sum(h.count for h in present)), float(sum(h.sum for h in present)))


def merge(windows: t.Sequence[Window]) -> Window | None:
    """Several hosts' windows as one (counts added, histograms added bucket by bucket, the fullest KV cache)."""
    if not windows:
        return None
    finished: dict[str, float] = {}
    for w in windows:
        for reason, count in w.finished.items():
            finished[reason] = finished.get(reason, 0.0) + count
    usage = [w.kv_usage for w in windows if w.kv_usage is not None]
    margin = [w.margin_bytes for w in windows if w.margin_bytes is not None]
    return Window(finished=finished, preemptions=float(sum(w.preemptions for w in windows)),
                  ttft=_merge_histograms([w.ttft for w in windows]), itl=_merge_histograms([w.itl for w in windows]),
                  e2e=_merge_histograms([w.e2e for w in windows]), kv_usage=max(usage) if usage else None,
                  margin_bytes=min(margin) if margin else None, hosts=sum(w.hosts for w in windows),
                  margin_note="; ".join(dict.fromkeys(w.margin_note for w in windows if w.margin_note)))


def _number(value: t.Any, where: str, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise AnalysisError(f"{where}: expected a number of at least {low:g}, got {value!r}")
    return float(value)


def _known_keys(given: t.Mapping[str, t.Any], known: t.Iterable[str], where: str, what: str, known_as: str) -> None:
    unknown = sorted(str(k) for k in given if k not in known)
    if unknown:
        raise AnalysisError(f"{where}: unknown {what}(s) {', '.join(unknown)}; {known_as} {', '.join(known)}")


def check_settings(given: t.Any, field_name: str = "gpufleet_analysis") -> dict[str, dict[str, float | None]]:
    """The checks to run: ``given`` (check -> its settings, a check set to ``false`` is left out) over
    :data:`CHECKS`' defaults. Raises :class:`AnalysisError` naming the field."""
    if given is None:
        given = {}
    if isinstance(given, str):  # an AWX survey answer: JSON text
        try:
            given = json.loads(given) if given.strip() else {}
        except ValueError as exc:
            raise AnalysisError(f"{field_name}: expected a mapping of checks, or its JSON text; the text is not JSON: {exc}") from None
    if not isinstance(given, t.Mapping):
        raise AnalysisError(f"{field_name}: expected a mapping of checks ({', '.join(CHECKS)}), got {type(given).__name__}")
    _known_keys(given, CHECKS, field_name, "check", "the checks are")
    out: dict[str, dict[str, float | None]] = {}
    for name, defaults in CHECKS.items():
        mine = given.get(name, {})
        if mine is False:
            continue
        if mine is None or mine is True:
            mine = {}
        if not isinstance(mine, t.Mapping):
            raise AnalysisError(f"{field_name}.{name}: expected a mapping of {', '.join(defaults)} (or false), got {mine!r}")
        _known_keys(mine, defaults, f"{field_name}.{name}", "setting", "it takes")
        settings: dict[str, float | None] = {}
        for key, default in defaults.items():
            value = mine.get(key, default)
            if key.endswith("_bytes") and isinstance(value, str):
                try:
                    value = parse_size(value, f"{field_name}.{name}.{key}")
                except SizeError as exc:
                    raise AnalysisError(str(exc)) from None
            settings[key] = None if value is None else _number(value, f"{field_name}.{name}.{key}",
                                                               low=1.0 if key in ("max_ratio", "min_requests") else 0.0)
        out[name] = settings
    return out


def _limit(name: str, baseline: float | None, threshold: dict[str, t.Any]) -> float | None:
    """The canary's figure past which the check fails, as the thresholds and the baseline make it (None: no limit)."""
    if name == "success_rate":
        return (baseline if baseline is not None else 1.0) - float(threshold["max_drop"] or 0.0)
    if name == "preemptions":
        return (baseline or 0.0) + float(threshold["max_increase"] or 0.0)
    if name in ("kv_usage", "memory_margin"):
        value = threshold["max" if name == "kv_usage" else "min_bytes"]
        return None if value is None else float(value)
    ratio = threshold.get("max_ratio")
    limits = [v for v in (threshold.get("max_seconds"), baseline * ratio if baseline and ratio else None) if v is not None]
    return min(limits) if limits else None


def _result(name: str, verdict: str, why: str, canary: float | None, baseline: float | None, threshold: dict[str, t.Any],
            samples: tuple[float, float | None], compared: bool = True) -> dict[str, t.Any]:
    """One check's record. ``compared``: whether the baseline's figure took part in the verdict (a latency
    check that judged on its absolute limit alone draws that limit, not the ratio's)."""
    limit = _limit(name, baseline if compared else None, threshold)
    return {"name": name, "verdict": verdict, "why": why, "canary": canary, "baseline": baseline, "threshold": threshold,
            "limit": limit, "samples": {"canary": samples[0], "baseline": samples[1]}}


def _few(settings: dict[str, float | None], canary: Window, baseline: Window | None, compares: bool) -> str:
    """Why a check has too few samples ('' when it has enough)."""
    least = settings.get("min_requests") or 0
    if canary.requests < least:
        return f"{canary.requests:g} request(s) finished on the canary during the bake, fewer than {least:g}"
    if compares and baseline is not None and baseline.requests < least:
        return f"{baseline.requests:g} request(s) finished on the baseline during the bake, fewer than {least:g}"
    return ""


def _latency(name: str, settings: dict[str, float | None], canary: Window, baseline: Window | None,
             missing: str = "") -> dict[str, t.Any]:
    attr = name.split("_", 1)[0]
    mine = histogram_quantile(getattr(canary, attr), QUANTILE)
    theirs = histogram_quantile(getattr(baseline, attr), QUANTILE) if baseline is not None else None
    absolute = settings["max_seconds"]
    threshold = {"max_ratio": settings["max_ratio"], "max_seconds": absolute}
    samples = (canary.requests, baseline.requests if baseline is not None else None)
    if baseline is None and absolute is None:
        if missing:
            return _result(name, "inconclusive", missing, mine, theirs, threshold, samples, compared=False)
        return _result(name, "skipped", "no host of the class is left on its previous units to compare with",
                       mine, theirs, threshold, samples, compared=False)
    few = _few(settings, canary, None, compares=False)
    if few or mine is None:
        return _result(name, "inconclusive", few or "the canary's engines give no such histogram", mine, theirs, threshold, samples,
                       compared=False)
    if absolute is not None and mine > absolute:
        return _result(name, "fail", f"{mine:.4g} s on the canary, above {absolute:g} s", mine, theirs, threshold, samples,
                       compared=False)
    # the ratio only against a baseline that was read, with enough requests and the histogram
    why_not = (missing or ("no host of the class is left on its previous units to compare with" if baseline is None else "")
               or _few(settings, canary, baseline, compares=True)
               or ("the baseline's engines give no such histogram" if theirs is None or theirs <= 0 else ""))
    if why_not:
        if absolute is not None:
            return _result(name, "pass", f"{mine:.4g} s on the canary, within {absolute:g} s (not compared: {why_not})",
                           mine, theirs, threshold, samples, compared=False)
        return _result(name, "inconclusive", why_not, mine, theirs, threshold, samples, compared=False)
    ratio = mine / float(theirs or math.inf)  # theirs is a positive figure here (why_not says so otherwise)
    verdict = "fail" if ratio > (settings["max_ratio"] or math.inf) else "pass"
    return _result(name, verdict, f"{mine:.4g} s on the canary, {theirs:.4g} s on the baseline: {ratio:.2f} times "
                   f"({'above' if verdict == 'fail' else 'within'} {settings['max_ratio']:g})", mine, theirs, threshold, samples)


def _success(settings: dict[str, float | None], canary: Window, baseline: Window | None, missing: str = "") -> dict[str, t.Any]:
    threshold = {"max_drop": settings["max_drop"]}
    samples = (canary.requests, baseline.requests if baseline is not None else None)
    few = missing or _few(settings, canary, baseline, compares=True)
    mine = canary.succeeded / canary.requests if canary.requests else None
    theirs = baseline.succeeded / baseline.requests if baseline is not None and baseline.requests else None
    if few or mine is None:
        return _result("success_rate", "inconclusive", few or "no request finished on the canary", mine, theirs, threshold, samples)
    floor = (theirs if theirs is not None else 1.0) - (settings["max_drop"] or 0.0)
    verdict = "fail" if mine < floor else "pass"
    against = f"the baseline's {theirs:.4f}" if theirs is not None else "no baseline: 1"
    return _result("success_rate", verdict, f"{mine:.4f} on the canary against {against} less {settings['max_drop']:g}",
                   mine, theirs, threshold, samples)


def _preemptions(settings: dict[str, float | None], canary: Window, baseline: Window | None, missing: str = "") -> dict[str, t.Any]:
    threshold = {"max_increase": settings["max_increase"]}
    samples = (canary.requests, baseline.requests if baseline is not None else None)
    few = missing or _few(settings, canary, baseline, compares=True)
    mine = canary.preemptions / canary.requests if canary.requests else None
    theirs = baseline.preemptions / baseline.requests if baseline is not None and baseline.requests else 0.0
    if few or mine is None:
        return _result("preemptions", "inconclusive", few or "no request finished on the canary", mine, theirs, threshold, samples)
    verdict = "fail" if mine > theirs + (settings["max_increase"] or 0.0) else "pass"
    return _result("preemptions", verdict, f"{mine:.4g} preemption(s) per request on the canary, {theirs:.4g} on the baseline",
                   mine, theirs, threshold, samples)


def _kv_usage(settings: dict[str, float | None], canary: Window) -> dict[str, t.Any]:
    threshold = {"max": settings["max"]}
    if canary.kv_usage is None:
        return _result("kv_usage", "inconclusive", "the canary's engines give no KV-cache usage", None, None, threshold, (canary.requests, None))
    verdict = "fail" if canary.kv_usage > (settings["max"] or 0.0) else "pass"
    return _result("kv_usage", verdict, f"{canary.kv_usage:.3f} of the KV cache in use on the canary at the end of the bake",
                   canary.kv_usage, None, threshold, (canary.requests, None))


def _memory_margin(settings: dict[str, float | None], canary: Window) -> dict[str, t.Any]:
    least = settings["min_bytes"] or 0.0
    threshold = {"min_bytes": least}
    if canary.margin_bytes is None:
        return _result("memory_margin", "skipped", canary.margin_note or (
                       f"no {MARGIN_METRIC} series of the canary's hosts (read from Prometheus, "
                       "gpufleet_prometheus_url, where node_exporter serves the metrics exporter's textfile)"),
                       None, None, threshold, (canary.requests, None))
    verdict = "fail" if canary.margin_bytes < least else "pass"
    return _result("memory_margin", verdict, f"{canary.margin_bytes:.0f} bytes of GPU memory above the floor on the canary's "
                   f"tightest rank ({'below' if verdict == 'fail' else 'at least'} {least:.0f})",
                   canary.margin_bytes, None, threshold, (canary.requests, None))


def analyse(canary: t.Sequence[Window], baseline: t.Sequence[Window], checks: t.Any = None,
            inconclusive: str = "fail", baseline_given: int = 0) -> dict[str, t.Any]:
    """The bake's verdict: ``{verdict, effective, checks: [...], canary_hosts, baseline_hosts}``.

    ``baseline_given``: how many baseline hosts there were to read; when there were some and none could
    be read (``baseline`` empty), every check that compares is inconclusive, not skipped.

    ``verdict`` is ``pass``, ``fail`` or ``inconclusive``; ``effective`` is what the rollout does
    with it (``inconclusive`` counts as the ``inconclusive`` policy says). Each check gives its
    name, verdict, why, the canary's and the baseline's figures, its thresholds and sample counts.
    """
    if inconclusive not in INCONCLUSIVE_POLICIES:
        raise AnalysisError(f"inconclusive: expected one of {', '.join(INCONCLUSIVE_POLICIES)}, got {inconclusive!r}")
    settings = check_settings(checks)
    mine = merge(canary)
    if mine is None:
        raise AnalysisError("canary: no window of a changed host to judge")
    theirs = merge(baseline)
    missing = f"none of the {baseline_given} baseline host(s) could be read" if theirs is None and baseline_given > 0 else ""
    results = []
    for name, conf in settings.items():
        if name == "success_rate":
            results.append(_success(conf, mine, theirs, missing))
        elif name == "preemptions":
            results.append(_preemptions(conf, mine, theirs, missing))
        elif name == "kv_usage":
            results.append(_kv_usage(conf, mine))
        elif name == "memory_margin":
            results.append(_memory_margin(conf, mine))
        else:
            results.append(_latency(name, conf, mine, theirs, missing))
    verdicts = {r["verdict"] for r in results}  # a skipped check counts for nothing
    verdict = "fail" if "fail" in verdicts else "inconclusive" if "inconclusive" in verdicts else "pass"
    return {"verdict": verdict, "effective": inconclusive if verdict == "inconclusive" else verdict, "checks": results,
            "canary_hosts": mine.hosts, "baseline_hosts": theirs.hosts if theirs is not None else 0}


def _blank(value: t.Any) -> bool:
    """Unset: None or an empty string (an AWX survey sends a question left blank as "")."""
    return value is None or (isinstance(value, str) and not value.strip())


def bake_settings(seconds: t.Any = None, checks: t.Any = None, inconclusive: t.Any = None,
                  prometheus_url: t.Any = None) -> dict[str, t.Any] | None:
    """A class's bake: ``{seconds, checks, inconclusive, prometheus_url}`` with every check's settings
    filled in (a check turned off as ``False``; ``prometheus_url`` None: each engine's ``/metrics`` is
    read), or None when the class does not bake (``gpufleet_bake_seconds`` unset or 0). Raises
    :class:`AnalysisError` naming the field (:data:`BAKE_FIELDS`)."""
    field_seconds, field_checks, field_policy, field_prometheus = BAKE_FIELDS
    if _blank(seconds):
        seconds = 0
    if isinstance(seconds, str) and seconds.strip().isdigit():
        seconds = int(seconds.strip())
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not 0 <= seconds <= MAX_BAKE_SECONDS:
        raise AnalysisError(f"{field_seconds}: expected whole seconds from 0 (no bake) to {MAX_BAKE_SECONDS}, got {seconds!r}")
    policy = "fail" if _blank(inconclusive) else inconclusive
    if policy not in INCONCLUSIVE_POLICIES:
        raise AnalysisError(f"{field_policy}: expected one of {', '.join(INCONCLUSIVE_POLICIES)}, got {inconclusive!r}")
    settings = check_settings(None if _blank(checks) else checks, field_checks)
    try:
        source = None if _blank(prometheus_url) else check_url(prometheus_url, field_prometheus)
    except PrometheusError as exc:
        raise AnalysisError(str(exc)) from None
    if seconds == 0:
        return None
    # memory_margin reads Prometheus only: alone, without it, it would judge nothing
    if not [name for name in settings if source or name != "memory_margin"]:
        raise AnalysisError(f"{field_checks}: every check is turned off, so a bake of {seconds} s would judge nothing; "
                            f"turn one on, or set {field_seconds} to 0"
                            + ("" if not settings else f" (memory_margin is read from Prometheus only: {field_prometheus})"))
    # every check named, the ones turned off as false: check_settings reads the result as it reads the user's
    named: dict[str, t.Any] = {name: settings.get(name, False) for name in CHECKS}
    return {"seconds": seconds, "checks": named, "inconclusive": policy, "prometheus_url": source}


# a DNS name, or an inventory name /etc/hosts resolves (underscores allowed)
_HOST_NAME = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})$")


def _url_host(address: str, where: str) -> str:
    """``address`` as the host part of a URL (an IPv6 address in brackets)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        if not _HOST_NAME.match(address):
            raise AnalysisError(f"{where}: expected an IP address or a host name, got {address!r}") from None
        return address
    return f"[{ip}]" if ip.version == 6 else str(ip)


def _unspecified(address: str) -> bool:
    """An address that means every address (0.0.0.0, ::, ::0, ...)."""
    try:
        return ipaddress.ip_address(address).is_unspecified
    except ValueError:
        return False


def _loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def metrics_targets(host: str, instances: t.Any, listen_host: t.Any = "0.0.0.0", reach: t.Any = None,
                    address: t.Any = None, gang_launch: t.Any = None) -> list[dict[str, str]]:
    """Where the controller reads each engine of ``host`` during a bake: ``[{host, instance, url}]``.

    An instance this host runs as a gang member without an API server (``gang_launch``, as the filter
    ``gang_member_launch`` gives it, ``serves_api`` false: a headless follower) has no ``/metrics``:
    its gang's engines are read at the member that serves the API, so it is left out.

    The address is ``address`` when given (``gpufleet_metrics_address``), else the one the engines
    listen on (``vllm_service_listen_host``), else, for engines that listen on every address,
    ``reach`` (the host's ``ansible_host``, else its inventory name). Engines bound to a loopback
    address cannot be read from the controller without ``address``: an error says so."""
    if not isinstance(instances, t.Sequence) or isinstance(instances, (str, bytes)):
        raise AnalysisError(f"{host}: gpufleet_instances: expected a list of instances, got {type(instances).__name__}")
    if not _blank(address):
        chosen, where = str(address).strip(), "gpufleet_metrics_address"
    else:
        listen = "" if _blank(listen_host) else str(listen_host).strip()
        if listen == "" or _unspecified(listen):
            chosen, where = str(reach or host).strip(), "ansible_host"
        elif _loopback(listen):
            raise AnalysisError(f"{host}: the engines listen on {listen} (vllm_service_listen_host), which the controller cannot "
                                "reach for the bake's metrics: set gpufleet_metrics_address to an address that reaches them "
                                "(a proxy of their /metrics), or set gpufleet_bake_seconds to 0")
        else:
            chosen, where = listen, "vllm_service_listen_host"
    url_host = _url_host(chosen, f"{host}: {where}")
    if gang_launch is None:
        gang_launch = {}
    if not isinstance(gang_launch, t.Mapping):
        raise AnalysisError(f"{host}: gang_launch: expected the host's gang launches by instance, got {type(gang_launch).__name__}")
    out = []
    for pos, instance in enumerate(instances):
        if not isinstance(instance, t.Mapping) or not isinstance(instance.get("name"), str):
            raise AnalysisError(f"{host}: gpufleet_instances[{pos}]: expected a mapping with a name, got {instance!r}")
        if not api_instances([instance], gang_launch):
            continue
        port = instance.get("port")
        if isinstance(port, str) and port.isdigit():
            port = int(port)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise AnalysisError(f"{host}: gpufleet_instances[{pos}].port: expected an integer in 1..65535, got {port!r}")
        out.append({"host": host, "instance": instance["name"], "url": f"http://{url_host}:{port}/metrics"})
    return out
