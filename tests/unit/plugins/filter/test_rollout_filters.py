# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The run_settings filter's own part: values that do not resolve, and the argument spec."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError, AnsibleUndefinedVariable
from jinja2 import Undefined
from jinja2.exceptions import UndefinedError

from ansible_collections.gpufleet.vllm.plugins.filter.rollout import FilterModule

run_settings = FilterModule().filters()["run_settings"]

SPEC = {
    "gpufleet_rollout_serial": {"type": "raw", "description": "batches"},
    "gpufleet_profile_store": {"type": "path", "required": True, "description": "store"},
    "gpufleet_report_dir": {"type": "path", "description": "reports"},
    "gpufleet_split_policy": {"type": "str", "choices": ["warn", "fail"], "default": "warn", "description": "split"},
}


class LazyVars(Mapping[str, Any]):
    """Variables as a play hands them to a filter: reading one templates it, and may fail."""

    def __init__(self, values: dict[str, Any], failing: dict[str, Exception]) -> None:
        self._values, self._failing = values, failing

    def __getitem__(self, name: str) -> Any:
        if name in self._failing:
            raise self._failing[name]
        return self._values[name]

    def __contains__(self, name: object) -> bool:
        return name in self._values or name in self._failing

    def __iter__(self) -> Iterator[str]:
        return iter([*self._values, *self._failing])

    def __len__(self) -> int:
        return len(self._values) + len(self._failing)


@pytest.mark.parametrize("failure", [UndefinedError("'fleet_root' is undefined"), AnsibleUndefinedVariable("'fleet_root' is undefined")])
def test_a_setting_undefined_in_the_play_comes_from_the_first_host(failure: Exception) -> None:
    given = LazyVars({"gpufleet_profile_store": "/srv/profiles"}, {"gpufleet_report_dir": failure})
    first_host = {"gpufleet_report_dir": "/srv/fleet/reports"}
    assert run_settings(SPEC, given, first_host) == {"gpufleet_profile_store": "/srv/profiles", "gpufleet_report_dir": "/srv/fleet/reports"}


def test_an_undefined_value_is_not_given_anywhere() -> None:
    given = {"gpufleet_profile_store": "/srv/profiles", "gpufleet_report_dir": Undefined(name="fleet_root")}
    assert run_settings(SPEC, given, LazyVars({}, {"gpufleet_report_dir": UndefinedError("x")})) == {"gpufleet_profile_store": "/srv/profiles"}


def test_the_settings_are_validated_against_the_spec_naming_the_field() -> None:
    with pytest.raises(AnsibleFilterError, match=r"Validation of arguments failed:\n.*gpufleet_split_policy must be one of: warn, fail"):
        run_settings(SPEC, {"gpufleet_profile_store": "/srv/profiles", "gpufleet_split_policy": "maybe"}, {})
    with pytest.raises(AnsibleFilterError, match="missing required arguments: gpufleet_profile_store"):
        run_settings(SPEC, {}, {"gpufleet_report_dir": ""})


def test_a_list_of_names_is_not_validated_and_defaults_are_not_added() -> None:
    assert run_settings(list(SPEC), {"gpufleet_split_policy": "maybe"}, {}) == {"gpufleet_split_policy": "maybe"}
    assert run_settings(SPEC, {"gpufleet_profile_store": "/srv/profiles"}, {}) == {"gpufleet_profile_store": "/srv/profiles"}


@pytest.mark.parametrize("serial, message", [
    ("1,0,50%", r"gpufleet_rollout_serial\[1\]: expected a positive int or a share 'N%' \(0 < N <= 100\), got '0'"),
    ("[]", "gpufleet_rollout_serial: expected at least one batch size"),
    ([1, "150%"], r"gpufleet_rollout_serial\[1\]: .*got '150%'"),
    ("\u0661", r"gpufleet_rollout_serial\[0\]: .*got '\u0661'"),
])
def test_serial_batches_are_checked_as_the_batch_arithmetic_reads_them(serial: Any, message: str) -> None:
    with pytest.raises(AnsibleFilterError, match="^run_settings: " + message):
        run_settings(SPEC, {"gpufleet_profile_store": "/srv/profiles", "gpufleet_rollout_serial": serial}, {})
    assert run_settings(SPEC, {"gpufleet_profile_store": "/srv/profiles", "gpufleet_rollout_serial": "1,10%"}, {})[
        "gpufleet_rollout_serial"] == ["1", "10%"]


@pytest.mark.parametrize("names, given, inventory, message", [
    ("gpufleet_report_dir", {}, {}, "expected the names of the run settings"),
    (SPEC, [], {}, "must be mappings"),
    (SPEC, {}, None, "must be mappings"),
])
def test_bad_inputs_are_refused(names: Any, given: Any, inventory: Any, message: str) -> None:
    with pytest.raises(AnsibleFilterError, match=message):
        run_settings(names, given, inventory)


@pytest.mark.parametrize("key, path, system", [("gpufleet_report_dir", "/etc/gpufleet/reports", "/etc"),
                                               ("gpufleet_profile_store", "/usr/share/profiles", "/usr"),
                                               ("gpufleet_report_dir", "/var/lib/dpkg/x", "/var/lib/dpkg"),
                                               ("gpufleet_profile_store", "/proc", "/proc")])
def test_controller_directories_under_a_system_directory_are_refused_unless_allowed(key: str, path: str, system: str) -> None:
    spec = run_spec()
    given = {"gpufleet_profile_store": "/srv/profiles", key: path}
    with pytest.raises(AnsibleFilterError, match=f"run_settings: {key}: {path} is (under )?the system directory {system}; .*"
                                                 "gpufleet_allow_system_paths"):
        run_settings(spec, given, {})
    assert run_settings(spec, dict(given, gpufleet_allow_system_paths=True), {})[key] == path


@pytest.mark.parametrize("over, field", [({"gpufleet_lease_ttl": 10}, "gpufleet_lease_ttl"),
                                         ({"gpufleet_lease_wait": 10**6}, "gpufleet_lease_wait")])
def test_lease_settings_out_of_bounds_name_the_setting(over: dict[str, Any], field: str) -> None:
    with pytest.raises(AnsibleFilterError, match=f"run_settings: {field}: "):
        run_settings(run_spec(), {"gpufleet_profile_store": "/srv/profiles", **over}, {})


def run_spec() -> dict[str, Any]:
    """The run settings' spec the playbooks validate with."""
    path = Path(__file__).resolve().parents[4] / "playbooks" / "vars" / "rollout_argument_spec.yml"
    return dict(yaml.safe_load(path.read_text(encoding="utf-8"))["gpufleet_argument_spec"]["run"])


@pytest.mark.parametrize("value", [0, 10, 10**9])
def test_a_remote_timeout_out_of_bounds_names_the_setting(value: int) -> None:
    with pytest.raises(AnsibleFilterError, match="run_settings: gpufleet_remote_timeout: "):
        run_settings(run_spec(), {"gpufleet_profile_store": "/srv/profiles", "gpufleet_remote_timeout": value}, {})
