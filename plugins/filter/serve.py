# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters: vllm_serve_argv, vllm_secret_options, systemd_exec_start, systemd_environment,
systemd_environment_file, systemd_value, vllm_service_problems, vllm_instances_problems, health_url, boot_timeout (documentation in the YAML
files beside this one)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._engine_process import base_url
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import EngineSpecError, render_serve_args
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._unit_files import instances_problems, service_input_problems
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import (
    ValidationError,
    environment_file,
    is_secret_option,
    port as _port,
    systemd_environment as _systemd_environment,
    systemd_exec_start as _systemd_exec_start,
    systemd_value as _systemd_value,
)
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan_inputs import PlanError, boot_timeout_for


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise AnsibleFilterError(f"{name}: expected a mapping of vllm serve options, got {type(value).__name__}")
    return value


def _field(field: Any, default: str) -> str:
    return field if isinstance(field, str) and field else default


def health_url(host: Any, port: Any) -> str:
    """``http://HOST:PORT/health`` of an engine that listens on ``host`` (0.0.0.0, :: or empty: 127.0.0.1)."""
    try:
        if not isinstance(host, str) or any(c.isspace() for c in host) or "/" in host:
            raise ValidationError(f"health_url: expected a listen address or a host name, got {host!r}")
        return base_url(host, _port(port, "health_url port")) + "/health"
    except ValidationError as exc:
        raise AnsibleFilterError(str(exc)) from None


def boot_timeout(configured: Any, measured: Any = None, serve_args: Any = None, field: Any = "boot_timeout") -> int:
    """A configured boot timeout (0: derive it), the class's measured canary boot and the serve args -> seconds.

    ``measured``: seconds, a plan (its ``boot_seconds``), a reference profile or a profile-store
    record (its canary's ``startup_seconds``), or None."""
    name = field if isinstance(field, str) and field else "boot_timeout"
    try:
        return boot_timeout_for(configured, measured, _mapping(serve_args, "serve_args"), name)
    except (EngineSpecError, PlanError) as exc:
        raise AnsibleFilterError(f"boot_timeout: {exc}") from None


def vllm_serve_argv(serve_args: Any) -> list[str]:
    """``{'max_model_len': 4096, 'enable_prefix_caching': False}`` -> ``['--enable-prefix-caching'...]`` words."""
    try:
        return render_serve_args(_mapping(serve_args, "vllm_serve_argv"))
    except (EngineSpecError, ValidationError) as exc:
        raise AnsibleFilterError(f"vllm_serve_argv: {exc}") from None


def vllm_secret_options(serve_args: Any) -> list[str]:
    """The keys of ``serve_args`` that name a secret (api_key, apikey, hf_token, ...), sorted."""
    return sorted(str(key) for key in _mapping(serve_args, "vllm_secret_options") if is_secret_option(str(key)))


def systemd_exec_start(words: Any, executable: Any, serve_args: Any = None, field: Any = "ExecStart") -> str:
    """``['serve', 'model dir', '--port', 8000]`` (+ serve_args rendered as vllm_serve_argv) -> the quoted
    value of ``ExecStart=`` (options on their own lines)."""
    if not isinstance(words, (list, tuple)):
        raise AnsibleFilterError(f"systemd_exec_start: expected a list of words, got {type(words).__name__}")
    try:
        extra = render_serve_args(_mapping(serve_args, "systemd_exec_start serve_args")) if serve_args else []
        return _systemd_exec_start(executable, list(words) + extra, _field(field, "ExecStart"))
    except (EngineSpecError, ValidationError) as exc:
        raise AnsibleFilterError(f"systemd_exec_start: {exc}") from None


def systemd_environment(value: Any, name: Any, field: Any = "env") -> str:
    """``'50% $HOME' | systemd_environment('NOTE')`` -> ``"NOTE=50%% $HOME"`` (one ``Environment=`` assignment)."""
    try:
        return _systemd_environment(name, value, _field(field, "env"))
    except ValidationError as exc:
        raise AnsibleFilterError(f"systemd_environment: {exc}") from None


def systemd_environment_file(env: Any, field: Any = "secret_env") -> str:
    """``{NAME: value}`` -> ``NAME="value"`` lines in systemd's ``EnvironmentFile=`` syntax."""
    try:
        return environment_file(env if env is not None else {}, _field(field, "secret_env"))
    except ValidationError as exc:
        raise AnsibleFilterError(f"systemd_environment_file: {exc}") from None


def systemd_value(value: Any, field: Any) -> str:
    """A value for a unit line that is not a command line (Description=, User=): no control character, ``%`` as ``%%``."""
    try:
        return _systemd_value(value, _field(field, "value"))
    except ValidationError as exc:
        raise AnsibleFilterError(f"systemd_value: {exc}") from None


def vllm_service_problems(inputs: Any) -> list[str]:
    """The role vllm_service's inputs -> a list of ``field: what is wrong`` (empty when all are valid)."""
    if not isinstance(inputs, Mapping):
        raise AnsibleFilterError(f"vllm_service_problems: expected a mapping of the role's variables, got {type(inputs).__name__}")
    return service_input_problems(inputs)


def vllm_instances_problems(instances: Any, field: str = "vllm_service_instances", gangs: Any = False) -> list[str]:
    """An instance list -> a list of ``field[i].key: what is wrong`` (empty when it is valid)."""
    if not isinstance(field, str) or not field:
        raise AnsibleFilterError("vllm_instances_problems: field must be the name of the variable that holds the instances")
    if not isinstance(gangs, bool):
        raise AnsibleFilterError(f"vllm_instances_problems: gangs must be true or false, got {gangs!r}")
    return instances_problems(instances, field, gangs)


class FilterModule:
    """gpufleet.vllm vllm serve option and systemd unit filters."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {
            "boot_timeout": boot_timeout,
            "health_url": health_url,
            "vllm_serve_argv": vllm_serve_argv,
            "vllm_secret_options": vllm_secret_options,
            "systemd_exec_start": systemd_exec_start,
            "systemd_environment": systemd_environment,
            "systemd_environment_file": systemd_environment_file,
            "systemd_value": systemd_value,
            "vllm_service_problems": vllm_service_problems,
            "vllm_instances_problems": vllm_instances_problems,
        }
