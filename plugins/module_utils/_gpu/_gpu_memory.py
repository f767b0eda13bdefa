# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The module shell shared by ``gpu_memory_info`` and ``gpu_memory_facts``.

One argument spec, its checks, the probe call and the result; the two modules differ
only in ``set_facts`` (the facts module adds ``ansible_facts``).  No Ansible import:
:func:`run` takes the module object (anything with :class:`ModuleShell`'s methods)
and the message for a missing binding from the calling module.
"""
from __future__ import annotations

import platform
import traceback
from typing import Any, Callable, NoReturn, Protocol, Sequence

from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default
from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._nvml_probe import NvmlProbeError, probe
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError, integer, number, text

__all__ = [
    "ARGUMENT_SPEC",
    "MAX_INTERVAL",
    "MAX_SAMPLES",
    "NVML_FACT_KEYS",
    "PYNVML_IMPORT_ERROR",
    "ModuleShell",
    "check_params",
    "host_facts",
    "host_message",
    "module_result",
    "module_runner",
    "probe_report",
    "pynvml",
    "read",
    "run",
]

# The NVML binding of the modules that read NVML on the host (gpu_memory_info, gpu_memory_facts,
# vllm_audit, vllm_unit's gpu_probe), or why it cannot be imported (they fail with missing_required_lib).
try:
    import pynvml
except ImportError:
    pynvml = None
    PYNVML_IMPORT_ERROR: str | None = traceback.format_exc()
else:
    PYNVML_IMPORT_ERROR = None

ARGUMENT_SPEC: dict[str, dict[str, Any]] = {
    "devices": {"type": "list", "elements": "str"},
    "samples": {"type": "int", "default": default("probe_samples")},
    "interval": {"type": "float", "default": default("probe_interval")},
    "service_units": {"type": "list", "elements": "str", "default": []},
    "service_pids": {"type": "list", "elements": "int", "default": []},
}

MAX_SAMPLES = 1000
MAX_INTERVAL = 3600.0

# The host-level result keys that gpufleet_nvml repeats (with the host name).
NVML_FACT_KEYS = ("driver_version", "cuda_driver_version", "nvml_version", "own_pids")


class ModuleShell(Protocol):
    """What :func:`run` uses of an ``AnsibleModule``."""

    params: dict[str, Any]

    def run_command(self, args: Sequence[str], **kwargs: Any) -> Any: ...

    def warn(self, warning: str) -> None: ...

    def fail_json(self, msg: str, **kwargs: Any) -> NoReturn: ...

    def exit_json(self, **kwargs: Any) -> NoReturn: ...


def check_params(params: dict[str, Any]) -> None:
    """The edge checks: finite, bounded sample count and interval; unit names and devices as plain text."""
    integer(params["samples"], "samples", low=1, high=MAX_SAMPLES)
    number(params["interval"], "interval", low=0, high=MAX_INTERVAL)
    for i, device in enumerate(params["devices"] or []):
        text(device, f"devices[{i}]")
    for i, unit in enumerate(params["service_units"] or []):
        text(unit, f"service_units[{i}]")
    for i, pid in enumerate(params["service_pids"] or []):
        integer(pid, f"service_pids[{i}]", low=1)


def host_facts(result: dict[str, Any], host: str) -> dict[str, Any]:
    """``{gpufleet_gpus, gpufleet_nvml}`` from a probe result read on ``host``."""
    nvml = {key: result[key] for key in NVML_FACT_KEYS}
    nvml["host"] = host
    return {"gpufleet_gpus": result["gpus"], "gpufleet_nvml": nvml}


def read(params: dict[str, Any], binding: Any, host: str, run_command: Callable[[Sequence[str]], tuple[int, str, str]]) -> dict[str, Any]:
    """The probe with the options of :data:`ARGUMENT_SPEC` (checked by :func:`check_params`); raises NvmlProbeError."""
    return probe(
        binding,
        devices=params["devices"],
        samples=params["samples"],
        interval=params["interval"],
        service_units=params["service_units"],
        service_pids=params["service_pids"],
        host=host,
        run_command=run_command,
    )


def module_runner(module: ModuleShell) -> Callable[..., tuple[int, str, str]]:
    """``module.run_command`` as the probe and the snapshot call it: C locale, no pager, and a program that
    cannot be started (a missing systemctl, an engine interpreter that is a broken link) returned as rc 127
    with the reason, for the caller to name, instead of ending the module. ``cwd``: where it runs (the
    model check runs as the service user from /)."""
    def run_command(argv: Sequence[str], cwd: str | None = None) -> tuple[int, str, str]:
        try:
            rc, out, err = module.run_command(list(argv), environ_update={"LC_ALL": "C", "SYSTEMD_PAGER": ""},
                                              handle_exceptions=False, cwd=cwd)
        except OSError as exc:
            return 127, "", str(exc)
        return int(rc), str(out), str(err)

    return run_command


def module_result(module: ModuleShell, binding: Any, host: str, *, set_facts: bool) -> dict[str, Any]:
    """Probe through ``binding`` with the module's parameters; returns the module result (with ``warnings``)."""
    result = read(module.params, binding, host, module_runner(module))
    out: dict[str, Any] = {"changed": False, **result}
    if set_facts:
        out["ansible_facts"] = host_facts(result, host)
    return out


def host_message(exc: NvmlProbeError, host: str) -> str:
    """The probe's message, naming the host once."""
    return exc.message if exc.message.startswith(host) else f"{host}: {exc.message}"


def probe_report(module: ModuleShell, params: dict[str, Any], binding: Any, host: str) -> dict[str, Any]:
    """The probe of a module that reports a failed probe rather than failing (vllm_unit's ``gpu_probe``).

    Its result (``warnings`` handed to ``module.warn``), or ``{error, gpu, nvml_error}``
    naming the host and the GPU: the caller has done its own work by then (read or stopped
    the units), and the free-memory gate that reads the probe fails the host with the error.
    """
    try:
        result = read(params, binding, host, module_runner(module))
    except NvmlProbeError as exc:
        return {"error": host_message(exc, host), "gpu": exc.gpu, "nvml_error": exc.code}
    for warning in result.pop("warnings"):
        module.warn(warning)
    return result


def run(module: ModuleShell, binding: Any, *, set_facts: bool, missing_binding: str, import_error: str | None) -> NoReturn:
    """The whole module: check the parameters, probe, warn, exit (or fail naming the host and GPU).

    ``binding`` is the imported ``pynvml`` or None; then the module fails with
    ``missing_binding`` (``missing_required_lib``'s message) and ``import_error``.
    """
    try:
        check_params(module.params)
    except ValidationError as exc:
        module.fail_json(msg=str(exc))
    if binding is None:
        module.fail_json(msg=missing_binding, exception=import_error)
    host = platform.node()
    try:
        result = module_result(module, binding, host, set_facts=set_facts)
    except NvmlProbeError as exc:
        module.fail_json(msg=host_message(exc, host), gpu=exc.gpu, nvml_error=exc.code)
    for warning in result.pop("warnings"):
        module.warn(warning)
    module.exit_json(**result)
