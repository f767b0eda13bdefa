# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""GPU health through NVML: ECC, row remapping, retired pages and Xid events (binding injected).

Plain Python with no Ansible import (standard library only: installed on hosts with the boot
gate). :func:`read_health` reads one GPU's health queries with an open device handle;
:func:`health_checks` turns a reading into named checks (healthy or not) and
:func:`unhealthy` into one line per failing check. The probe (``_nvml_probe``) reads every GPU's
health; the boot gate refuses (or warns about) a start on an unhealthy GPU, and the metrics
exporter writes one ``gpufleet_vllm_gpu_health`` series per check.

Which queries a GPU answers depends on its generation: Ampere and later data-center GPUs
(A100, H100, H200) remap rows and answer ``NVML_ERROR_NOT_SUPPORTED`` for retired pages;
Volta and older retire pages and have no row remapping; GeForce cards have no ECC at all.
A query that is not supported (or a function the driver lacks) is recorded as such and is
not an error; any other NVML error is recorded for that query alone (its check is unknown).

Xid events: NVML delivers the events raised *after* a process registers for them, never
earlier ones, so a process that starts, listens for a moment and exits (the boot gate, the
metrics timer) sees only Xids raised while it listens. :func:`xid_events` listens for a given
time; the lasting effects of the Xids that matter for a start (uncorrectable ECC errors, a row
remapping pending or failed, a GPU lost or needing a reset) are read at every start by the
queries above and by the probe itself.
"""

from __future__ import annotations

import time
import typing as t

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NOT_SUPPORTED_CODES = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND)

# nvml.h
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_FEATURE_ENABLED = 1
NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x0000000000000008

# the health queries, in the order they are read (the names the record and its messages use)
QUERIES = ("ecc_mode", "ecc_uncorrected_volatile", "remapped_rows", "retired_pages_pending")
# the checks a reading gives (``nvml_queries``: every query answered or was not supported)
CHECKS = ("ecc_uncorrected", "remap_pending", "remap_failure", "retired_pages_pending", "xid", "nvml_queries")
# the checks that stop a start (the boot gate's ``gpu_health`` policy); ``nvml_queries`` only warns:
# a query that failed says nothing about the GPU's memory
BLOCKING_CHECKS = ("ecc_uncorrected", "remap_pending", "remap_failure", "retired_pages_pending", "xid")
HEALTH_POLICIES = ("refuse", "warn")

# Xids that say the GPU needs a reset or has failed (NVIDIA's Xid catalog): a double-bit ECC error (48),
# a row remapping failure (64), an NVLink error (74), a GPU that fell off the bus (79), a high single-bit
# ECC error rate (92), an uncontained ECC error (95), GSP errors (119, 120), an unrecovered ECC error (140).
# Other Xids (13, 31, 43: an application's fault; 94: a contained ECC error, the GPU goes on) are reported
# but stop nothing.
CRITICAL_XIDS = frozenset((48, 64, 74, 79, 92, 95, 119, 120, 140))


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _error_text(exc: BaseException) -> str:
    code = _code(exc)
    try:
        text = str(exc)
    except Exception:  # pylint: disable=broad-except  # the binding's __str__ may call into NVML
        text = type(exc).__name__
    return f"NVML error {code}: {text}" if code is not None else text


class _Reader:
    """Calls into the binding, sorting each query's failure into not supported or an error."""

    def __init__(self, nvml: t.Any, record: dict[str, t.Any]) -> None:
        self.nvml = nvml
        self.record = record
        self.error_type: t.Any = getattr(nvml, "NVMLError", Exception)

    def call(self, query: str, name: str, *args: t.Any) -> t.Any:
        func = getattr(self.nvml, name, None)
        if func is None:
            self.record["not_supported"].append(query)
            return None
        try:
            return func(*args)
        except self.error_type as exc:  # pylint: disable=catching-non-exception
            if _code(exc) in NOT_SUPPORTED_CODES:
                self.record["not_supported"].append(query)
            else:
                self.record["errors"][query] = f"{name}: {_error_text(exc)}"
            return None


def empty_health() -> dict[str, t.Any]:
    """A health record with nothing read."""
    return {"ecc_mode": None, "ecc_uncorrected_volatile": None, "remapped_rows": None, "retired_pages_pending": None,
            "not_supported": [], "errors": {}}


def read_health(nvml: t.Any, handle: t.Any) -> dict[str, t.Any]:
    """One GPU's health queries (``handle``: an open NVML device handle).

    ``ecc_mode``: ``enabled``/``disabled`` (current mode); ``ecc_uncorrected_volatile``: uncorrectable ECC
    errors since the driver loaded (not read with ECC disabled); ``remapped_rows``: ``corrected``,
    ``uncorrected`` (rows remapped for each kind of error), ``pending`` (a remapping waits for a GPU
    reset), ``failure`` (a remapping failed); ``retired_pages_pending``: pages wait to be retired at the
    next reset. ``None``: not read; ``not_supported`` lists those the GPU or driver does not support,
    ``errors`` the NVML error of each other query that failed.
    """
    record = empty_health()
    reader = _Reader(nvml, record)
    mode = reader.call("ecc_mode", "nvmlDeviceGetEccMode", handle)
    if mode is not None:
        record["ecc_mode"] = "enabled" if int(mode[0]) == NVML_FEATURE_ENABLED else "disabled"
    if record["ecc_mode"] != "disabled" and "ecc_mode" not in record["not_supported"]:
        count = reader.call("ecc_uncorrected_volatile", "nvmlDeviceGetTotalEccErrors", handle,
                            getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
                            getattr(nvml, "NVML_VOLATILE_ECC", NVML_VOLATILE_ECC))
        if count is not None:
            record["ecc_uncorrected_volatile"] = int(count)
    elif "ecc_mode" in record["not_supported"]:
        record["not_supported"].append("ecc_uncorrected_volatile")
    rows = reader.call("remapped_rows", "nvmlDeviceGetRemappedRows", handle)
    if rows is not None:
        corrected, uncorrected, pending, failure = (int(v) for v in rows)
        record["remapped_rows"] = {"corrected": corrected, "uncorrected": uncorrected, "pending": bool(pending),
                                   "failure": bool(failure)}
    retired = reader.call("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus", handle)
    if retired is not None:
        record["retired_pages_pending"] = int(retired) == NVML_FEATURE_ENABLED
    return record


def health_checks(health: t.Mapping[str, t.Any] | None) -> dict[str, bool]:
    """The checks a health record answers, each ``True`` when healthy; a check it cannot answer
    (not supported, not read, an NVML error) is left out."""
    if not health:
        return {}
    out: dict[str, bool] = {}
    if isinstance(health.get("ecc_uncorrected_volatile"), int):
        out["ecc_uncorrected"] = health["ecc_uncorrected_volatile"] == 0
    rows = health.get("remapped_rows")
    if isinstance(rows, t.Mapping):
        out["remap_pending"] = not rows.get("pending")
        out["remap_failure"] = not rows.get("failure")
    if isinstance(health.get("retired_pages_pending"), bool):
        out["retired_pages_pending"] = not health["retired_pages_pending"]
    xids = health.get("xid")
    if isinstance(xids, t.Mapping) and xids.get("listened_ms") is not None:
        out["xid"] = not xids.get("critical")
    out["nvml_queries"] = not health.get("errors")
    return out


def unhealthy(health: t.Mapping[str, t.Any] | None) -> list[tuple[str, str]]:
    """``(check, why)`` for every failing check of a health record, worst first."""
    if not health:
        return []
    checks = health_checks(health)
    out = []
    if checks.get("remap_failure") is False:
        out.append(("remap_failure", "a row remapping failed (the GPU needs service)"))
    if checks.get("ecc_uncorrected") is False:
        out.append(("ecc_uncorrected", f"{health['ecc_uncorrected_volatile']} uncorrectable ECC error(s) since the driver loaded"))
    if checks.get("remap_pending") is False:
        out.append(("remap_pending", "a row remapping is pending (reset the GPU to apply it)"))
    if checks.get("retired_pages_pending") is False:
        out.append(("retired_pages_pending", "pages are pending retirement (reset the GPU to retire them)"))
    if checks.get("xid") is False:
        out.append(("xid", f"critical Xid event(s) {', '.join(str(x) for x in health['xid']['critical'])} while the gate listened"))
    if checks.get("nvml_queries") is False:
        out.append(("nvml_queries", "health queries failed: " + "; ".join(f"{k}: {v}" for k, v in sorted(health["errors"].items()))))
    return out


def xid_events(nvml: t.Any, handles: t.Mapping[int, t.Any], wait_ms: int,
               clock: t.Callable[[], float] = time.monotonic) -> dict[int, dict[str, t.Any]]:
    """Listen for Xid events on the GPUs ``handles`` (index -> open handle) for ``wait_ms``.

    Returns per index ``{listened_ms, critical, other}`` (Xid numbers, in order), or
    ``{listened_ms: None, not_supported: True}`` / ``{listened_ms: None, error: ...}`` for a GPU
    whose registration failed. Only events raised while listening are seen (see the module's
    docstring); with ``wait_ms`` 0 nothing is listened for.
    """
    out: dict[int, dict[str, t.Any]] = {}
    if wait_ms <= 0 or not handles:
        return out
    error_type: t.Any = getattr(nvml, "NVMLError", Exception)
    xid_type = getattr(nvml, "nvmlEventTypeXidCriticalError", NVML_EVENT_TYPE_XID_CRITICAL_ERROR)
    try:
        event_set = nvml.nvmlEventSetCreate()
    except (AttributeError, error_type) as exc:  # pylint: disable=catching-non-exception
        missing = isinstance(exc, AttributeError) or _code(exc) in NOT_SUPPORTED_CODES
        for index in handles:
            out[index] = {"listened_ms": None, "not_supported": True} if missing else {"listened_ms": None, "error": _error_text(exc)}
        return out
    try:
        by_handle: dict[int, int] = {}
        for index, handle in handles.items():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, xid_type, event_set)
            except error_type as exc:  # pylint: disable=catching-non-exception
                out[index] = ({"listened_ms": None, "not_supported": True} if _code(exc) in NOT_SUPPORTED_CODES
                              else {"listened_ms": None, "error": _error_text(exc)})
                continue
            out[index] = {"listened_ms": wait_ms, "critical": [], "other": []}
            by_handle[_handle_key(handle)] = index
        if not by_handle:
            return out
        deadline = clock() + wait_ms / 1000.0
        while True:
            left_ms = int((deadline - clock()) * 1000)
            if left_ms <= 0:
                break
            try:
                data = nvml.nvmlEventSetWait_v2(event_set, left_ms)
            except error_type as exc:  # pylint: disable=catching-non-exception
                if _code(exc) != NVML_ERROR_TIMEOUT:
                    for index in by_handle.values():
                        out[index]["error"] = _error_text(exc)
                break
            seen_on = by_handle.get(_handle_key(data.device))
            if seen_on is None or not int(data.eventType) & xid_type:
                continue
            xid = int(data.eventData)
            out[seen_on]["critical" if xid in CRITICAL_XIDS else "other"].append(xid)
    finally:
        try:
            nvml.nvmlEventSetFree(event_set)
        except Exception:  # pylint: disable=broad-except  # freeing must not hide what was seen
            pass
    return out


def _handle_key(handle: t.Any) -> int:
    """A device handle as a number: a ctypes pointer's address (pynvml), else the object's identity."""
    import ctypes  # pylint: disable=import-outside-toplevel

    if isinstance(handle, ctypes._Pointer):  # pylint: disable=protected-access
        return ctypes.cast(handle, ctypes.c_void_p).value or 0
    return id(handle)


def listen_for_xids(nvml: t.Any, indices: t.Sequence[int], wait_ms: int) -> dict[int, dict[str, t.Any]]:
    """:func:`xid_events` in a session of its own (``nvmlInit`` .. ``nvmlShutdown``) for the GPUs
    ``indices``; a GPU that cannot be opened is recorded with its error."""
    if wait_ms <= 0 or not indices:
        return {}
    error_type: t.Any = getattr(nvml, "NVMLError", Exception)
    out: dict[int, dict[str, t.Any]] = {}
    try:
        nvml.nvmlInit()
    except error_type as exc:  # pylint: disable=catching-non-exception
        return {index: {"listened_ms": None, "error": _error_text(exc)} for index in indices}
    try:
        handles = {}
        for index in indices:
            try:
                handles[index] = nvml.nvmlDeviceGetHandleByIndex(index)
            except error_type as exc:  # pylint: disable=catching-non-exception
                out[index] = {"listened_ms": None, "error": _error_text(exc)}
        out.update(xid_events(nvml, handles, wait_ms))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # pylint: disable=broad-except  # shutdown failure must not hide the result
            pass
    return out
