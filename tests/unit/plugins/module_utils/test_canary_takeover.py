# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The canary's takeover of an instance's GPUs: the hold, the stops and the starts, against a fake systemctl."""
from __future__ import annotations

import json
import os
import stat
import typing as t

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _canary_takeover
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._canary_takeover import (
    ARGUMENT_SPEC,
    Takeover,
    TakeoverError,
    check_params,
    give_back,
    read_state,
    take,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._unit_files import Layout, UnitFilesError, canary_hold, canary_hold_path
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError


class FakeSystemd:
    """``systemctl show/is-active/stop/start`` over a dict of unit states; every call is kept."""

    def __init__(self, states: dict[str, str], fail: t.Iterable[tuple[str, str]] = ()) -> None:
        self.states = dict(states)
        self.fail = set(fail)
        self.calls: list[list[str]] = []

    def __call__(self, argv: t.Sequence[str]) -> tuple[int, str, str]:
        argv = list(argv)
        self.calls.append(argv)
        verb, units = argv[1], [a for a in argv[2:] if not a.startswith("--")]
        if verb == "show":
            return 0, "\n\n".join(f"ActiveState={self.states.get(u, 'inactive')}" for u in units) + "\n", ""
        if verb == "is-active":
            out = "".join(f"{self.states.get(u, 'inactive')}\n" for u in units)
            return (0 if all(self.states.get(u) == "active" for u in units) else 3), out, ""
        for unit in units:
            if (verb, unit) in self.fail:
                return 1, "", f"Job for {unit} failed."
        for unit in units:
            self.states[unit] = "inactive" if verb == "stop" else "active"
        return 0, "", ""

    def verbs(self) -> list[str]:
        return [" ".join(c[1:]) for c in self.calls if c[1] in ("stop", "start")]


def takeover(tmp_path, **over: t.Any) -> Takeover:
    params = {"instance": "main", "state_dir": str(tmp_path / "gpufleet"), "stop_service": True, "stop_units": []}
    params.update(over)
    return check_params(params)


def hold_of(tmp_path) -> dict[str, t.Any] | None:
    return canary_hold(Layout(state_dir=str(tmp_path / "gpufleet")), "main")


def test_a_serving_instance_is_held_stopped_and_started_again_and_the_hold_taken_off(tmp_path):
    systemd = FakeSystemd({"vllm-main.service": "active", "old-vllm.service": "active", "idle.service": "inactive"})
    over = takeover(tmp_path, stop_units=["old-vllm.service", "idle.service"])
    state = read_state(over, systemd)
    assert (state.serving, state.active, state.held, state.running_units) == (True, True, False, ["old-vllm.service"])
    take(over, state, systemd)
    # the hold is there before anything stops, and names the other units that ran
    hold = hold_of(tmp_path)
    assert hold is not None and hold["units"] == ["old-vllm.service"] and "since" in hold
    path = canary_hold_path(Layout(state_dir=str(tmp_path / "gpufleet")), "main")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert systemd.verbs() == ["stop old-vllm.service", "stop vllm-main.service"]
    assert systemd.states["vllm-main.service"] == "inactive"
    give_back(over, state, systemd)
    assert systemd.verbs()[2:] == ["start old-vllm.service", "start vllm-main.service"]
    assert state.errors == [] and state.hold_removed and hold_of(tmp_path) is None
    result = state.as_result()
    assert result["instance_serving"] and result["stopped_units"] == ["old-vllm.service"] and result["hold_written"]


def test_an_instance_that_does_not_serve_is_neither_held_nor_started(tmp_path):
    systemd = FakeSystemd({})
    over = takeover(tmp_path)
    state = read_state(over, systemd)
    take(over, state, systemd)
    give_back(over, state, systemd)
    assert systemd.verbs() == [] and not state.hold_written and hold_of(tmp_path) is None
    assert not (tmp_path / "gpufleet").exists(), "nothing written for an instance that does not serve"


def test_a_cut_off_canarys_hold_counts_as_serving_and_its_units_start_again(tmp_path):
    """A hold left by a canary cut off earlier: the instance is stopped, yet it served; the units it names
    are started with it, and the hold goes once they run."""
    layout = Layout(state_dir=str(tmp_path / "gpufleet"))
    os.makedirs(layout.kept_dir)
    with open(canary_hold_path(layout, "main"), "w", encoding="utf-8") as handle:
        json.dump({"since": "2026-12-01T00:00:00+00:00", "units": ["old-vllm.service", "not-ours.service"]}, handle)
    systemd = FakeSystemd({"old-vllm.service": "inactive"})
    over = takeover(tmp_path, stop_units=["old-vllm.service"])
    state = read_state(over, systemd)
    # only units this canary takes over are started (a unit the hold names that is not one of them is not)
    assert (state.serving, state.active, state.held, state.running_units) == (True, False, True, ["old-vllm.service"])
    take(over, state, systemd)
    assert not state.hold_written, "the earlier hold is kept as it is"
    give_back(over, state, systemd)
    assert systemd.states == {"old-vllm.service": "active", "vllm-main.service": "active"}
    assert hold_of(tmp_path) is None


def test_a_unit_that_does_not_start_again_keeps_the_hold(tmp_path):
    systemd = FakeSystemd({"vllm-main.service": "active"}, fail=[("start", "vllm-main.service")])
    over = takeover(tmp_path)
    state = read_state(over, systemd)
    take(over, state, systemd)
    give_back(over, state, systemd)
    assert state.errors and "systemctl start vllm-main.service failed (rc 1): Job for vllm-main.service failed." in state.errors[0]
    assert not state.hold_removed and hold_of(tmp_path) is not None, "the next run sees that the instance served"


def test_a_hold_that_cannot_be_written_stops_nothing(tmp_path, monkeypatch):
    def read_only(path: str, *_args: t.Any) -> None:
        raise UnitFilesError(f"{path}: cannot write: Read-only file system")
    monkeypatch.setattr(_canary_takeover, "atomic_write", read_only)
    systemd = FakeSystemd({"vllm-main.service": "active"})
    over = takeover(tmp_path)
    state = read_state(over, systemd)
    with pytest.raises(TakeoverError, match=r"cannot leave the hold on vllm-main.service .*Read-only file system.*nothing was stopped"):
        take(over, state, systemd)
    assert systemd.verbs() == [] and systemd.states["vllm-main.service"] == "active"


def test_a_failed_stop_still_starts_what_was_stopped(tmp_path):
    systemd = FakeSystemd({"vllm-main.service": "active", "old-vllm.service": "active"}, fail=[("stop", "vllm-main.service")])
    over = takeover(tmp_path, stop_units=["old-vllm.service"])
    state = read_state(over, systemd)
    with pytest.raises(TakeoverError, match=r"systemctl stop vllm-main.service failed"):
        take(over, state, systemd)
    give_back(over, state, systemd)
    assert systemd.states["old-vllm.service"] == "active" and state.errors == [] and hold_of(tmp_path) is None


def test_stop_service_false_leaves_every_unit_alone(tmp_path):
    systemd = FakeSystemd({"vllm-main.service": "active", "old-vllm.service": "active"})
    over = takeover(tmp_path, stop_service=False, stop_units=["old-vllm.service"])
    state = read_state(over, systemd)
    take(over, state, systemd)
    give_back(over, state, systemd)
    assert systemd.verbs() == [] and hold_of(tmp_path) is None


def test_is_active_output_that_does_not_match_the_units_is_an_error(tmp_path):
    def short(argv: t.Sequence[str]) -> tuple[int, str, str]:
        if argv[1] == "show":
            return 0, "ActiveState=active\n", ""
        return 1, "", "Failed to connect to bus"
    with pytest.raises(TakeoverError, match="expected 1 lines, got 0: Failed to connect to bus"):
        read_state(takeover(tmp_path, stop_units=["old-vllm.service"]), short)


@pytest.mark.parametrize(("over", "field"), [
    ({"instance": "../etc"}, "takeover.instance"),
    ({"stop_units": ["ok.service", ""]}, "takeover.stop_units[1]"),
    ({"state_dir": "relative/dir"}, "takeover.state_dir"),
    ({"state_dir": "/etc/gpufleet/../../tmp"}, "takeover.state_dir: must not contain '..'"),
])
def test_bad_options_name_the_field(tmp_path, over, field):
    with pytest.raises(ValidationError, match=field.replace("[", r"\[").replace("]", r"\]")):
        takeover(tmp_path, **over)


def test_the_option_spec_defaults_the_state_dir():
    assert ARGUMENT_SPEC["state_dir"]["default"] == "/etc/gpufleet" and ARGUMENT_SPEC["instance"]["required"]
