# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""GPU health from NVML: every query supported or not, per GPU generation; the checks; Xid events."""

from __future__ import annotations

import itertools
import types
from typing import Any

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu import _gpu_health as h

NOT_SUPPORTED, TIMEOUT, NOT_FOUND_FN, GPU_LOST, UNKNOWN = 3, 10, 13, 15, 999


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML code {value}")
        self.value = value


FUNCTIONS = {
    "ecc_mode": "nvmlDeviceGetEccMode",
    "ecc_uncorrected_volatile": "nvmlDeviceGetTotalEccErrors",
    "remapped_rows": "nvmlDeviceGetRemappedRows",
    "retired_pages_pending": "nvmlDeviceGetRetiredPagesPendingStatus",
}


def binding(answers: dict[str, Any] | None = None, failing: dict[str, int] | None = None, absent: tuple[str, ...] = ()) -> Any:
    """A pynvml-like object: ``answers`` per query, ``failing`` query -> NVML code, ``absent``: functions the binding lacks."""
    values = {"ecc_mode": [1, 1], "ecc_uncorrected_volatile": 0, "remapped_rows": (0, 0, 0, 0), "retired_pages_pending": 0,
              **(answers or {})}
    calls: list[tuple[Any, ...]] = []
    nvml = types.SimpleNamespace(NVMLError=NVMLError, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0, calls=calls)
    for query, name in FUNCTIONS.items():
        if name in absent:
            continue

        def call(*args: Any, _query: str = query, _name: str = name) -> Any:
            calls.append((_name, *args))
            if _query in (failing or {}):
                raise NVMLError((failing or {})[_query])
            return values[_query]
        setattr(nvml, name, call)
    return nvml


def test_a_healthy_a100_answers_every_query():
    health = h.read_health(binding(), "handle")
    assert health == {"ecc_mode": "enabled", "ecc_uncorrected_volatile": 0,
                      "remapped_rows": {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False},
                      "retired_pages_pending": False, "not_supported": [], "errors": {}}
    assert h.health_checks(health) == {"ecc_uncorrected": True, "remap_pending": True, "remap_failure": True,
                                       "retired_pages_pending": True, "nvml_queries": True}
    assert h.unhealthy(health) == []


def test_the_uncorrected_volatile_counter_is_the_one_read():
    nvml = binding()
    h.read_health(nvml, "gpu0")
    assert ("nvmlDeviceGetTotalEccErrors", "gpu0", 1, 0) in nvml.calls


def test_an_h200_remaps_rows_and_does_not_support_retired_pages():
    """Driver 580 on an H200: remapped rows, ECC and its mode answer; retired pages are NOT_SUPPORTED."""
    health = h.read_health(binding({"remapped_rows": (2, 1, 0, 0)}, failing={"retired_pages_pending": NOT_SUPPORTED}), "h")
    assert health["not_supported"] == ["retired_pages_pending"] and health["errors"] == {}
    assert health["retired_pages_pending"] is None
    assert health["remapped_rows"] == {"corrected": 2, "uncorrected": 1, "pending": False, "failure": False}
    checks = h.health_checks(health)
    assert "retired_pages_pending" not in checks, "a query the GPU does not support is no check, healthy or not"
    assert all(checks.values()), "rows remapped in the past with none pending are healthy"


def test_a_volta_retires_pages_and_has_no_row_remapping():
    health = h.read_health(binding({"retired_pages_pending": 1}, failing={"remapped_rows": NOT_SUPPORTED}), "v")
    assert health["not_supported"] == ["remapped_rows"]
    assert h.unhealthy(health) == [("retired_pages_pending", "pages are pending retirement (reset the GPU to retire them)")]


def test_a_geforce_card_has_no_ecc_and_nothing_is_an_error():
    failing = {query: NOT_SUPPORTED for query in FUNCTIONS}
    health = h.read_health(binding(failing=failing), "g")
    assert sorted(health["not_supported"]) == sorted(FUNCTIONS) and health["errors"] == {}
    assert h.health_checks(health) == {"nvml_queries": True}


@pytest.mark.parametrize("unsupported", [c for n in range(len(FUNCTIONS) + 1) for c in itertools.combinations(FUNCTIONS, n)])
@pytest.mark.parametrize("how", ["not_supported", "function_not_found", "binding_lacks_it"])
def test_every_combination_of_unsupported_queries_is_recorded_and_never_an_error(unsupported, how):
    if how == "binding_lacks_it":
        nvml = binding(absent=tuple(FUNCTIONS[q] for q in unsupported))
    else:
        nvml = binding(failing={q: NOT_SUPPORTED if how == "not_supported" else NOT_FOUND_FN for q in unsupported})
    health = h.read_health(nvml, "x")
    # without the ECC mode the counter is not read either (ECC may be off): it is recorded as not supported
    expected = set(unsupported) | ({"ecc_uncorrected_volatile"} if "ecc_mode" in unsupported else set())
    assert set(health["not_supported"]) == expected
    assert health["errors"] == {}
    for query in expected:
        assert health[query] is None
    checks = h.health_checks(health)
    assert checks["nvml_queries"] is True and all(checks.values())
    assert h.unhealthy(health) == []


def test_ecc_disabled_reads_no_counter():
    nvml = binding({"ecc_mode": [0, 0]})
    health = h.read_health(nvml, "x")
    assert health["ecc_mode"] == "disabled" and health["ecc_uncorrected_volatile"] is None
    assert not any(c[0] == "nvmlDeviceGetTotalEccErrors" for c in nvml.calls)
    assert "ecc_uncorrected" not in h.health_checks(health)


def test_other_nvml_errors_are_recorded_per_query_and_the_rest_is_read():
    health = h.read_health(binding({"remapped_rows": (0, 0, 1, 0)}, failing={"ecc_uncorrected_volatile": UNKNOWN}), "x")
    assert list(health["errors"]) == ["ecc_uncorrected_volatile"]
    assert "nvmlDeviceGetTotalEccErrors: NVML error 999" in health["errors"]["ecc_uncorrected_volatile"]
    assert health["remapped_rows"]["pending"] is True, "one failed query does not stop the others"
    checks = h.health_checks(health)
    assert checks["nvml_queries"] is False and "ecc_uncorrected" not in checks and checks["remap_pending"] is False
    assert [c for c, _why in h.unhealthy(health)] == ["remap_pending", "nvml_queries"]


@pytest.mark.parametrize("answers, check, words", [
    ({"ecc_uncorrected_volatile": 3}, "ecc_uncorrected", "3 uncorrectable ECC error(s) since the driver loaded"),
    ({"remapped_rows": (0, 1, 1, 0)}, "remap_pending", "a row remapping is pending (reset the GPU to apply it)"),
    ({"remapped_rows": (0, 1, 0, 1)}, "remap_failure", "a row remapping failed"),
    ({"retired_pages_pending": 1}, "retired_pages_pending", "pages are pending retirement"),
])
def test_each_fault_fails_its_check(answers, check, words):
    health = h.read_health(binding(answers), "x")
    checks = h.health_checks(health)
    assert checks[check] is False
    assert [c for c, ok in checks.items() if not ok] == [check]
    ((named, why),) = h.unhealthy(health)
    assert named == check and words in why
    assert check in h.BLOCKING_CHECKS


# ---------------------------------------------------------------- Xid events

class Events:
    """Event-set calls of a pynvml-like binding: ``pending`` (handle, xid) delivered in order, then timeouts."""

    def __init__(self, pending: list[tuple[str, int]], unsupported: tuple[str, ...] = (), now: list[float] | None = None) -> None:
        self.pending = list(pending)
        self.unsupported = unsupported
        self.registered: list[str] = []
        self.freed = False
        self.now = now if now is not None else [0.0]
        self.NVMLError = NVMLError  # pylint: disable=invalid-name

    def nvmlEventSetCreate(self) -> str:  # pylint: disable=invalid-name
        return "set"

    def nvmlDeviceRegisterEvents(self, handle: str, types_: int, event_set: str) -> None:  # pylint: disable=invalid-name
        assert types_ == h.NVML_EVENT_TYPE_XID_CRITICAL_ERROR and event_set == "set"
        if handle in self.unsupported:
            raise NVMLError(NOT_SUPPORTED)
        self.registered.append(handle)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:  # pylint: disable=invalid-name
        for pos, (handle, xid) in enumerate(self.pending):
            if handle in self.registered:
                del self.pending[pos]
                return types.SimpleNamespace(device=handle, eventType=h.NVML_EVENT_TYPE_XID_CRITICAL_ERROR, eventData=xid)
        self.now[0] += timeout_ms / 1000.0
        raise NVMLError(TIMEOUT)

    def nvmlEventSetFree(self, event_set: str) -> None:  # pylint: disable=invalid-name
        self.freed = True


def test_xid_events_seen_while_listening_are_sorted_into_critical_and_other():
    handles = {0: "h0", 1: "h1"}
    nvml = Events([("h1", 13), ("h1", 79), ("h0", 94)])
    seen = h.xid_events(nvml, handles, 200, clock=lambda: nvml.now[0])
    assert seen == {0: {"listened_ms": 200, "critical": [], "other": [94]},
                    1: {"listened_ms": 200, "critical": [79], "other": [13]}}
    assert nvml.freed
    assert h.health_checks({"xid": seen[1], "errors": {}})["xid"] is False
    assert h.health_checks({"xid": seen[0], "errors": {}})["xid"] is True, "an application's Xid stops nothing"
    assert h.unhealthy({"xid": seen[1], "errors": {}}) == [("xid", "critical Xid event(s) 79 while the gate listened")]


def test_a_gpu_that_cannot_register_for_events_is_not_supported_and_not_judged():
    nvml = Events([], unsupported=("h0",))
    seen = h.xid_events(nvml, {0: "h0", 1: "h1"}, 50, clock=lambda: nvml.now[0])
    assert seen[0] == {"listened_ms": None, "not_supported": True}
    assert seen[1] == {"listened_ms": 50, "critical": [], "other": []}
    assert "xid" not in h.health_checks({"xid": seen[0], "errors": {}})


def test_no_wait_listens_to_nothing():
    nvml = Events([("h0", 48)])
    assert h.xid_events(nvml, {0: "h0"}, 0) == {} and nvml.registered == []


def test_a_binding_without_event_sets_is_not_supported():
    seen = h.xid_events(types.SimpleNamespace(NVMLError=NVMLError), {0: "h0"}, 100)
    assert seen == {0: {"listened_ms": None, "not_supported": True}}
