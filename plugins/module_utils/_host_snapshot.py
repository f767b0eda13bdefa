# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""One host's snapshot for planning: its GPUs, its instances' units and plan records, its probe interpreter.

What the planning plays need from a host, read in one module run (``vllm_host_snapshot``):
the NVML probe of :mod:`._gpu_memory` (every GPU with its UUID, free memory samples, this
host's own engine processes), and for every instance its unit's state (one ``systemctl
show`` for all of them) and the plan record its running unit passed its boot check with
(``_unit_files.read_plan``: ``{}`` when there is none or it cannot be parsed), and with an
engine executable the runtime fields of the compatibility key its venv reports (as
``vllm_runtime_info`` reads them, :func:`._compat.read_runtime`), and with a runtime venv the
install record of the engine runtime (:func:`install_record`: the release the ``vllm_runtime``
role switched the venv to, ``_unit_files.runtime_link``, and that release's
``.gpufleet-complete`` stamp), and with a model whether the service user can read all of it
(:func:`._service_account.check_model`, where the user exists already). The unit names come
from :mod:`._instance`. Plain Python: the NVML binding and the command runner are handed in.
"""
from __future__ import annotations

import json
import os
import socket
import typing as t

from ._defaults import default
from ._gpu._gpu_memory import ARGUMENT_SPEC as PROBE_ARGUMENT_SPEC, check_params as check_probe_params, host_facts, read as read_gpus
from ._plan._compat import RUNTIME_KEY_FIELDS, CompatError, read_runtime
from ._units._instance import clashes, unit_name
from ._units._service_account import AccountError, check_model
from ._units._unit_files import Layout, UnitFilesError, read_bytes, read_plan, runtime_link, systemctl_show
from ._validate import ValidationError, abs_path, account_name, instance_name, text

__all__ = ["ARGUMENT_SPEC", "RELEASE_STAMP", "UNIT_PROPERTIES", "HostSnapshotError", "check_params", "engine_runtime", "install_record",
           "model_access", "resolve", "snapshot", "snapshot_facts"]

ARGUMENT_SPEC: dict[str, dict[str, t.Any]] = {
    **PROBE_ARGUMENT_SPEC,
    "instances": {"type": "list", "elements": "str", "default": ["vllm"]},
    "adopt_units": {"type": "list", "elements": "str", "default": []},
    "state_dir": {"type": "path", "default": default("state_dir")},
    "engine_executable": {"type": "path"},
    "runtime_venv": {"type": "path"},
    "model": {"type": "str"},
    "model_user": {"type": "str", "default": default("service_user")},
    "resolve": {"type": "list", "elements": "str", "default": []},
}

# the stamp the vllm_runtime role writes last into a release it installed completely (roles/vllm_runtime,
# tasks/release.yml): JSON {package, version, python}; a venv kept as a release has {package: unmanaged, kept_from}
RELEASE_STAMP = ".gpufleet-complete"

# what the snapshot reads of every instance's unit
UNIT_PROPERTIES = ("LoadState", "ActiveState", "SubState")

Runner = t.Callable[[t.Sequence[str]], t.Tuple[int, str, str]]


class HostSnapshotError(Exception):
    """The units cannot be read (systemctl failed); the message names the host."""


def check_params(params: t.Mapping[str, t.Any]) -> None:
    """The probe's checks, then every instance name, adopted unit and the state directory."""
    check_probe_params(dict(params))
    names = [instance_name(n, f"instances[{i}]") for i, n in enumerate(params["instances"] or [])]
    for clash in clashes([{"name": n} for n in names]):
        raise ValidationError(f"instances[{clash.position}]: {clash.value!r} is also instances[{clash.other}]; "
                              f"names must be unique, got {names}")
    for i, unit in enumerate(params["adopt_units"] or []):
        text(unit, f"adopt_units[{i}]")
    # the project's path rule (absolute, normalised, no '..'); the state directory as vllm_canary's
    # takeover reads it, the engine's files wherever the runtime put them
    for field, spaces in (("state_dir", False), ("engine_executable", True), ("runtime_venv", True)):
        if params.get(field) is not None:
            abs_path(params[field], field, spaces=spaces)
    if params.get("model") is not None:
        # any absolute path vllm serve takes (vllm_account's rule for a model), not only a normalised one
        if not text(params["model"], "model").startswith("/"):
            raise ValidationError(f"model: must be an absolute path (a local model), got {params['model']!r}")
        account_name(params["model_user"], "model_user")
    for i, name in enumerate(params.get("resolve") or []):
        if any(ch.isspace() for ch in text(name, f"resolve[{i}]", max_len=255)):
            raise ValidationError(f"resolve[{i}]: a host name or address has no whitespace, got {name!r}")


def engine_runtime(executable: str, run_command: Runner) -> dict[str, t.Any]:
    """The engine's runtime fields of the compatibility key, read by the interpreter beside its CLI.

    ``{executable, python, compat, nccl_version, error}``: ``python`` is None when there is no interpreter
    beside the CLI (the simulated engine, nothing to read); ``error`` says why a present one
    could not be read (the reader of the snapshot fails the host with it, as
    ``vllm_runtime_info`` would).
    """
    python = os.path.join(os.path.dirname(executable), "python")
    engine: dict[str, t.Any] = {"executable": executable, "python": None, "compat": {}, "nccl_version": None, "error": None}
    # present, even as a broken link: a venv whose interpreter cannot run is an error, not "no runtime"
    if not os.path.lexists(python):
        return engine
    engine["python"] = python
    try:
        runtime = read_runtime(python, run_command)
    except CompatError as exc:
        engine["error"] = str(exc)
        return engine
    engine["compat"] = {k: runtime[k] for k in RUNTIME_KEY_FIELDS if runtime.get(k) is not None}
    # a key field of an instance that spans hosts only (_compat.GANG_FIELDS): not in every instance's compat
    engine["nccl_version"] = runtime.get("nccl_version")
    return engine


def snapshot(params: t.Mapping[str, t.Any], binding: t.Any, host: str, run_command: Runner, interpreter: str) -> dict[str, t.Any]:
    """The snapshot of this host (checked ``params``); raises NvmlProbeError or HostSnapshotError.

    The probe counts the processes of the instances' units and of ``adopt_units`` (and of
    ``service_units``) as this host's own engine.
    """
    names = list(params["instances"] or [])
    units = [unit_name(n) for n in names]
    own_units = list(dict.fromkeys(units + list(params["adopt_units"] or []) + list(params["service_units"] or [])))
    result = read_gpus(dict(params, service_units=own_units), binding, host, run_command)
    try:
        states = systemctl_show(run_command, properties=UNIT_PROPERTIES)(units)
    except UnitFilesError as exc:
        raise HostSnapshotError(f"{host}: cannot read the units of the instances: {exc}") from None
    layout = Layout(state_dir=params["state_dir"])
    instances = []
    for name, unit in zip(names, units):
        props = states.get(unit, {})
        load_state = props.get("LoadState", "")
        instances.append({
            "name": name,
            "unit": unit,
            "load_state": load_state,
            "active_state": props.get("ActiveState", ""),
            "sub_state": props.get("SubState", ""),
            "unit_exists": bool(load_state) and load_state != "not-found",
            **_plan_record(layout, name),
        })
    result["instances"] = instances
    result["interpreter"] = interpreter
    if params.get("engine_executable"):
        result["engine"] = engine_runtime(params["engine_executable"], run_command)
    result.update(install_record(params.get("runtime_venv") or ""))
    if params.get("model"):
        result["model_access"] = model_access(run_command, params["model_user"], params["model"])
    result["resolved"] = [resolve(name) for name in params.get("resolve") or []]
    result["infiniband"] = infiniband_devices()
    return result


def infiniband_devices(directory: str = "/dev/infiniband") -> list[str]:
    """The InfiniBand/RoCE device nodes of this host (``uverbs0``, ``rdma_cm``), sorted; empty without any.

    A member of an instance that spans hosts opens them for NCCL: its unit allows them only where
    they are (``_gang.member_launch``)."""
    try:
        return sorted(entry for entry in os.listdir(directory) if not entry.startswith("."))
    except OSError:
        return []


def resolve(name: str) -> dict[str, t.Any]:
    """``{name, addresses, error}``: what ``name`` resolves to on this host (the system resolver,
    as vLLM's own connection to it would), or why it does not."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return {"name": name, "addresses": [], "error": str(exc)}
    return {"name": name, "addresses": list(dict.fromkeys(str(info[4][0]) for info in infos)), "error": None}


def model_access(run_command: t.Callable[..., tuple[int, str, str]], user: str, model: str) -> dict[str, t.Any]:
    """``{model, user, checked, error}``: whether ``user`` can read all of ``model`` (vllm_account's check).

    Where the user does not exist yet, nothing is checked (``checked`` false, no error): the
    deploy that creates it checks then. ``error`` names what the user cannot read.
    """
    access: dict[str, t.Any] = {"model": model, "user": user, "checked": False, "error": None}
    try:
        access["checked"] = check_model(run_command, user, model, user_optional=True)
    except AccountError as exc:
        access["error"] = str(exc)
    return access


def install_record(venv: str) -> dict[str, t.Any]:
    """``{install_record, install_record_error}``: what the ``vllm_runtime`` role left at ``venv``.

    The record is ``{venv, release, stamp}``: the release the venv link points to (as the role's
    switch and the rollback read it, ``_unit_files.runtime_link``) and that release's stamp
    (:data:`RELEASE_STAMP`, parsed). ``{}`` without ``venv``, or when it is not a link (a plain
    directory, or missing: no release of the role). A release without a readable stamp keeps ``stamp: {}``, and
    the error says why (the role never switches to a release without one).
    """
    release = runtime_link(venv) if venv else ""
    if not release:
        return {"install_record": {}, "install_record_error": None}
    record: dict[str, t.Any] = {"venv": venv, "release": release, "stamp": {}}
    path = os.path.join(release, RELEASE_STAMP)
    try:
        data = read_bytes(path)
    except UnitFilesError as exc:
        return {"install_record": record, "install_record_error": str(exc)}
    if data is None:
        return {"install_record": record, "install_record_error": f"{path}: missing: {release} is not a complete release"}
    try:
        stamp = json.loads(data)
    except ValueError as exc:
        return {"install_record": record, "install_record_error": f"{path}: cannot be parsed: {exc}"}
    if not isinstance(stamp, dict):
        return {"install_record": record, "install_record_error": f"{path}: expected a JSON object, got {type(stamp).__name__}"}
    record["stamp"] = stamp
    return {"install_record": record, "install_record_error": None}


def _plan_record(layout: Layout, name: str) -> dict[str, t.Any]:
    """``{plan, plan_error}``: the parsed plan record ({} when there is none, or it cannot be parsed or read:
    the reader plans as if nothing were deployed, and runs the manual canary), and why it could not be read."""
    try:
        return {"plan": read_plan(layout, name), "plan_error": None}
    except UnitFilesError as exc:
        return {"plan": {}, "plan_error": str(exc)}


def snapshot_facts(result: t.Mapping[str, t.Any], host: str) -> dict[str, t.Any]:
    """The probe's host facts (``gpufleet_gpus``, ``gpufleet_nvml``) and ``gpufleet_host_snapshot``."""
    facts = host_facts(dict(result), host)
    facts["gpufleet_host_snapshot"] = {"host": host, "interpreter": result["interpreter"], "instances": result["instances"],
                                       "engine": result.get("engine"), "install_record": result["install_record"],
                                       "install_record_error": result["install_record_error"]}
    if "model_access" in result:
        facts["gpufleet_host_snapshot"]["model_access"] = result["model_access"]
    return facts
