# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""One table of the defaults that more than one entry point of the collection has.

A setting such as the gate margin is an option of the ``kv_plan`` action, a variable of the
``kv_plan`` role and an inventory variable of the playbooks. Each of them needs a default, and
they must be the same one: a module or an action plugin takes it from :data:`DEFAULTS`; the role
defaults, the argument specs, the module documentation and the playbooks' ``default(...)``
filters, which cannot import Python, are checked against it by ``tests/unit/test_defaults.py``.

Standard library only: modules import it on the hosts.
"""

from __future__ import annotations

import copy
import typing as t
from types import MappingProxyType

MIB = 1024**2
GIB = 1024**3

# A monitoring agent's CUDA context (nvidia-smi dmon, DCGM, a Python exporter with torch): NVML free memory
# less the free memory a CUDA program sees once its context is up, measured on an NVIDIA H200 with
# driver 580.159.04 (docs/measurements.md): 552,402,944 B (526.8 MiB).
MEASURED_CUDA_CONTEXT_BYTES = 552_402_944


class Default(t.NamedTuple):
    """A default value and the reason it is that value."""

    value: t.Any
    reason: str


DEFAULTS: t.Mapping[str, Default] = MappingProxyType({
    # planning (the kv_plan action and role, the rollout's inventory variables)
    "guard_bytes": Default(
        512 * MIB, "each rank's budget stays this far below vLLM's own suggestion (its estimate's errors: activations, "
        "CUDA graphs, allocator); it cancels out of the floor, so it protects the engine, not the gate"),
    "gate_margin_bytes": Default(
        768 * MIB, "the weakest rank keeps this much free memory above its floor, so that a monitoring agent's CUDA "
        "context (526.8 MiB measured on an H200) started after the probe neither shrinks nor refuses the start"),
    "budget_granularity_bytes": Default(
        256 * MIB, "small moves of free memory between runs give the same budget, so nothing restarts for them"),
    "keep_step_bytes": Default(
        512 * MIB, "a deployed budget still safe and this close to the new one is kept: no canary, no restart"),
    "require_admission": Default(True, "a class that cannot hold its admission plan is never deployed"),
    "split_policy": Default(
        "per_host", "a class with outlier hosts deploys the weakest rank's budget on the outliers only; the other hosts "
        "run the plan of their own group, so one outlier does not cost every host its budget"),
    "unstable_scope": Default(
        "host", "a host whose free memory is not steady runs vLLM's own profiling (auto_profile); the class's steady hosts "
        "keep a fixed budget planned without it, and are not all restarted for one host"),
    "budget_mode": Default("max_safe", "deploy the largest budget every rank can hold"),
    "fit_headroom": Default(0.1, "fit_admission: a tenth more blocks than the admission plan needs"),
    "max_capacity_loss": Default(0.05, "a split is recommended when the weakest hosts cost more than 5 % of the median host's budget"),
    "unstable_share": Default(0.5, "free memory that moves by more than half the guard between samples is not steady enough for a fixed budget"),
    "cuda_context_bytes": Default(
        1 * GIB, "vLLM's CUDA context and allocator when the reference has no vLLM-logged free memory: about twice "
        "the 526.8 MiB context measured on an H200"),
    "probe_history_window": Default(5, "recent probes compared for movement of a rank's free memory"),
    "probe_history_keep": Default(20, "probes kept per host"),
    # starting and checking engines
    "settle_timeout": Default(0, "seconds the production instance gets to serve and hold its memory still after the profiled canary; "
                              "0 derives it from that canary's boot (_boot_check.boot_timeout)"),
    "boot_timeout": Default(0, "seconds a unit's engine gets to answer /health after a start; 0 derives it from the class's measured "
                            "canary boot (_boot_check.boot_timeout), as a large model compiles and loads for many minutes"),
    "canary_startup_timeout": Default(0, "seconds a canary engine gets to answer /health, derived as a unit's boot"),
    "probe_samples": Default(1, "one NVML reading per GPU unless told otherwise (the rollout asks for more)"),
    "probe_interval": Default(1.0, "seconds between NVML readings"),
    # where things are on a host
    "executable": Default("/opt/vllm/venv/bin/vllm", "the vllm CLI in the venv vllm_runtime installs"),
    "state_dir": Default("/etc/gpufleet", "plan files, environment files and kept units"),
    "unit_dir": Default("/etc/systemd/system", "where systemd reads administrator units"),
    "service_user": Default("vllm", "the unprivileged account vLLM and its canaries run as"),
    "nvml_binding_venv": Default("/opt/gpufleet/nvml-venv", "the small venv the NVML binding goes into on a host whose "
                                 "interpreters lack it (before the vLLM runtime, whose venv ships it)"),
    # the runs
    "reprofile_after_days": Default(30.0, "a plan older than this is reprofile_due in the audit"),
    "lease_ttl": Default(7200, "seconds a class's lease holds without renewal; every batch renews it"),
    "lease_wait": Default(0, "a class another run holds is refused at once"),
    "remote_timeout": Default(600, "seconds any one remote call may take"),
})


def default(name: str) -> t.Any:
    """The default of setting ``name`` (a copy: callers may change a list or a dict they get)."""
    return copy.deepcopy(DEFAULTS[name].value)
