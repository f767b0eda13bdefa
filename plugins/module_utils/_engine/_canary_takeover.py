# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A canary's hold on an instance's GPUs: stop what serves on them, and start it again afterwards.

A canary on a serving host needs the GPUs its production instance (and the hand-written units
that instance takes over) hold. In one module run (``vllm_canary``'s ``takeover``):

1. :func:`read_state`: the instance's unit state, the other units' states, and a hold a
   cut-off canary left (its units served before that canary, and are started again after this one);
2. :func:`take`: leave the hold *before* anything stops (root, 0600, written in one rename), so a
   canary cut off from here on (its host rebooted, the module killed) leaves the next run the
   knowledge that the instance served; then stop the other units and the instance;
3. :func:`give_back` (in ``finally``): start them again, and take the hold off only once
   everything it names runs again. A unit that does not start keeps the hold: the next run's
   snapshot and canary see the instance as serving and start it.

The hold's path and reader are :mod:`._unit_files`' (``canary_hold_path``, ``canary_hold``):
``vllm_unit`` reads the same file. Plain Python: the command runner is handed in.
"""
from __future__ import annotations

import datetime
import json
import os
import typing as t
from dataclasses import dataclass, field

from .._defaults import default
from .._units._instance import unit_name
from .._units._unit_files import Layout, SystemctlRunner, UnitFilesError, atomic_write, canary_hold, canary_hold_path, ensure_absent, ensure_dir, systemctl_show
from .._validate import abs_path, instance_name, text

__all__ = ["ARGUMENT_SPEC", "SERVING_STATES", "Takeover", "TakeoverError", "TakeoverState", "check_params", "give_back", "read_state",
           "take"]

# the module option ``takeover`` (vllm_canary)
ARGUMENT_SPEC: dict[str, dict[str, t.Any]] = {
    "instance": {"type": "str", "required": True},
    "state_dir": {"type": "path", "default": default("state_dir")},
    "stop_service": {"type": "bool", "default": True},
    "stop_units": {"type": "list", "elements": "str", "default": []},
}

# the unit states in which a unit holds its GPUs (or is about to)
SERVING_STATES = ("active", "activating", "reloading")


class TakeoverError(Exception):
    """A unit could not be read, stopped or started, or the hold written; the message says which."""


@dataclass(frozen=True)
class Takeover:
    """What the canary takes over: ``instance``'s unit (when ``stop_service``) and ``stop_units`` that run."""

    instance: str
    state_dir: str
    stop_service: bool = True
    stop_units: tuple[str, ...] = ()

    @classmethod
    def from_params(cls, params: t.Mapping[str, t.Any]) -> Takeover:
        return cls(instance=str(params["instance"]), state_dir=str(params["state_dir"]), stop_service=bool(params["stop_service"]),
                   stop_units=tuple(str(u) for u in params["stop_units"] or []))


@dataclass
class TakeoverState:
    """The instance and its units as the canary found them, and what it did to them."""

    unit: str
    active_state: str
    active: bool
    # the instance serves now, or served before a cut-off canary (its hold is there)
    serving: bool
    held: bool
    # the other units the canary stops (and starts again): the running ones and those a held canary stopped
    running_units: list[str]
    hold_written: bool = False
    stopped: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    hold_removed: bool = False

    def as_result(self) -> dict[str, t.Any]:
        """The module's ``takeover`` return value."""
        return {"unit": self.unit, "instance_serving": self.serving, "instance_active": self.active, "active_state": self.active_state,
                "held_before": self.held,
                "stopped_units": list(self.running_units), "hold_written": self.hold_written, "stopped": list(self.stopped),
                "started": list(self.started), "hold_removed": self.hold_removed, "errors": list(self.errors)}


def check_params(params: t.Mapping[str, t.Any]) -> Takeover:
    """The checked option (instance name, units, an absolute state directory)."""
    instance_name(params["instance"], "takeover.instance")
    for i, unit in enumerate(params["stop_units"] or []):
        text(unit, f"takeover.stop_units[{i}]")
    # the hold is written below it: absolute and normalised (no '..' leading out of it)
    abs_path(params["state_dir"], "takeover.state_dir")
    return Takeover.from_params(params)


def _layout(takeover: Takeover) -> Layout:
    return Layout(state_dir=takeover.state_dir)


def read_state(takeover: Takeover, run: SystemctlRunner) -> TakeoverState:
    """The instance's state, the running ``stop_units`` and a hold left by a cut-off canary; reads only."""
    unit = unit_name(takeover.instance)
    try:
        hold = canary_hold(_layout(takeover), takeover.instance)
    except UnitFilesError as exc:
        # unreadable is not "no hold": the instance may have served before a cut-off canary
        raise TakeoverError(f"cannot read the hold a cut-off canary may have left on {unit} ({exc}); nothing was stopped") from None
    try:
        props = systemctl_show(run, properties=("ActiveState",))([unit])
    except UnitFilesError as exc:
        raise TakeoverError(f"cannot read the instance's unit {unit}: {exc}") from None
    active_state = props.get(unit, {}).get("ActiveState", "")
    active = active_state in SERVING_STATES
    held_units = [str(u) for u in (hold or {}).get("units") or [] if isinstance(u, str)]
    running: list[str] = []
    if takeover.stop_service and takeover.stop_units:
        # is-active exits non-zero when a unit is not active: its output, one line per unit, is the answer
        _rc, out, err = run(["systemctl", "is-active", *takeover.stop_units])
        states = out.splitlines()
        if len(states) != len(takeover.stop_units):
            raise TakeoverError(f"systemctl is-active {' '.join(takeover.stop_units)}: expected {len(takeover.stop_units)} "
                                f"lines, got {len(states)}: {err.strip() or out.strip()}")
        running = [u for u, state in zip(takeover.stop_units, states) if state.strip() in SERVING_STATES]
    running += [u for u in held_units if u in takeover.stop_units]
    return TakeoverState(unit=unit, active_state=active_state, active=active, serving=active or hold is not None, held=hold is not None,
                         running_units=list(dict.fromkeys(running)))


def _write_hold(takeover: Takeover, state: TakeoverState, now: datetime.datetime) -> None:
    layout = _layout(takeover)
    try:
        if not os.path.isdir(layout.state_dir):
            os.makedirs(layout.state_dir, 0o750)
        ensure_dir(layout.kept_dir, 0, 0, 0o700, False)
        doc = {"since": now.isoformat(), "units": state.running_units}
        atomic_write(canary_hold_path(layout, takeover.instance), (json.dumps(doc, indent=4) + "\n").encode("utf-8"), 0, 0, 0o600)
    except (OSError, UnitFilesError) as exc:
        raise TakeoverError(f"cannot leave the hold on {state.unit} before the canary stops it ({exc}); nothing was stopped") from None


def _systemctl(run: SystemctlRunner, verb: str, units: t.Sequence[str]) -> str | None:
    """``systemctl VERB UNITS``; the error, or None."""
    rc, _out, err = run(["systemctl", verb, *units])
    return None if rc == 0 else f"systemctl {verb} {' '.join(units)} failed (rc {rc}): {err.strip()}"


def take(takeover: Takeover, state: TakeoverState, run: SystemctlRunner, now: datetime.datetime | None = None) -> None:
    """Leave the hold (a serving instance, none there yet), then stop the other running units and the instance.

    Raises TakeoverError when the hold cannot be written (nothing stopped) or a stop fails (the
    caller gives back what :attr:`TakeoverState.stopped` lists, in ``finally``).
    """
    if takeover.stop_service and state.serving and not state.held:
        _write_hold(takeover, state, now or datetime.datetime.now(datetime.timezone.utc))
        state.hold_written = True
    if state.running_units:
        # listed before the call: a stop that fails half way is started again all the same
        state.stopped.extend(state.running_units)
        error = _systemctl(run, "stop", state.running_units)
        if error:
            raise TakeoverError(error)
    if takeover.stop_service and state.active:
        state.stopped.append(state.unit)
        error = _systemctl(run, "stop", [state.unit])
        if error:
            raise TakeoverError(error)


def give_back(takeover: Takeover, state: TakeoverState, run: SystemctlRunner) -> None:
    """Start the other units and the instance again (the instance: whenever it served, a held one too),
    then take the hold off, only when everything started; errors in :attr:`TakeoverState.errors`."""
    # all of them, as a held canary left them stopped too (start is a no-op for a unit that runs)
    if state.running_units:
        error = _systemctl(run, "start", state.running_units)
        if error:
            state.errors.append(error)
        else:
            state.started.extend(state.running_units)
    if takeover.stop_service and state.serving:
        error = _systemctl(run, "start", [state.unit])
        if error:
            state.errors.append(error)
        else:
            state.started.append(state.unit)
    if takeover.stop_service and not state.errors:
        try:
            state.hold_removed = ensure_absent(canary_hold_path(_layout(takeover), takeover.instance), False)
        except UnitFilesError as exc:
            state.errors.append(str(exc))
