# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A Prometheus server as the bake's source of metrics: its HTTP query API (``/api/v1/query``).

Controller side, plain Python. The bake asks for the same series it would scrape from each engine's
``/metrics`` (every ``vllm:`` series), at the start and at the end of the bake, in one instant query
per reading for all the engines; the samples of each engine (the series whose ``instance`` label is
the engine's ``address:port``, as Prometheus labels a target it scrapes at that address) become the
same figures a scrape gives (:func:`_vllm_metrics.metrics_from_samples`). It also reads the GPU
memory margins the metrics exporter writes for node_exporter's textfile collector
(``gpufleet_vllm_margin_bytes``), by the address of the host's engines.

A value at time T is the last scrape before T: the window is the bake shifted by up to one scrape
interval, the same at both ends; a bake of several scrape intervals keeps that small.
"""
from __future__ import annotations

import ipaddress
import json
import re
import typing as t
import urllib.error
import urllib.parse
import urllib.request

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_metrics import Sample

__all__ = ["MARGIN_METRIC", "START_METRIC", "PrometheusError", "check_url", "endpoint", "host_of", "margins", "query", "vllm_samples"]

MARGIN_METRIC = "gpufleet_vllm_margin_bytes"
# when the boot gate checked the instance's last start, as the metrics exporter last read it
START_METRIC = "gpufleet_vllm_last_start_timestamp_seconds"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class PrometheusError(ValueError):
    """The server could not be asked, or said no; the message names the URL and what it said."""


def _split_authority(url: str) -> tuple[str, str, str]:
    """``(scheme://, authority, rest)`` of ``url`` as written, the authority being what comes before the first
    ``/`` after the scheme (or from the start, for a URL written without one: ``user:pw@host`` too)."""
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    authority, slash, path = rest.partition("/")
    return head + sep, authority, slash + path


def _redacted(url: str) -> str:
    """``url`` as a message may show it: no user information, no query (either may carry a secret)."""
    scheme, authority, rest = _split_authority(url)
    if "@" in authority:
        authority = "<credentials>@" + authority.rsplit("@", 1)[1]
    shown = f"{scheme}{authority}{rest}"
    return shown.split("?", 1)[0].split("#", 1)[0] + ("?<query>" if "?" in shown else "")


def check_url(url: t.Any, field_name: str = "gpufleet_prometheus_url") -> str:
    """The server's base URL (``http(s)://host[:port][/path]``, no trailing slash). Raises
    :class:`PrometheusError` naming the field. Credentials in the URL are refused: the URL is shown
    in the task's output and the report, and no message shows them (nor a query)."""
    if not isinstance(url, str) or not url.strip():
        shown = "a blank text" if isinstance(url, str) else type(url).__name__
        raise PrometheusError(f"{field_name}: expected the Prometheus server's URL (http://host:9090), got {shown}")
    url = url.strip()
    shown = repr(_redacted(url))
    parts = urllib.parse.urlsplit(url)
    if "@" in _split_authority(url)[1]:
        raise PrometheusError(f"{field_name}: the URL carries credentials, which would show in the task's output and the "
                              f"report ({shown}); put the server behind a proxy that adds them, or use a URL without them")
    if _CONTROL.search(url) or " " in url:
        raise PrometheusError(f"{field_name}: the URL holds a space or a control character: {shown}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PrometheusError(f"{field_name}: expected an http:// or https:// URL with a host, got {shown}")
    if parts.query or parts.fragment:
        raise PrometheusError(f"{field_name}: expected the server's base URL without a query or fragment, got {shown}")
    try:
        parts.port  # noqa: B018  # raises on a port out of range
    except ValueError as exc:
        raise PrometheusError(f"{field_name}: {exc}: {shown}") from None
    return str(url).rstrip("/")


def endpoint(metrics_url: str) -> str:
    """The ``instance`` label Prometheus gives a target scraped at ``metrics_url``: its ``host:port``."""
    parts = urllib.parse.urlsplit(metrics_url)
    if not parts.hostname:
        raise PrometheusError(f"{metrics_url!r} is not a URL with a host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{parts.hostname}]:{port}" if ":" in parts.hostname else f"{parts.hostname}:{port}"


def host_of(instance: str) -> str:
    """The host part of an ``instance`` label (``10.0.0.1:9100`` -> ``10.0.0.1``, ``[::1]:9100`` -> ``::1``)."""
    if instance.startswith("["):
        return instance[1:].split("]", 1)[0]
    try:
        return str(ipaddress.ip_address(instance))  # a bare IPv6 address has colons of its own
    except ValueError:
        return instance.rsplit(":", 1)[0] if ":" in instance else instance


def query(opener: urllib.request.OpenerDirector, base_url: str, promql: str, at: float | None, timeout: float
          ) -> list[dict[str, t.Any]]:
    """An instant query's vector: ``[{metric: {labels}, value: [time, "value"]}]``."""
    form = {"query": promql}
    if at is not None:
        form["time"] = f"{at:.3f}"
    request = urllib.request.Request(f"{base_url}/api/v1/query", data=urllib.parse.urlencode(form).encode("ascii"),
                                     headers={"Content-Type": "application/x-www-form-urlencoded"}, method="POST")
    try:
        with opener.open(request, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        # Prometheus explains a bad query (400/422) in its JSON body
        body = exc.read()
        try:
            said = json.loads(body).get("error") or body[:200]
        except ValueError:
            said = body[:200]
        raise PrometheusError(f"{base_url}: HTTP {exc.code}: {said!r}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise PrometheusError(f"{base_url}: {getattr(exc, 'reason', exc)}") from None
    try:
        answer = json.loads(body)
    except ValueError:
        raise PrometheusError(f"{base_url}: the answer is not JSON, so not Prometheus's query API: {body[:120]!r}") from None
    if not isinstance(answer, dict) or answer.get("status") != "success":
        raise PrometheusError(f"{base_url}: the query failed: {answer.get('error') if isinstance(answer, dict) else answer!r}")
    data = answer.get("data") or {}
    if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise PrometheusError(f"{base_url}: expected an instant vector, got {data.get('resultType')!r}")
    return list(data["result"])


def _selector(label: str, values: t.Iterable[str]) -> str:
    regex = "|".join(re.escape(v) for v in sorted(set(values)))
    return f'{label}=~"{regex.replace(chr(92), chr(92) * 2)}"'


def vllm_samples(opener: urllib.request.OpenerDirector, base_url: str, instances: t.Sequence[str], at: float | None,
                 timeout: float) -> dict[str, list[Sample]]:
    """Every ``vllm:`` sample of each instance (``host:port``) at ``at`` (None: now), by instance.
    An instance Prometheus has no series of is absent."""
    out: dict[str, list[Sample]] = {}
    if not instances:
        return out
    promql = '{__name__=~"vllm:.+",' + _selector("instance", instances) + "}"
    for row in query(opener, base_url, promql, at, timeout):
        labels = dict(row.get("metric") or {})
        name, instance = labels.pop("__name__", ""), labels.pop("instance", "")
        labels.pop("job", None)
        try:
            value = float(row["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            raise PrometheusError(f"{base_url}: a sample of {name} has no value: {row!r}") from None
        out.setdefault(instance, []).append((name, labels, value))
    return out


def margins(opener: urllib.request.OpenerDirector, base_url: str, hosts: t.Sequence[str], at: float | None,
            timeout: float, since: float | None = None) -> dict[str, float]:
    """The smallest GPU memory margin (:data:`MARGIN_METRIC`: free memory less the plan's floor) of each
    host address, from any target of that address (node_exporter's textfile collector). A host with no
    such series is absent. With ``since`` (epoch seconds), only the margins of instances whose export
    saw a start at or after it (:data:`START_METRIC`): an export from before a deploy judges the old units."""
    wanted = set(hosts)
    out: dict[str, float] = {}
    if not wanted:
        return out
    series = MARGIN_METRIC
    if since is not None:
        series = f"{MARGIN_METRIC} and on (instance, job, class, vllm_instance) ({START_METRIC} >= {since:.3f})"
    for row in query(opener, base_url, f"min by (instance) ({series})", at, timeout):
        host = host_of(str((row.get("metric") or {}).get("instance", "")))
        if host in wanted:
            try:
                value = float(row["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            out[host] = min(value, out.get(host, value))
    return out
