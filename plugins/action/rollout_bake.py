# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin for gpufleet.vllm.rollout_bake: bake a batch and judge it from its engines' metrics."""

from __future__ import annotations

import ssl
import time
import typing as t
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from ansible.errors import AnsibleActionFail
from ansible.module_utils.common.text.converters import to_text
from ansible.plugins.action import ActionBase

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_metrics import (
    EngineMetrics,
    MetricsParseError,
    metrics_from_samples,
    parse_metrics,
)
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._analysis import (
    INCONCLUSIVE_POLICIES,
    MAX_BAKE_SECONDS,
    AnalysisError,
    Window,
    analyse,
    check_settings,
    merge,
    window,
)
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._prometheus import (
    MARGIN_METRIC,
    PrometheusError,
    check_url,
    endpoint,
    host_of,
    margins,
    vllm_samples,
)

_TARGET_SPEC: dict[str, t.Any] = {
    "host": {"type": "str", "required": True},
    "instance": {"type": "str", "required": True},
    "url": {"type": "str", "required": True},
}
ARGUMENT_SPEC: dict[str, t.Any] = {
    "seconds": {"type": "int", "required": True},
    "canary": {"type": "list", "elements": "dict", "required": True, "options": _TARGET_SPEC},
    "baseline": {"type": "list", "elements": "dict", "default": [], "options": _TARGET_SPEC},
    "checks": {"type": "raw"},
    "inconclusive": {"type": "str", "default": "fail", "choices": list(INCONCLUSIVE_POLICIES)},
    "timeout": {"type": "float", "default": 10.0},
    "prometheus_url": {"type": "str"},
    "since": {"type": "float"},
}
# scrapes in flight at once: a class's hosts are read together, not one after another
_PARALLEL = 32


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S+00:00")


def _scrape(opener: urllib.request.OpenerDirector, url: str, timeout: float) -> EngineMetrics:
    with opener.open(url, timeout=timeout) as resp:
        return parse_metrics(to_text(resp.read(), errors="surrogate_or_strict"))


def _opener() -> urllib.request.OpenerDirector:
    # one opener and one TLS context for every read (open_url builds a context per call, 20 ms each:
    # more than the reads themselves); the proxy settings of the environment apply, as with open_url
    return urllib.request.build_opener(urllib.request.HTTPSHandler(context=ssl.create_default_context()))


def _scrape_all(opener: urllib.request.OpenerDirector, targets: list[dict[str, str]], timeout: float) -> list[EngineMetrics | str]:
    """Each target's metrics, or why it could not be read, in the targets' order."""

    def one(target: dict[str, str]) -> EngineMetrics | str:
        try:
            return _scrape(opener, target["url"], timeout)
        except MetricsParseError as exc:
            return f"{target['url']}: not vLLM's metrics: {exc}"
        except Exception as exc:  # pylint: disable=broad-exception-caught  # every way a read fails is reported, per target
            return f"{target['url']}: {to_text(exc)}"

    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(_PARALLEL, len(targets))) as pool:
        return list(pool.map(one, targets))


def _ask_prometheus(opener: urllib.request.OpenerDirector, url: str, targets: list[dict[str, str]], timeout: float,
                    first: bool, restarted: int = 0) -> list[EngineMetrics | str]:
    """Each target's metrics as the Prometheus server at ``url`` has them now, in the targets' order.
    At the first reading, an engine of the first ``restarted`` targets (the batch's engines, which its
    deploy started moments ago) that the server has no series of yet counts from zero; any other engine
    it has none of is unread (its series may be stale after a failed scrape, and its next scrape would
    count everything it ever served)."""
    instances: list[str | None] = []
    bad: dict[int, str] = {}
    for i, target in enumerate(targets):
        try:
            instances.append(endpoint(target["url"]))
        except PrometheusError as exc:
            instances.append(None)
            bad[i] = f"{target['host']} {target['instance']}: {exc}"
    try:
        found = vllm_samples(opener, url, sorted({i for i in instances if i}), None, timeout)
    except PrometheusError as exc:
        return [bad.get(i, f"Prometheus {exc}") for i in range(len(targets))]
    out: list[EngineMetrics | str] = []
    for i, instance in enumerate(instances):
        if instance is None:
            out.append(bad[i])
        elif instance in found:
            out.append(metrics_from_samples(found[instance], "prometheus"))
        elif first and i < restarted:
            out.append(EngineMetrics(parser="prometheus"))
        else:
            out.append(f"Prometheus at {url} has no vllm: series of the instance {instance}"
                       + (" at the start of the bake (does it scrape it there? a scrape that failed just before leaves none)"
                          if first else " (does it scrape it there?)"))
    return out


def _read(opener: urllib.request.OpenerDirector, prometheus_url: str | None, targets: list[dict[str, str]], timeout: float,
          first: bool, restarted: int = 0) -> list[EngineMetrics | str]:
    if not targets:
        return []
    if prometheus_url:
        return _ask_prometheus(opener, prometheus_url, targets, timeout, first, restarted)
    return _scrape_all(opener, targets, timeout)


def _host_windows(targets: list[dict[str, str]], start: list[EngineMetrics | str], end: list[EngineMetrics | str],
                  host_margins: dict[str, float] | None = None, margin_note: str = "") -> tuple[list[Window], dict[str, list[str]]]:
    """One window per host (its engines merged, with its GPU memory margin where known), and per host
    why it was left out."""
    per_host: dict[str, list[Window]] = {}
    unread: dict[str, list[str]] = {}
    for target, first, last in zip(targets, start, end):
        for scrape in (first, last):
            if isinstance(scrape, str):
                unread.setdefault(target["host"], []).append(scrape)
        if isinstance(first, EngineMetrics) and isinstance(last, EngineMetrics):
            per_host.setdefault(target["host"], []).append(window(first, last))
    windows = []
    for host, parts in per_host.items():
        if host in unread:
            continue  # half a host's engines is not the host
        merged = merge(parts)
        if merged is not None:
            merged.hosts = 1
            merged.margin_bytes = (host_margins or {}).get(host)
            merged.margin_note = margin_note if merged.margin_bytes is None else ""
            windows.append(merged)
    return windows, unread


class ActionModule(ActionBase):  # type: ignore[misc]  # ActionBase is Any: ansible-core ships no type information
    """Scrape the batch's and the baseline's engines, wait the bake, scrape again, judge."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)
    _requires_connection = False

    def run(self, tmp: str | None = None, task_vars: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        result: dict[str, t.Any] = super().run(tmp, task_vars or {})
        del tmp
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        seconds, timeout = args["seconds"], args["timeout"]
        if not 0 <= seconds <= MAX_BAKE_SECONDS:
            raise AnsibleActionFail(f"rollout_bake seconds: expected 0 to {MAX_BAKE_SECONDS}, got {seconds}")
        if not 0 < timeout <= 300:
            raise AnsibleActionFail(f"rollout_bake timeout: expected more than 0 and at most 300 seconds, got {timeout:g}")
        if not args["canary"]:
            raise AnsibleActionFail("rollout_bake canary: no engine of a changed host to judge")
        try:
            check_settings(args["checks"], "checks")
        except AnalysisError as exc:
            raise AnsibleActionFail(f"rollout_bake {exc}") from None
        try:
            prometheus_url = check_url(args["prometheus_url"], "prometheus_url") if args["prometheus_url"] else None
        except PrometheusError as exc:
            raise AnsibleActionFail(f"rollout_bake {exc}") from None
        canary, baseline = list(args["canary"]), list(args["baseline"])
        targets = canary + baseline
        opener = _opener()
        started, started_at = _now(), time.monotonic()
        first = _read(opener, prometheus_url, targets, timeout, first=True, restarted=len(canary))
        canary_unread = [s for s in first[:len(canary)] if isinstance(s, str)]
        if not canary_unread:
            time.sleep(max(0.0, seconds - (time.monotonic() - started_at)))
            last = _read(opener, prometheus_url, targets, timeout, first=False)
            canary_unread = [s for s in last[:len(canary)] if isinstance(s, str)]
        result.update(changed=False, started=started, finished=_now(), seconds=seconds,
                      source=f"Prometheus {prometheus_url}" if prometheus_url else "each engine's /metrics",
                      canary_hosts=sorted({c["host"] for c in canary}), baseline_hosts=sorted({b["host"] for b in baseline}))
        if canary_unread:
            # an engine of the batch that cannot be read is not judged to pass
            unread = list(dict.fromkeys(canary_unread))  # one server that failed fails every engine alike: once
            result.update(analysis={"verdict": "fail", "effective": "fail", "checks": [], "unread": unread,
                                    "canary_hosts": len(result["canary_hosts"]), "baseline_hosts": 0, "source": result["source"]},
                          msg="the bake could not read the batch's engines: " + "; ".join(unread))
            return result
        host_margins, margin_note = _margins(opener, prometheus_url, canary, timeout, args["since"]) if prometheus_url else ({}, "")
        canary_windows = _host_windows(canary, first[:len(canary)], last[:len(canary)], host_margins, margin_note)[0]
        baseline_windows, baseline_unread = _host_windows(baseline, first[len(canary):], last[len(canary):])
        try:
            analysis = analyse(canary_windows, baseline_windows, args["checks"], args["inconclusive"],
                               baseline_given=len(result["baseline_hosts"]))
        except AnalysisError as exc:
            raise AnsibleActionFail(f"rollout_bake: {exc}") from None
        analysis["baseline_unread"] = dict(sorted(baseline_unread.items()))
        analysis["source"] = result["source"]
        result.update(analysis=analysis, msg=_summary(analysis, seconds))
        return result


def _margins(opener: urllib.request.OpenerDirector, url: str, canary: list[dict[str, str]], timeout: float,
             since: float | None) -> tuple[dict[str, float], str]:
    """Each canary host's smallest GPU memory margin now, from the textfile metrics Prometheus scrapes
    off the addresses of its engines (with ``since``, only an export that saw the instance's start at or
    after it); a host with none is absent, and the text says why when it is not plain."""
    addresses: dict[str, set[str]] = {}
    for target in canary:
        try:
            addresses.setdefault(target["host"], set()).add(host_of(endpoint(target["url"])))
        except PrometheusError:
            continue  # its engines were unread already, and the bake failed on them
    every = sorted(set().union(*addresses.values())) if addresses else []
    try:
        found = margins(opener, url, every, None, timeout, since)
        older = margins(opener, url, every, None, timeout) if since is not None and len(found) < len(addresses) else {}
    except PrometheusError as exc:
        return {}, f"the margins could not be read: Prometheus {exc}"
    out = {}
    for host, mine in addresses.items():
        seen = [found[a] for a in mine if a in found]
        if seen:
            out[host] = min(seen)
    why = ""
    if any(a in older for host, mine in addresses.items() if host not in out for a in mine):
        why = (f"the metrics exporter has not written {MARGIN_METRIC} since the batch's units started (it writes every "
               "vllm_service_metrics_interval_sec, and Prometheus scrapes it after that): bake longer than that interval "
               "for the margin to be judged")
    return out, why


def _summary(analysis: dict[str, t.Any], seconds: int) -> str:
    checks = "; ".join(f"{c['name']} {c['verdict']}: {c['why']}" for c in analysis["checks"])
    left = f"; {len(analysis['baseline_unread'])} baseline host(s) could not be read and were left out" if analysis["baseline_unread"] else ""
    verdict = analysis["verdict"] + (f" (counted as {analysis['effective']})" if analysis["effective"] != analysis["verdict"] else "")
    return (f"bake of {seconds} s, {analysis['canary_hosts']} changed host(s) against {analysis['baseline_hosts']} baseline host(s): "
            f"{verdict}: {checks}{left}")


__all__ = ["ARGUMENT_SPEC", "ActionModule"]
