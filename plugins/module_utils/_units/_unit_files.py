# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The files of vLLM instances on one host, and the snapshot a rollback restores.

Plain Python (no Ansible import), used by the ``vllm_unit`` module. Per instance
``NAME`` there are four files:

* the unit ``<unit_dir>/vllm-NAME.service`` (root, 0644);
* the plan record ``<state_dir>/NAME.plan.json`` (root:<plan group>, 0640): the plan
  the running unit passed its boot check with, and the checksum of that unit;
* the secret environment file ``<state_dir>/vllm-NAME.env`` (root, 0600);
* the drop-in ``<unit_dir>/vllm-NAME.service.d/gpufleet-plan.conf`` (root, 0644), written
  with the plan file: systemd gives the boot gate the plan file's checksum
  (``GPUFLEET_PLAN_SHA256``), and the gate refuses a plan file edited since.

A snapshot keeps them in one document, ``<state_dir>/units/vllm-NAME.snapshot.json``
(root, 0600), written in one rename (a failed write leaves the previous snapshot): each
file's copy, or that it did not exist; whether the instance was serving (active, or held
stopped by a canary cut off before it started it again); the change that took it and
every change that carried it on; and the checksum of every file the change writes.
Restoring puts the copies back byte for byte, removes a file the change created only while
it is the one the change wrote (stopping and disabling a unit that did not exist), leaves
alone what the snapshot knows nothing about, and restarts a restored unit only if it
served when the snapshot was taken. Given the id of a change, only a snapshot that change
took or carried on is restored. Snapshots kept by releases before 2.0 (``<file>.previous``,
``<file>.absent``, ``.inactive`` and ``.changing`` markers) are read, and replaced by the
document at the next snapshot.

Units the instances take over (``adopt``: a hand-written ``vllm.service``, say) are kept
with the snapshot that takes them over, in ``<state_dir>/units/adopted-UNIT.json``: the
unit file and its drop-ins byte for byte (base64), where systemd loaded them from, and
whether the unit ran and was enabled. An instance is pending while a unit it takes over
still runs or is enabled. A later snapshot, taken when the unit no longer runs and is not
enabled, drops that record (the change it belonged to is no longer the last one); restoring
puts the files back and says which units to enable and start again.

A snapshot taken for a change that switches the engine runtime (the venv, a symbolic link the
``vllm_runtime`` role switches between releases) also keeps the release the venv pointed to
(``runtime_release``); restoring says which release to switch back to (``runtime_to_restore``).

A snapshot also opens a change, closed when the plan is recorded after a passed boot
check or when the snapshot is restored. A run interrupted in between (a killed
controller, a lost connection) leaves it open; the next run sees the instance as
pending and does not snapshot again, so the kept files stay the ones from before the
interrupted change instead of its half-applied unit.

Every write goes through a temporary file in the target directory and ``os.replace``,
so a reader (or an interrupted run) sees the old file or the new one, never a part.
"""

from __future__ import annotations

import base64
import grp
import hashlib
import json
import os
import stat
import tempfile
import time
import typing as t
from dataclasses import dataclass

from .. import _validate as v
from .._engine._serve_argv import CONTROLLED_OPTIONS, EngineSpecError, option_name, render_serve_args
from .._plan._launch import PLAN_CHECKSUM_DROPIN, PLAN_CHECKSUM_VARIABLE, LaunchError, for_host, plan_checksum, plan_file_bytes
from ._gang import launch_problems
from ._instance import clashes, env_file_name, plan_file_name, unit_name, unit_names

KINDS = ("unit", "plan", "env", "dropin")

# the snapshot document (snapshot_path); a release before 2.0 kept one file per copy and marker
SNAPSHOT_FORMAT = 1
# Plan-record fields whose change means the running engine is not the one the new plan was
# made for, even when the unit is byte for byte the same: the compatibility key covers the
# model's weights, the engine and the driver (a new weight file under the same model path
# leaves every serve argument as it was, but the process still holds the old weights).
RESTART_FIELDS = ("compat_key_hash",)
SHOW_PROPERTIES = ("LoadState", "ActiveState", "NeedDaemonReload")
# what is read of a unit the instances take over
ADOPT_PROPERTIES = ("LoadState", "ActiveState", "UnitFileState", "FragmentPath", "DropInPaths")
_RUNNING = ("active", "activating", "reloading", "deactivating")
_ENABLED = ("enabled", "enabled-runtime", "linked", "linked-runtime", "alias")
# systemctl show of several units: one block of properties per unit, in argument order.
ShowRunner = t.Callable[[t.List[str]], t.Dict[str, t.Dict[str, str]]]
SystemctlRunner = t.Callable[[t.List[str]], t.Tuple[int, str, str]]


class UnitFilesError(Exception):
    """A file cannot be read or written, or an input is wrong; the message names it."""


@dataclass(frozen=True)
class Layout:
    """Where the files live and who owns them."""

    unit_dir: str = "/etc/systemd/system"
    state_dir: str = "/etc/gpufleet"
    uid: int = 0
    gid: int = 0
    plan_gid: int = 0

    @property
    def kept_dir(self) -> str:
        return os.path.join(self.state_dir, "units")

    def unit_name(self, name: str) -> str:
        return unit_name(name)

    def path(self, name: str, kind: str) -> str:
        if kind == "unit":
            return os.path.join(self.unit_dir, self.unit_name(name))
        if kind == "plan":
            return os.path.join(self.state_dir, plan_file_name(name))
        if kind == "env":
            return os.path.join(self.state_dir, env_file_name(name))
        if kind == "dropin":
            return os.path.join(self.unit_dir, f"{self.unit_name(name)}.d", PLAN_CHECKSUM_DROPIN)
        raise UnitFilesError(f"unknown file kind {kind!r}")

    def kept(self, name: str, kind: str) -> str:
        return os.path.join(self.kept_dir, os.path.basename(self.path(name, kind)))

    def inactive_marker(self, name: str) -> str:
        return os.path.join(self.kept_dir, self.unit_name(name) + ".inactive")

    def changing_marker(self, name: str) -> str:
        return os.path.join(self.kept_dir, self.unit_name(name) + ".changing")

    def owner(self, kind: str) -> tuple[int, int, int]:
        """(uid, gid, mode) of a live file of this kind."""
        if kind in ("unit", "dropin"):
            return self.uid, self.gid, 0o644
        if kind == "plan":
            return self.uid, self.plan_gid, 0o640
        return self.uid, self.gid, 0o600


def group_id(name: str, required: bool) -> int:
    """The group's id; root's when it does not exist and nothing needs it (a restore, a dry run)."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if required:
            raise UnitFilesError(f"plan_group {name!r} does not exist on this host") from None
        return 0


def validate_name(name: object) -> str:
    try:
        return v.instance_name(name, "instance name")
    except v.ValidationError as exc:
        raise UnitFilesError(str(exc)) from None


def check_content(name: str, kind: str, content: object) -> str:
    """The text of a unit or an environment file, checked before it is written."""
    try:
        if kind == "env":
            return v.check_environment_file(content, f"instance {name}: environment file")
        if not isinstance(content, str):
            raise v.ValidationError(f"instance {name}: unit: expected text, got {type(content).__name__}")
        if "\0" in content or "\r" in content:
            raise v.ValidationError(f"instance {name}: unit: must not contain NUL or carriage return characters")
        return content
    except v.ValidationError as exc:
        raise UnitFilesError(str(exc)) from None


# role variable (less the vllm_service_ prefix) -> check; every one is rendered into the unit
_SERVICE_PATHS = ("executable", "home", "state_dir", "unit_dir", "boot_gate_python", "boot_gate_bin", "boot_gate_lib_dir",
                  "metrics_textfile_dir", "metrics_python", "metrics_bin")
DAY = 24 * 3600
# (low, high): a bound above which the value is a mistake (a boot timeout of 1e9 s never times out)
_SERVICE_COUNTS = {"restart_sec": (0, DAY), "start_limit_burst": (0, 10000), "start_limit_interval_sec": (0, 7 * DAY),
                   "timeout_stop_sec": (0, DAY), "boot_timeout": (0, DAY), "gate_samples": (1, 1000),
                   "min_tokens": (0, 1 << 40), "metrics_interval_sec": (1, DAY), "boot_gate_xid_wait_ms": (0, 10000)}
BOOT_GATE_POLICIES = ("refuse", "shrink", "profile")
BOOT_GATE_GPU_HEALTH = ("refuse", "warn")
# inputs with a role default: a given null is a mistake, not "unset"
_DEFAULTED = ("metrics", "metrics_interval_sec", "boot_gate_xid_wait_ms")
_MAX_GPUS = 1024


_check = v.collect


def instances_problems(instances: t.Any, field: str = "vllm_service_instances", gangs: bool = False) -> list[str]:
    """Every problem with an instance list (names, ports, GPUs), named as ``field`` (the variable the user wrote).

    ``gangs``: an instance's ``gang`` is checked by the caller (the playbooks' gang checks, across the
    members), not refused here."""
    problems: list[str] = []
    _instances_problems(instances, problems, field, gangs)
    return problems


def _instances_problems(instances: t.Any, problems: list[str], field: str = "vllm_service_instances",
                        gangs: bool | t.Collection[str] = False) -> None:
    if not isinstance(instances, (list, tuple)) or not instances:
        problems.append(f"{field}: expected a non-empty list of {{name, gpus, port}}")
        return
    # each instance's checked name, port and GPUs (None where refused), for the rules between instances
    checked: list[dict[str, t.Any]] = []
    for i, inst in enumerate(instances):
        where = f"{field}[{i}]"
        checked.append({})
        if not isinstance(inst, t.Mapping):
            problems.append(f"{where}: expected a mapping with name, gpus and port")
            continue
        if "gang" in inst and not (gangs is True or (not isinstance(gangs, bool) and inst.get("name") in gangs)):
            # without its rank (vllm_service_gang_launch), every member would start a one-host engine of the whole model
            problems.append(f"{where}.gang: an instance that spans hosts needs its member's rank: vllm_service_gang_launch."
                            f"{inst.get('name')} (docs/multi-host.md)")
        checked[i]["name"] = _check(problems, v.instance_name, inst.get("name"), f"{where}.name")
        checked[i]["port"] = _check(problems, v.port, inst.get("port"), f"{where}.port")
        gpus = inst.get("gpus")
        if not isinstance(gpus, (list, tuple)) or not gpus:
            problems.append(f"{where}.gpus: expected a non-empty list of NVML indices")
            continue
        checked[i]["gpus"] = [_check(problems, v.integer, gpu, f"{where}.gpus[{j}]", low=0, high=_MAX_GPUS - 1)
                              for j, gpu in enumerate(gpus)]
    found = clashes(checked)
    for clash in found:
        where = f"{field}[{clash.position}].gpus"
        if clash.rule == "gpu_twice":
            problems.append(f"{where}: GPU {clash.value} is listed twice")
        elif clash.rule == "gpu_shared":
            problems.append(f"{where}: GPU {clash.value} is also used by {field}[{clash.other}]; "
                            "instances sharing a GPU would each get the whole plan's budget")
    for rule, what in (("name", "names"), ("port", "ports")):
        twice = list(dict.fromkeys(str(c.value) for c in found if c.rule == rule))
        if twice:
            problems.append(f"{field} {what}: {', '.join(twice)} appear(s) more than once")


def _gang_launch_problems(launches: t.Any, instances: t.Any, problems: list[str], field: str = "vllm_service_gang_launch") -> None:
    """Each entry: an instance of the host, rank arguments and environment that systemd takes as given."""
    if launches is None or launches == {}:
        return
    if not isinstance(launches, t.Mapping):
        problems.append(f"{field}: expected a mapping of instance name -> launch (gpufleet.vllm.gang_member_launch)")
        return
    by_name = {str(i.get("name")): i for i in instances if isinstance(i, t.Mapping)} if isinstance(instances, (list, tuple)) else {}
    for name, launch in launches.items():
        where = f"{field}.{name}"
        if str(name) not in by_name:
            problems.append(f"{where}: no instance of this name in vllm_service_instances")
        problems.extend(launch_problems(launch, where))
        if not isinstance(launch, t.Mapping):
            continue
        # where the member's ranks lie in the gang: its floors come out of the gang's plan by them
        missing = [key for key in ("first_rank", "ranks") if launch.get(key) is None]
        if missing:
            problems.append(f"{where}: {' and '.join(missing)} missing (gpufleet.vllm.gang_member_launch gives where the member's "
                            "ranks lie in the gang)")
        gpus = by_name.get(str(name), {}).get("gpus")
        if isinstance(launch.get("ranks"), int) and isinstance(gpus, (list, tuple)) and launch["ranks"] != len(gpus):
            problems.append(f"{where}.ranks: {launch['ranks']} ranks, but the instance has {len(gpus)} GPU(s)")


def _plan_problems(plan: t.Any, default_utilization: t.Any, problems: list[str], launches: t.Any = None) -> None:
    """The plan must give a launch record an instance can start with (``_launch.for_instance``), and a gang's member
    the floors of its own ranks (``_launch.for_member``)."""
    try:
        for_host(plan, default_utilization, "vllm_service_plan", launches, "vllm_service_gang_launch")
    except LaunchError as exc:
        problems.append(str(exc))


def _env_problems(env: t.Any, field: str, problems: list[str], secret: bool = False) -> None:
    if env is None:
        return
    if not isinstance(env, t.Mapping):
        problems.append(f"{field}: expected a mapping NAME -> value")
        return
    for name, value in env.items():
        key = _check(problems, v.env_name, name, f"{field} name")
        if key is None:
            continue
        try:
            v.text(value, f"{field}.{key}", allow_empty=True)
        except v.ValidationError as exc:
            # a secret's message never shows the value, not even a part of it
            problems.append(f"{field}.{key}: must be a string without control characters (value not shown)"
                            if secret else str(exc))


def service_input_problems(inputs: t.Mapping[str, t.Any]) -> list[str]:
    """Every problem with the inputs of the role ``vllm_service`` (``vllm_service_*`` variables), by field.

    Everything that ends up in the unit or the environment file is checked here with the
    rules of ``_validate``, so that a bad value stops the role before any host is touched.
    """
    problems: list[str] = []

    def get(key: str) -> t.Any:
        return inputs.get("vllm_service_" + key)

    launches = get("gang_launch")
    _instances_problems(get("instances"), problems,
                        gangs=[str(k) for k in launches] if isinstance(launches, t.Mapping) else False)
    found = len(problems)
    _gang_launch_problems(launches, get("instances"), problems)
    # launches named wrong above are not read again for the member's floors
    _plan_problems(get("plan"), inputs.get("vllm_service_auto_gpu_memory_utilization", 0.9), problems,
                   launches if len(problems) == found else None)
    if _check(problems, v.text, get("model"), "vllm_service_model") and str(get("model")).startswith("-"):
        problems.append("vllm_service_model: must not start with '-' (vLLM would read it as an option)")
    for key in _SERVICE_PATHS:
        # the boot gate's and the exporter's paths have defaults: only a given one is checked
        if key in ("executable", "home", "state_dir", "unit_dir") or "vllm_service_" + key in inputs:
            _check(problems, v.abs_path, get(key), "vllm_service_" + key)
    _check(problems, v.service_account_name, get("user"), "vllm_service_user")
    _check(problems, v.account_name, get("group"), "vllm_service_group")
    for key in ("listen_host", "health_host"):
        if key == "listen_host" or "vllm_service_" + key in inputs:
            _check(problems, v.text, get(key), "vllm_service_" + key)
            if isinstance(get(key), str) and any(c.isspace() for c in get(key)):
                problems.append(f"vllm_service_{key}: must not contain whitespace")
    if "vllm_service_boot_gate" in inputs and get("boot_gate") not in BOOT_GATE_POLICIES:
        problems.append(f"vllm_service_boot_gate: must be one of {', '.join(BOOT_GATE_POLICIES)}, got {get('boot_gate')!r}")
    if "vllm_service_boot_gate_gpu_health" in inputs and get("boot_gate_gpu_health") not in BOOT_GATE_GPU_HEALTH:
        problems.append(f"vllm_service_boot_gate_gpu_health: must be one of {', '.join(BOOT_GATE_GPU_HEALTH)}, "
                        f"got {get('boot_gate_gpu_health')!r}")
    if get("compat_key_hash"):
        _check(problems, v.text, get("compat_key_hash"), "vllm_service_compat_key_hash")
    if get("host_class"):
        _check(problems, v.class_name, get("host_class"), "vllm_service_host_class")
    item_rules: dict[str, t.Callable[[object, str], str]] = {"read_write_paths": v.abs_path, "device_allow": v.text, "after_units": v.systemd_unit_name}
    for key, rule in item_rules.items():
        items = get(key) or []
        if not isinstance(items, (list, tuple)):
            problems.append(f"vllm_service_{key}: expected a list")
            continue
        for i, item in enumerate(items):
            _check(problems, rule, item, f"vllm_service_{key}[{i}]")
    for key, (low, high) in _SERVICE_COUNTS.items():
        if get(key) is not None or (key in _DEFAULTED and "vllm_service_" + key in inputs):
            _check(problems, v.integer, get(key), "vllm_service_" + key, low=low, high=high)
    for key, bounds in (("gate_interval", {"low": 0, "high": 3600}),
                        ("auto_gpu_memory_utilization", {"low": 0, "high": 1, "low_open": True})):
        # both have defaults: a given null is a mistake, not "unset"
        if "vllm_service_" + key in inputs:
            _check(problems, v.number, get(key), "vllm_service_" + key, **bounds)
    for key in ("create_user", "boot_check", "metrics"):
        if get(key) is not None or (key in _DEFAULTED and "vllm_service_" + key in inputs):
            _check(problems, v.boolean, get(key), "vllm_service_" + key)
    instances = get("instances") if isinstance(get("instances"), (list, tuple)) else []
    names = [str(i.get("name")) for i in instances if isinstance(i, t.Mapping)]
    try:
        validate_adopted(get("adopt_units") or [], names, "vllm_service_adopt_units")
    except UnitFilesError as exc:
        problems.append(str(exc))
    _env_problems(get("env"), "vllm_service_env", problems)
    _env_problems(get("secret_env"), "vllm_service_secret_env", problems, secret=True)
    serve_args = get("serve_args")
    if serve_args is not None and not isinstance(serve_args, t.Mapping):
        problems.append("vllm_service_serve_args: expected a mapping of vllm serve options")
    elif serve_args:
        _serve_args_problems(serve_args, problems)
    return problems


def secret_serve_args_problem(serve_args: t.Mapping[str, t.Any], field: str = "vllm_service_serve_args") -> str | None:
    """The sentence that refuses the secret options of ``serve_args`` (:func:`_validate.is_secret_option`), naming the
    options and never their values; None when there are none."""
    secrets = sorted(str(key) for key in serve_args if v.is_secret_option(str(key)))
    if not secrets:
        return None
    return (f"{field} {', '.join(secrets)} would put a secret on the unit's command line (a world-readable unit file, "
            "/proc/PID/cmdline, diffs in logs); set it in vllm_service_secret_env instead (for example VLLM_API_KEY for "
            "api_key, HF_TOKEN for hf_token), which is written to a root-only EnvironmentFile")


def _serve_args_problems(serve_args: t.Mapping[str, t.Any], problems: list[str]) -> None:
    """The options the role sets itself, secrets, then every other option as ``vllm serve`` takes it."""
    if any(option_name(key) in CONTROLLED_OPTIONS for key in serve_args):
        problems.append(f"vllm_service_serve_args must not set {', '.join(sorted(CONTROLLED_OPTIONS))}; the role sets them from the plan "
                        "and the instance")
    secret = secret_serve_args_problem(serve_args)
    if secret:
        problems.append(secret)
    try:
        render_serve_args({key: value for key, value in serve_args.items()
                           if option_name(key) not in CONTROLLED_OPTIONS and not v.is_secret_option(str(key))})
    except (EngineSpecError, v.ValidationError) as exc:
        problems.append(f"vllm_service_serve_args: {exc}")


def sha1(data: bytes) -> str:
    """The checksum ansible.builtin.stat reports (recorded in plan files)."""
    return hashlib.sha1(data).hexdigest()  # nosec - a content fingerprint, not a security control


def read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UnitFilesError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _matches(path: str, data: bytes, uid: int, gid: int, mode: int) -> bool:
    """The file exists with exactly this content, owner and mode."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise UnitFilesError(f"{path}: cannot stat: {exc.strerror or exc}") from None
    if (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) != (uid, gid, mode):
        return False
    return read_bytes(path) == data


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - a directory that cannot be opened cannot be synced either
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, uid: int, gid: int, mode: int) -> None:
    """Write ``path`` through a temporary file in its directory (owner and mode set before the rename)."""
    directory = os.path.dirname(path) or "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    except OSError as exc:
        raise UnitFilesError(f"{path}: cannot write: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fchown(fh.fileno(), uid, gid)  # always: a setgid directory gives new files its own group
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise UnitFilesError(f"{path}: cannot write: {exc.strerror or exc}") from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    _fsync_dir(directory)


def ensure_file(path: str, data: bytes, uid: int, gid: int, mode: int, check: bool) -> bool:
    """Make ``path`` hold ``data`` with this owner and mode; True if it had to change."""
    if _matches(path, data, uid, gid, mode):
        return False
    if not check:
        atomic_write(path, data, uid, gid, mode)
    return True


def dropin_text(plan: t.Mapping[str, t.Any]) -> str:
    """The drop-in beside an instance's unit that records its plan file's checksum (``_launch.plan_checksum``)."""
    return ("# gpufleet.vllm: the checksum of the plan file the deploy wrote; the boot gate refuses one edited since\n"
            f"[Service]\nEnvironment={PLAN_CHECKSUM_VARIABLE}={plan_checksum(plan)}\n")


def ensure_kind(layout: Layout, name: str, kind: str, data: bytes, check: bool) -> bool:
    """``ensure_file`` for a live file of ``kind`` (the drop-in's directory made first)."""
    path = layout.path(name, kind)
    if kind == "dropin" and not check:
        ensure_dir(os.path.dirname(path), layout.uid, layout.gid, 0o755, check)
    uid, gid, mode = layout.owner(kind)
    return ensure_file(path, data, uid, gid, mode, check)


def ensure_absent(path: str, check: bool) -> bool:
    if not os.path.lexists(path):
        return False
    if not check:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise UnitFilesError(f"{path}: cannot remove: {exc.strerror or exc}") from None
        _fsync_dir(os.path.dirname(path))
    return True


def ensure_dir(path: str, uid: int, gid: int, mode: int, check: bool, keep_owner: bool = False) -> bool:
    """Make ``path`` a directory with this owner and mode; True if it had to change.

    ``keep_owner``: an existing directory keeps its owner and only gets the mode (one that
    another service shares, such as node_exporter's textfile collector directory).
    """
    try:
        st = os.stat(path)  # a symlink to a directory is that directory
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UnitFilesError(f"{path}: cannot stat: {exc.strerror or exc}") from None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise UnitFilesError(f"{path}: exists and is not a directory")
    if st is not None and keep_owner:
        uid, gid = st.st_uid, st.st_gid
    if st is not None and (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, mode):
        return False
    if not check:
        try:
            if st is None:
                os.mkdir(path, mode)
            os.chmod(path, mode)
            os.chown(path, uid, gid)
        except OSError as exc:
            raise UnitFilesError(f"{path}: cannot create: {exc.strerror or exc}") from None
    return True


def parse_show(output: str, units: t.Sequence[str]) -> dict[str, dict[str, str]]:
    """``systemctl show U1 U2 --property=...``: one blank-line separated block per unit, in order."""
    blocks: list[dict[str, str]] = [{}]
    for line in output.splitlines():
        if not line.strip():
            if blocks[-1]:
                blocks.append({})
            continue
        key, sep, value = line.partition("=")
        if sep:
            blocks[-1][key] = value
    blocks = [b for b in blocks if b]
    if len(blocks) != len(units):
        raise UnitFilesError(f"systemctl show: expected {len(units)} blocks of properties, got {len(blocks)}")
    return dict(zip(units, blocks))


def systemctl_show(runner: SystemctlRunner, systemctl: str = "systemctl",
                   properties: t.Sequence[str] = SHOW_PROPERTIES) -> ShowRunner:
    def show(units: list[str]) -> dict[str, dict[str, str]]:
        if not units:
            return {}
        rc, out, err = runner([systemctl, "show", *units, "--property=" + ",".join(properties)])
        if rc != 0:
            raise UnitFilesError(f"systemctl show {' '.join(units)} failed (rc {rc}): {err.strip()}")
        return parse_show(out, units)

    return show


def _text(data: bytes | None) -> str:
    return "" if data is None else data.decode("utf-8", errors="replace")


def status(layout: Layout, instances: t.Sequence[t.Mapping[str, t.Any]], show: ShowRunner,
           want_diff: bool = False) -> list[dict[str, t.Any]]:
    """Per instance: does its unit, environment file or running state differ from the desired ones?

    ``instances``: ``{name, unit?, env?, plan?}`` with the desired contents (text, and the
    plan as a mapping: see :func:`plan_restart_reasons`). The reasons use the same words as
    the rollout's output. Never changes anything.
    """
    names = [validate_name(i["name"]) for i in instances]
    props = show([layout.unit_name(n) for n in names])
    out = []
    for inst, name in zip(instances, names):
        reasons: list[str] = []
        unit_path = layout.path(name, "unit")
        on_disk = read_bytes(unit_path)
        entry: dict[str, t.Any] = {"name": name, "unit": layout.unit_name(name)}
        if inst.get("unit") is not None:
            want = inst["unit"].encode("utf-8")
            entry["unit_checksum"] = sha1(want)
            uid, gid, mode = layout.owner("unit")
            if not _matches(unit_path, want, uid, gid, mode):
                reasons.append("unit differs from the plan")
                if want_diff:
                    entry["diff"] = {"before_header": unit_path, "after_header": unit_path,
                                     "before": _text(on_disk), "after": inst["unit"]}
        if inst.get("env") is not None:
            uid, gid, mode = layout.owner("env")
            if not _matches(layout.path(name, "env"), inst["env"].encode("utf-8"), uid, gid, mode):
                reasons.append("environment file differs")
        unit_props = props.get(layout.unit_name(name), {})
        active = unit_props.get("ActiveState", "unknown")
        entry["active_state"] = active
        if active != "active":
            reasons.append(f"service is {active}")
        if unit_props.get("NeedDaemonReload") == "yes":
            reasons.append("systemd has not loaded the unit on disk")
        applied = read_plan(layout, name)
        if on_disk is None or applied.get("unit_checksum") != sha1(on_disk):
            reasons.append("the unit on disk has not passed a boot check")
        elif isinstance(inst.get("plan"), t.Mapping):
            reasons += plan_restart_reasons(applied, inst["plan"])
        if change_open(layout, name):
            reasons.append("an earlier change was interrupted")
        if active != "active" and canary_hold(layout, name) is not None:
            reasons.append("a canary that was cut off left it stopped")
        entry["reasons"] = reasons
        entry["pending"] = bool(reasons)
        out.append(entry)
    return out


def plan_restart_reasons(recorded: t.Mapping[str, t.Any], wanted: t.Mapping[str, t.Any]) -> list[str]:
    """Why a running instance must restart although its unit is unchanged (RESTART_FIELDS).

    Compared only when both plans name a value: a record without one (written by a plan
    without a key, e.g. the role used on its own) restarts nothing.
    """
    reasons = []
    for field in RESTART_FIELDS:
        was, now = recorded.get(field), wanted.get(field)
        if was and now and was != now:
            reasons.append(f"the compatibility key changed since its boot check ({field} {str(was)[:12]} -> {str(now)[:12]})")
    return reasons


def plan_bytes(plan: t.Mapping[str, t.Any]) -> bytes:
    """A plan file as the boot gate and applications read it (``_launch.plan_file_bytes``)."""
    return plan_file_bytes(plan)


def read_plan(layout: Layout, name: str) -> dict[str, t.Any]:
    """The recorded plan of an instance ({} when there is none or it cannot be parsed)."""
    data = read_bytes(layout.path(name, "plan"))
    if data is None:
        return {}
    try:
        doc = json.loads(data)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def snapshot_path(layout: Layout, name: str) -> str:
    """The snapshot document of an instance (root, 0600)."""
    return os.path.join(layout.kept_dir, f"vllm-{name}.snapshot.json")


def canary_hold_path(layout: Layout, name: str) -> str:
    """The marker a canary leaves while it holds the instance stopped (``vllm_canary``)."""
    return os.path.join(layout.kept_dir, f"vllm-{name}.canary-hold.json")


def _legacy_snapshot(layout: Layout, name: str) -> dict[str, t.Any] | None:
    """A snapshot kept by a release before 2.0 (one file per kept copy and marker), as a document."""
    files: dict[str, t.Any] = {}
    for kind in KINDS:
        copy = read_bytes(layout.kept(name, kind) + ".previous")
        if copy is not None:
            files[kind] = _file_entry(layout, name, kind, copy)
        elif os.path.exists(layout.kept(name, kind) + ".absent"):
            files[kind] = None
    if not files:
        return None
    inactive = read_bytes(layout.inactive_marker(name))
    active = "active" if inactive is None else (inactive.decode("utf-8", errors="replace").strip() or "inactive")
    return {"format": SNAPSHOT_FORMAT, "instance": name, "change_id": "", "changes": [], "taken_at": None,
            "open": os.path.exists(layout.changing_marker(name)), "serving": active == "active",
            "active_state": active, "files": files, "written": {}, "legacy": True}


def _file_entry(layout: Layout, name: str, kind: str, data: bytes) -> dict[str, t.Any]:
    return {"path": layout.path(name, kind), "sha1": sha1(data), "data": base64.b64encode(data).decode("ascii")}


def load_snapshot(layout: Layout, name: str) -> dict[str, t.Any] | None:
    """The last snapshot of an instance, or None; a document that cannot be read is an error naming it."""
    path = snapshot_path(layout, name)
    raw = read_bytes(path)
    if raw is None:
        return _legacy_snapshot(layout, name)
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != SNAPSHOT_FORMAT or doc.get("instance") != name:
            raise ValueError(f"not a format {SNAPSHOT_FORMAT} snapshot of instance {name}")
        for kind, entry in dict(doc["files"]).items():
            if kind not in KINDS:
                raise ValueError(f"unknown file kind {kind!r}")
            if entry is not None:
                data = base64.b64decode(str(entry["data"]), validate=True)
                if sha1(data) != entry["sha1"]:
                    raise ValueError(f"the kept {kind} file does not match its checksum")
    except (ValueError, KeyError, TypeError) as exc:
        raise UnitFilesError(f"{path}: the snapshot cannot be read ({exc}); it is left as it is for a person to look at") from None
    return doc


def kept_file(layout: Layout, name: str, kind: str) -> bytes | None:
    """The copy of a file the last snapshot of an instance keeps (None: no snapshot, or the file did not exist)."""
    doc = load_snapshot(layout, name)
    return None if doc is None or kind not in doc["files"] else _kept_data(doc, kind)


def _kept_data(doc: t.Mapping[str, t.Any], kind: str) -> bytes | None:
    entry = doc["files"].get(kind)
    return None if entry is None else base64.b64decode(str(entry["data"]))


def _commit_snapshot(layout: Layout, name: str, doc: t.Mapping[str, t.Any], check: bool) -> bool:
    """Replace the instance's snapshot document in one rename; the legacy files go after it."""
    data = (json.dumps(dict(doc), indent=2, sort_keys=True) + "\n").encode("utf-8")
    changed = ensure_file(snapshot_path(layout, name), data, layout.uid, layout.gid, 0o600, check)
    if not check:
        for kind in KINDS:  # the document is the snapshot now: a release before 2.0 left these
            for suffix in (".previous", ".absent"):
                ensure_absent(layout.kept(name, kind) + suffix, check)
        ensure_absent(layout.inactive_marker(name), check)
        ensure_absent(layout.changing_marker(name), check)
    return changed


def _summary(doc: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    files = doc["files"]
    return {"name": doc["instance"], "kept": [k for k in KINDS if files.get(k) is not None],
            "absent": [k for k in KINDS if k in files and files[k] is None], "active_state": doc["active_state"],
            "serving": doc["serving"], "change_id": doc.get("change_id", ""),
            "runtime_release": str(doc.get("runtime_release") or "")}


def runtime_link(venv: str) -> str:
    """The release the engine's venv points to (its resolved path, as the ``vllm_runtime`` role
    records it); '' when the venv is a plain directory or missing: no release to switch back to."""
    return os.path.realpath(venv) if os.path.islink(venv) else ""


def canary_hold(layout: Layout, name: str) -> dict[str, t.Any] | None:
    """The hold an interrupted canary left (it stopped the serving instance and never started it again)."""
    raw = read_bytes(canary_hold_path(layout, name))
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = {}
    return doc if isinstance(doc, dict) else {}


def snapshot(layout: Layout, names: t.Sequence[str], show: ShowRunner, check: bool, change_id: str = "",
             now: float | None = None, runtime_venv: str | None = None) -> list[dict[str, t.Any]]:
    """Keep the unit, plan and environment files of ``names`` as they are now, and whether each serves.

    One document per instance, written in one rename: a failed write leaves the previous
    snapshot as it was. ``change_id`` stamps the snapshot with the change that takes it, so that
    this change's rollback restores this snapshot and no other; ``write`` then adds the checksums
    of the files the change writes, so that a rollback removes a file the change created only
    while it is still that file. An instance held stopped by a canary that never came back
    (``canary_hold``) was serving before it. ``runtime_venv`` (a change that switches the engine
    runtime): keep the release the venv points to now, which a rollback switches back to.
    """
    names = [validate_name(n) for n in names]
    runtime = runtime_link(runtime_venv) if runtime_venv else ""
    props = show([layout.unit_name(n) for n in names])
    changed_dir = False
    if not os.path.isdir(layout.state_dir):  # a first deploy; write() sets the state directory's group
        changed_dir = ensure_dir(layout.state_dir, layout.uid, layout.plan_gid, 0o750, check)
    if not (check and changed_dir):
        changed_dir |= ensure_dir(layout.kept_dir, layout.uid, layout.gid, 0o700, check)
    taken_at = time.time() if now is None else now
    out = []
    for name in names:
        previous = load_snapshot(layout, name) if os.path.isdir(layout.kept_dir) else None
        if previous is not None and previous.get("open"):
            # an interrupted change: its snapshot holds what ran before it; this change carries it on
            doc = dict(previous)
            if change_id and change_id not in doc.get("changes", []):
                doc["changes"] = [*doc.get("changes", []), change_id]
            if runtime and not doc.get("runtime_release"):
                # the interrupted change did not switch the runtime: the venv still runs what ran before it
                doc["runtime_release"] = runtime
            changed = _commit_snapshot(layout, name, doc, check) or changed_dir
            out.append(dict(_summary(doc), resumed=True, changed=changed))
            continue
        files: dict[str, t.Any] = {}
        for kind in KINDS:
            live = read_bytes(layout.path(name, kind))
            files[kind] = None if live is None else _file_entry(layout, name, kind, live)
        active = props.get(layout.unit_name(name), {}).get("ActiveState", "unknown")
        hold = canary_hold(layout, name) if os.path.isdir(layout.kept_dir) else None
        serving = active == "active" or (hold is not None and files["unit"] is not None)
        doc = {"format": SNAPSHOT_FORMAT, "instance": name, "change_id": change_id, "changes": [change_id] if change_id else [],
               "taken_at": taken_at, "open": True, "serving": serving, "active_state": active, "files": files,
               "written": {}}
        if hold is not None and active != "active":
            doc["held_by_canary"] = str(hold.get("change_id", ""))
        if runtime:
            doc["runtime_release"] = runtime
        changed = _commit_snapshot(layout, name, doc, check) or changed_dir
        out.append(dict(_summary(doc), resumed=False, changed=changed))
    return out


def _note_written(layout: Layout, name: str, written: t.Mapping[str, str], check: bool, close: bool = False) -> None:
    """Add what the open change writes (``{kind: sha1}``) to its snapshot, in one commit (a rollback
    removes a created file only while it is the one the change wrote); ``close`` completes the change."""
    if check or not os.path.exists(snapshot_path(layout, name)):
        return
    doc = load_snapshot(layout, name)
    if doc is None or not doc.get("open"):
        return
    doc = dict(doc, written={**dict(doc.get("written") or {}), **written})
    if close:
        doc["open"] = False
    _commit_snapshot(layout, name, doc, check)


def _systemctl(systemctl: SystemctlRunner, argv: list[str]) -> None:
    rc, _out, err = systemctl(argv)
    if rc != 0:
        raise UnitFilesError(f"{' '.join(argv)} failed (rc {rc}): {err.strip()}")


def stop_services(layout: Layout, names: t.Sequence[str], adopted: t.Sequence[t.Mapping[str, t.Any]], show: ShowRunner,
                  systemctl: SystemctlRunner, check: bool, systemctl_bin: str = "systemctl") -> list[str]:
    """Stop the services of ``names`` that are loaded and not inactive, then stop and disable the
    ``adopted`` units (``snapshot_adopted``'s entries) that still hold; the units stopped, in that order.

    After the snapshot, in the same round trip: what it kept is what ran before the stop.
    """
    units = [layout.unit_name(validate_name(n)) for n in names]
    props = show(units) if units else {}
    running = [u for u in units if props.get(u, {}).get("LoadState") != "not-found"
               and props.get(u, {}).get("ActiveState", "inactive") != "inactive"]
    holding = [str(a["unit"]) for a in adopted if a.get("holds")]
    if not check:
        if running:
            _systemctl(systemctl, [systemctl_bin, "stop", *running])
        if holding:
            _systemctl(systemctl, [systemctl_bin, "disable", "--now", *holding])
    return running + holding


def restart_services(layout: Layout, names: t.Sequence[str], systemctl: SystemctlRunner, check: bool,
                     systemctl_bin: str = "systemctl") -> list[str]:
    """Reload systemd, then enable and (re)start the services of ``names`` (the units just written)."""
    units = [layout.unit_name(validate_name(n)) for n in names]
    if units and not check:
        _systemctl(systemctl, [systemctl_bin, "daemon-reload"])
        # systemd was just reloaded: without --no-reload, enable would reload it a second time
        _systemctl(systemctl, [systemctl_bin, "enable", "--no-reload", *units])
        _systemctl(systemctl, [systemctl_bin, "restart", *units])
    return units


def change_open(layout: Layout, name: str) -> bool:
    """A change was snapshotted and neither recorded after its boot check nor rolled back."""
    if os.path.exists(layout.changing_marker(name)):  # a release before 2.0
        return True
    try:
        doc = load_snapshot(layout, name)
    except UnitFilesError:
        return True  # a snapshot nobody can read: the instance is pending until a person looks at it
    return bool(doc and doc.get("open"))


def write(layout: Layout, instances: t.Sequence[t.Mapping[str, t.Any]], check: bool,
          want_diff: bool = False) -> list[dict[str, t.Any]]:
    """Write the given files (``{name, unit?, env?, plan?}``); unchanged files are left alone.

    ``plan`` is the plan file the boot gate reads at the first start, written without the
    unit's checksum: only ``record`` adds it, after a passed boot check.
    """
    out = []
    for inst in instances:  # every input first: nothing is written when one is wrong
        name = validate_name(inst["name"])
        for kind in ("env", "unit"):
            if inst.get(kind) is not None:
                check_content(name, kind, inst[kind])
        if inst.get("plan") is not None and not isinstance(inst["plan"], t.Mapping):
            raise UnitFilesError(f"instance {name}: plan must be a mapping")
    changed_dir = ensure_dir(layout.state_dir, layout.uid, layout.plan_gid, 0o750, check)
    for inst in instances:
        name = validate_name(inst["name"])
        entry: dict[str, t.Any] = {"name": name, "written": [], "changed": False}
        # in writing order: the environment first (a unit never starts without its file), the plan
        # file, then beside the unit the plan file's checksum the boot gate compares at every start
        wanted = {kind: inst[kind].encode("utf-8") for kind in ("env", "unit") if inst.get(kind) is not None}
        if inst.get("plan") is not None:
            doc = {k: v for k, v in inst["plan"].items() if k != "unit_checksum"}
            wanted.update(plan=plan_bytes(doc), dropin=dropin_text(doc).encode("utf-8"))
        differ = {kind: data for kind, data in wanted.items() if not _matches(layout.path(name, kind), data, *layout.owner(kind))}
        # before the files, in one commit: a rollback knows them as this change's
        if differ:
            _note_written(layout, name, {kind: sha1(data) for kind, data in differ.items()}, check)
        for kind, data in differ.items():
            before = read_bytes(layout.path(name, kind)) if (kind == "unit" and want_diff) else None
            ensure_kind(layout, name, kind, data, check)
            entry["written"].append(kind)
            if kind == "unit" and want_diff:
                entry["diff"] = {"before_header": layout.path(name, kind), "after_header": layout.path(name, kind),
                                 "before": _text(before), "after": inst[kind]}
        if "unit" in wanted:
            entry["unit_checksum"] = sha1(wanted["unit"])
        entry["changed"] = bool(entry["written"]) or changed_dir
        out.append(entry)
    return out


def record(layout: Layout, instances: t.Sequence[t.Mapping[str, t.Any]], check: bool) -> list[dict[str, t.Any]]:
    """Write each plan record (``{name, plan: mapping}``) with the checksum of the unit now on disk."""
    out = []
    for inst in instances:
        name = validate_name(inst["name"])
        plan = inst.get("plan")
        if not isinstance(plan, t.Mapping):
            raise UnitFilesError(f"instance {name}: plan must be a mapping to record")
        unit = read_bytes(layout.path(name, "unit"))
        if unit is None:
            raise UnitFilesError(f"instance {name}: no unit at {layout.path(name, 'unit')} to record a plan for")
        doc = dict(plan)
        doc["unit_checksum"] = sha1(unit)
        uid, gid, mode = layout.owner("plan")
        data = plan_bytes(doc)
        was_open = change_open(layout, name)
        if was_open and not check:
            _note_written(layout, name, {"plan": sha1(data)}, check, close=True)  # the change is complete
        changed = ensure_file(layout.path(name, "plan"), data, uid, gid, mode, check) or was_open
        changed |= ensure_absent(layout.changing_marker(name), check)  # a release before 2.0
        # the instance serves a checked unit: a cut-off canary's hold on it is over
        changed |= ensure_absent(canary_hold_path(layout, name), check)
        out.append({"name": name, "unit_checksum": doc["unit_checksum"], "changed": changed})
    return out


def _created_by_change(layout: Layout, name: str, kind: str, doc: t.Mapping[str, t.Any]) -> bool:
    """The live file is the one the snapshot's change wrote (a legacy snapshot does not say: its file is the change's)."""
    live = read_bytes(layout.path(name, kind))
    return live is not None and bool(doc.get("legacy") or dict(doc.get("written") or {}).get(kind) == sha1(live))


def restore(layout: Layout, names: t.Sequence[str], systemctl: SystemctlRunner | None, check: bool,
            systemctl_bin: str = "systemctl", close: bool = True, change_id: str = "") -> list[dict[str, t.Any]]:
    """Put back what the last snapshot kept; see the module docstring for the rules.

    ``change_id``: restore only a snapshot this change took or carried on (a change whose own
    snapshot could not be written restores nothing: the last snapshot belongs to an earlier
    change, whose files are not this change's to put back). A file the snapshot marks absent
    (the change created it) is removed only while it is the file the change wrote; one changed
    since is left and named in ``left``. ``close=False`` leaves the change open: a rollback
    restores, restarts or stops what it restored, and only then closes the change (a second
    call), so that a rollback cut off before its restart still resumes from the snapshot.
    """
    out = []
    for name in (validate_name(n) for n in names):
        entry: dict[str, t.Any] = {"name": name, "restored": [], "removed": [], "unknown": [], "left": [],
                                   "restart": False, "stop": False, "changed": False, "runtime_release": "",
                                   "launch": None, "boot_gate_state": "", "port": None}
        doc = load_snapshot(layout, name)
        if doc is None:
            entry["unknown"] = list(KINDS)
            entry["skipped"] = "no snapshot: its files are left as they are"
            out.append(entry)
            continue
        if change_id and change_id not in doc.get("changes", []) and doc.get("change_id") != change_id:
            # this change never kept the instance's files: it changed nothing of them either
            entry["skipped"] = (f"the last snapshot belongs to change {doc.get('change_id') or 'of an earlier release'}, "
                                f"not to this one ({change_id}): its files and service are left as they are")
            out.append(entry)
            continue
        unit_created = doc["files"].get("unit", False) is None
        if unit_created and systemctl is not None and _created_by_change(layout, name, "unit", doc):
            # A unit that did not exist before the change: stop and disable it while its file is there.
            if not check:
                rc, _out, err = systemctl([systemctl_bin, "disable", "--now", layout.unit_name(name)])
                if rc != 0 and "does not exist" not in err and "not loaded" not in err:
                    raise UnitFilesError(f"systemctl disable --now {layout.unit_name(name)} failed (rc {rc}): {err.strip()}")
            entry["stopped"] = True
        for kind in KINDS:
            if kind not in doc["files"]:
                entry["unknown"].append(kind)
                continue
            copy = _kept_data(doc, kind)
            if copy is not None:
                if ensure_kind(layout, name, kind, copy, check):
                    entry["restored"].append(kind)
            elif not os.path.lexists(layout.path(name, kind)):
                continue
            elif _created_by_change(layout, name, kind, doc):
                if ensure_absent(layout.path(name, kind), check):
                    entry["removed"].append(kind)
            else:
                entry["left"].append(kind)  # not the file this change wrote: someone else's, kept
        has_copy = doc["files"].get("unit") is not None
        entry["runtime_release"] = str(doc.get("runtime_release") or "")
        # what the restored unit's boot is checked against: the launch record of the restored plan file
        entry.update(_restored_launch(doc))
        # the restored unit runs again if it served before the change; else it is stopped
        entry["restart"] = has_copy and bool(doc.get("serving"))
        entry["stop"] = has_copy and not doc.get("serving")
        closed = False
        if close and doc.get("open"):
            closed = True
            if not check:
                _commit_snapshot(layout, name, dict(doc, open=False, restored_at=time.time()), check)
        if close and entry["restart"]:
            # it serves again as before the change: a cut-off canary's hold on it is over
            closed |= ensure_absent(canary_hold_path(layout, name), check)
        entry["changed"] = bool(entry["restored"] or entry["removed"] or entry.get("stopped") or closed)
        out.append(entry)
    return out


def _restored_launch(doc: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The launch record, boot-gate state file and port of the plan file a snapshot keeps (``launch`` None:
    no plan file, or one without a launch record; its boot is checked for health and errors only)."""
    data = _kept_data(doc, "plan") if doc["files"].get("plan") is not None else None
    try:
        plan = json.loads(data) if data is not None else {}
    except ValueError:
        plan = {}
    plan = plan if isinstance(plan, dict) else {}
    launch = plan.get("launch")
    gate = plan.get("boot_gate")
    port = plan.get("port")
    return {"launch": launch if isinstance(launch, dict) else None,
            "boot_gate_state": str(gate.get("state_file") or "") if isinstance(gate, dict) and launch else "",
            "port": port if isinstance(port, int) and not isinstance(port, bool) else None}


def runtime_to_restore(layout: Layout, names: t.Sequence[str], runtime_venv: str, change_id: str = "") -> dict[str, t.Any]:
    """The engine release a restore of ``names`` switches the venv back to, read before anything is restored.

    ``release``: the release the snapshots of the changes that switched the runtime kept ('' when none did,
    or when the venv points to it already); ``current``: the release the venv points to now; ``instances``:
    the instances whose snapshot kept it. Snapshots that keep two different releases are an error naming
    them (no release is right for both)."""
    kept: dict[str, list[str]] = {}
    for name in (validate_name(n) for n in names):
        doc = load_snapshot(layout, name)
        if doc is None or (change_id and change_id not in doc.get("changes", []) and doc.get("change_id") != change_id):
            continue
        release = str(doc.get("runtime_release") or "")
        if release:
            kept.setdefault(release, []).append(name)
    if len(kept) > 1:
        raise UnitFilesError("the snapshots keep different engine releases to switch back to: "
                             + "; ".join(f"{', '.join(n)}: {r}" for r, n in sorted(kept.items()))
                             + "; roll back the instances of one release at a time")
    current = runtime_link(runtime_venv)
    release, instances = next(iter(kept.items())) if kept else ("", [])
    return {"release": "" if release == current else release, "current": current, "instances": instances}


def rollback_summary(entries: t.Sequence[t.Mapping[str, t.Any]]) -> str:
    """One sentence of what a restore did (``restore``'s entries), instance by instance, in the report's words."""
    parts = []
    for e in entries:
        name = str(e.get("name", "?"))
        if e.get("skipped"):
            parts.append(f"instance {name} not restored ({e['skipped']})")
            continue
        done = []
        if e.get("restored"):
            done.append("put back its " + ", ".join(e["restored"]) + " file" + ("s" if len(e["restored"]) > 1 else ""))
        if e.get("removed"):
            done.append("removed the " + ", ".join(e["removed"]) + " file" + ("s" if len(e["removed"]) > 1 else "")
                        + " the change created")
        if e.get("left"):
            done.append("left its " + ", ".join(e["left"]) + " file" + ("s" if len(e["left"]) > 1 else "")
                        + " in place (changed since the change wrote them)")
        if e.get("restart"):
            done.append("restarted it (it served before the change)")
        elif e.get("stop"):
            done.append("left it stopped (it did not serve before the change)")
        elif e.get("stopped"):
            done.append("stopped and disabled its unit (it did not exist before the change)")
        parts.append(f"instance {name}: " + ("; ".join(done) if done else "already as before the change"))
    return "; ".join(parts) if parts else "no instance to restore"


# ---------------------------------------------------------------- units taken over


def validate_adopted(units: t.Sequence[t.Any], instance_names: t.Sequence[str], field: str = "adopt") -> list[str]:
    """The units to take over: systemd service names, none twice, none of this host's own instance units."""
    own = set(unit_names(instance_names))
    out: list[str] = []
    if not isinstance(units, (list, tuple)):
        raise UnitFilesError(f"{field}: expected a list of unit names")
    for i, unit in enumerate(units):
        try:
            name = v.systemd_unit_name(unit, f"{field}[{i}]")
        except v.ValidationError as exc:
            raise UnitFilesError(str(exc)) from None
        if not name.endswith(".service"):
            raise UnitFilesError(f"{field}[{i}]: {name} is not a service unit (.service)")
        if name in own:
            raise UnitFilesError(f"{field}[{i}]: {name} is the unit of one of this host's instances, not one to take over")
        if name in out:
            raise UnitFilesError(f"{field}[{i}]: {name} is named twice")
        out.append(name)
    return out


def _adopted_record(layout: Layout, unit: str) -> str:
    return os.path.join(layout.kept_dir, f"adopted-{unit}.json")


def adopted_state(props: t.Mapping[str, str], unit: str) -> dict[str, t.Any]:
    """What a unit to take over is now: found, running, enabled; ``holds``: it still runs or is enabled."""
    found = props.get("LoadState", "not-found") not in ("not-found", "")
    active = props.get("ActiveState", "inactive")
    enabled = props.get("UnitFileState", "")
    running = found and active in _RUNNING
    is_enabled = found and enabled in _ENABLED
    return {"unit": unit, "found": found, "active_state": active, "unit_file_state": enabled,
            "holds": running or is_enabled, "running": running, "enabled": is_enabled}


def adopted_status(units: t.Sequence[str], show: ShowRunner) -> list[dict[str, t.Any]]:
    """The state of every unit to take over (read-only)."""
    props = show(list(units))
    return [adopted_state(props.get(u, {}), u) for u in units]


def adoption_reasons(adopted: t.Sequence[t.Mapping[str, t.Any]]) -> list[str]:
    """Why the instances are pending because of units they take over (empty once taken over)."""
    out = []
    for a in adopted:
        if a["holds"]:
            how = [w for w, on in (("running", a["running"]), ("enabled", a["enabled"])) if on]
            out.append(f"takes over {a['unit']} ({' and '.join(how)})")
    return out


def _drop_in_paths(value: str) -> list[str]:
    return [p for p in value.split() if p.startswith("/")]


def snapshot_adopted(layout: Layout, units: t.Sequence[str], show: ShowRunner, check: bool,
                     resumed: bool = False) -> list[dict[str, t.Any]]:
    """Keep each unit to take over (file, drop-ins, running and enabled) with the snapshot that takes it over.

    A unit that still runs or is enabled is kept now (this change takes it over). One that is
    taken over already keeps the record of an interrupted change (``resumed``); otherwise its
    record belongs to an older change and is dropped, so that restoring this change leaves it off.
    """
    props = show(list(units))
    out = []
    for unit in units:
        now = adopted_state(props.get(unit, {}), unit)
        path = _adopted_record(layout, unit)
        entry = dict(now, kept=False, changed=False)
        if now["holds"]:
            fragment = props[unit].get("FragmentPath", "")
            files: dict[str, dict[str, t.Any]] = {}
            for file_path in ([fragment] if fragment.startswith("/") else []) + _drop_in_paths(props[unit].get("DropInPaths", "")):
                data = read_bytes(file_path)
                if data is not None:
                    files[file_path] = {"data": base64.b64encode(data).decode("ascii"),
                                        "mode": stat.S_IMODE(os.stat(file_path).st_mode)}
            doc = {"unit": unit, "fragment_path": fragment, "files": files, "running": now["running"],
                   "enabled": now["enabled"], "active_state": now["active_state"], "unit_file_state": now["unit_file_state"]}
            data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")
            if not check and not os.path.isdir(layout.kept_dir):  # as snapshot() makes them
                if not os.path.isdir(layout.state_dir):
                    ensure_dir(layout.state_dir, layout.uid, layout.plan_gid, 0o750, check)
                ensure_dir(layout.kept_dir, layout.uid, layout.gid, 0o700, check)
            entry.update(kept=True, files=sorted(files),
                         changed=ensure_file(path, data, layout.uid, layout.gid, 0o600, check))
        elif resumed and os.path.exists(path):
            entry.update(kept=True, resumed=True)
        else:
            entry["changed"] = ensure_absent(path, check)
        out.append(entry)
    return out


def restore_adopted(layout: Layout, units: t.Sequence[str], check: bool) -> list[dict[str, t.Any]]:
    """Put back the files of the units the last change took over; say which to enable and start again."""
    out = []
    for unit in units:
        entry: dict[str, t.Any] = {"unit": unit, "restored": [], "enable": False, "start": False, "changed": False}
        raw = read_bytes(_adopted_record(layout, unit))
        if raw is None:  # the last change took nothing over: the unit stays as it is
            out.append(entry)
            continue
        try:
            doc = json.loads(raw)
            files = {str(k): (base64.b64decode(str(f["data"]), validate=True), int(f["mode"]) & 0o7777)
                     for k, f in dict(doc["files"]).items()}
            if not all(os.path.isabs(k) for k in files):
                raise ValueError("a kept file has no absolute path")
        except (ValueError, KeyError, TypeError) as exc:
            raise UnitFilesError(f"{_adopted_record(layout, unit)}: cannot be read ({exc})") from None
        for file_path, (data, mode) in sorted(files.items()):
            if not os.path.isdir(os.path.dirname(file_path)) and not check:  # a drop-in directory removed since
                os.makedirs(os.path.dirname(file_path), mode=0o755, exist_ok=True)
            if ensure_file(file_path, data, layout.uid, layout.gid, mode, check):
                entry["restored"].append(file_path)
        entry.update(enable=bool(doc.get("enabled")), start=bool(doc.get("running")), changed=bool(entry["restored"]))
        out.append(entry)
    return out
