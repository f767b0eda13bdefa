# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters: to_bytes, human_bytes, kv_bytes_per_token, kv_reference, host_plan (documentation in the YAML files beside this one)."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._geometry import GeometryError, engine_target, geometry_from_config
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import SizeError, human_bytes as _human_bytes, parse_size
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError, boolean, integer
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._canary_reference import ReferenceError, reference_from_canary
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import host_plan as _host_plan


def to_bytes(value: Any, field: str = "value") -> int:
    """``"28.25GiB"`` -> ``30333206528``."""
    if not isinstance(field, str):
        field = "value"
    try:
        return parse_size(value, field)
    except SizeError as exc:
        raise AnsibleFilterError(f"to_bytes: {exc}") from None


def human_bytes(value: Any, precision: int = 2, exact: bool = False) -> str:
    """``30333206528`` -> ``"28.25GiB"``; ``exact=true`` renders text that parses back to the same byte."""
    try:
        exact = boolean(exact, "human_bytes exact")
        precision = integer(precision, "human_bytes precision", low=0, high=20)
    except ValidationError as exc:
        raise AnsibleFilterError(f"human_bytes: {exc}") from None
    if isinstance(value, str):
        try:
            value = parse_size(value, "human_bytes input")
        except SizeError as exc:
            raise AnsibleFilterError(f"human_bytes: {exc}") from None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise AnsibleFilterError(f"human_bytes: expected an integer number of bytes, got {value!r}")
    try:
        return _human_bytes(value, precision, exact=exact)
    except (SizeError, ValueError) as exc:
        raise AnsibleFilterError(f"human_bytes: {exc}") from None


def kv_bytes_per_token(config: Any, serve_args: Mapping[str, Any] | None = None, per: str = "token", vllm_version: Any = None) -> int:
    """KV bytes per token (or per block with ``per='block'``) of one rank, from a HF config and serve args.

    Without ``block_size`` in ``serve_args`` a block is the one vLLM ``vllm_version`` picks (the newest known release's
    rules when not given).
    """
    if not isinstance(per, str) or per not in ("token", "block"):
        raise AnsibleFilterError(f"kv_bytes_per_token: per must be 'token' or 'block', got {per!r}")
    if serve_args is not None and not isinstance(serve_args, Mapping):
        raise AnsibleFilterError("kv_bytes_per_token: serve_args must be a mapping of vllm serve options")
    if vllm_version is not None and not isinstance(vllm_version, str):
        raise AnsibleFilterError(f"kv_bytes_per_token: vllm_version must be a version string, got {vllm_version!r}")
    try:
        target = engine_target(vllm_version, device=(serve_args or {}).get("device"))
    except ValueError as exc:
        raise AnsibleFilterError(f"kv_bytes_per_token: serve_args.device: {exc}") from None
    try:
        geo = geometry_from_config(config, serve_args or {}, target)
    except GeometryError as exc:
        raise AnsibleFilterError(f"kv_bytes_per_token: {exc}") from None
    return geo.bytes_per_token if per == "token" else geo.bytes_per_block


def kv_reference(
    run: Any,
    preboot: Any,
    gpus: Any,
    config: Mapping[str, Any] | None = None,
    serve_args: Mapping[str, Any] | None = None,
    canary: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The reference profile of a profiled ``vllm_canary`` result, as ``kv_profile`` records it and ``kv_plan`` reads it."""
    if not isinstance(run, Mapping):
        raise AnsibleFilterError("kv_reference: expected a vllm_canary result (a mapping)")
    if not isinstance(preboot, list) or not isinstance(gpus, list):
        raise AnsibleFilterError("kv_reference: preboot must be gpu_memory_info's gpus list and gpus the instance's GPU indices")
    if config is not None and not isinstance(config, Mapping):
        raise AnsibleFilterError("kv_reference: config must be the model's config.json as a mapping")
    try:
        return reference_from_canary(run, preboot, gpus, config=config, serve_args=serve_args, canary=canary)
    except (ReferenceError, KeyError, TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"kv_reference: {exc}") from None


def host_plan(plan: Any, host: Any) -> Mapping[str, Any]:
    """A class's kv_plan result and one of its hosts -> the plan that host runs (its group's, else the class's)."""
    if not isinstance(plan, Mapping):
        raise AnsibleFilterError(f"host_plan: expected a kv_plan result (a mapping), got {type(plan).__name__}")
    if not isinstance(host, str) or not host:
        raise AnsibleFilterError(f"host_plan: expected a host name, got {host!r}")
    return _host_plan(plan, host)


class FilterModule:
    """gpufleet.vllm size and KV geometry filters."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {
            "to_bytes": to_bytes,
            "human_bytes": human_bytes,
            "kv_bytes_per_token": kv_bytes_per_token,
            "kv_reference": kv_reference,
            "host_plan": host_plan,
        }
