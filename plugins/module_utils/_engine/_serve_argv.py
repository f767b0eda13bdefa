# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The ``vllm serve`` command line: the options of ``serve_args``, the argv of one engine, its
environment, and the one rule for secrets (an API key never in an argv, the value of a
secret-looking option hidden wherever an argv is shown).

Plain Python (no Ansible import). The unit files (``_unit_files``), the canary (``_canary``) and
the ``serve`` filters render through these functions.
"""

from __future__ import annotations

import json
import math
import os
import re
import typing as t

from .._validate import ValidationError, env_name, is_secret_option, number, port as valid_port, text as v_text

# Options the canary sets itself; a caller must not pass them in serve_args.
CONTROLLED_OPTIONS = frozenset(
    {
        "kv-cache-memory-bytes",
        "kv-cache-memory",
        "host",
        "port",
        "gpu-memory-utilization",
    }
)


# Environment variables that silently replace a manual KV byte budget.
BUDGET_OVERRIDING_ENV = ("VLLM_CPU_KVCACHE_SPACE",)


LOOPBACK = "127.0.0.1"


class EngineSpecError(ValueError):
    """An argument the caller gave cannot produce a valid ``vllm serve`` call."""


def option_name(key: str) -> str:
    """``max_model_len`` / ``--max-model-len`` -> ``max-model-len``."""
    name = str(key).strip()
    while name.startswith("-"):
        name = name[1:]
    return name.replace("_", "-")


def render_serve_args(serve_args: t.Mapping[str, t.Any] | None) -> list[str]:
    """Render a dict of ``vllm serve`` options as argv words.

    ``True`` gives a bare flag, ``False`` gives ``--no-<flag>`` (vLLM's boolean options
    are ``BooleanOptionalAction``s, and several default to on, e.g. prefix caching, so
    omitting a ``False`` would silently keep the default), ``None`` omits the option, a list gives
    the flag followed by its items (vLLM's ``nargs='+'`` options), a dict gives
    compact JSON (``--compilation-config '{...}'``), anything else ``str()``.
    Options the canary controls itself are refused.
    """
    argv: list[str] = []
    seen: dict[str, t.Any] = {}
    for key, value in sorted((serve_args or {}).items(), key=lambda item: option_name(item[0])):
        try:
            v_text(key, "serve_args option name")
        except ValidationError as exc:
            raise EngineSpecError(str(exc)) from None
        name = option_name(key)
        if not name or not _OPTION_RE.fullmatch(name):
            raise EngineSpecError(f"serve_args: option name {key!r}: use letters, digits, '-' and '_'")
        if not name:
            raise EngineSpecError(f"serve_args: empty option name {key!r}")
        if name in seen:
            raise EngineSpecError(f"serve_args: {seen[name]!r} and {key!r} are the same option")
        seen[name] = key
        if name in CONTROLLED_OPTIONS:
            raise EngineSpecError(
                f"serve_args: option {key!r} is set by the module itself "
                f"(use the module's own argument, not serve_args)"
            )
        flag = "--" + name
        if value is None:
            continue
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + name)
        elif isinstance(value, (list, tuple)):
            if not value:
                raise EngineSpecError(f"serve_args: option {key!r} is an empty list")
            argv.append(flag)
            argv.extend(_scalar(v, key) for v in value)
        elif isinstance(value, dict):
            argv.extend([flag, _scalar(value, key)])
        else:
            argv.extend([flag, _scalar(value, key)])
    return argv


_OPTION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")


def _scalar(value: t.Any, key: str) -> str:
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise EngineSpecError(f"serve_args.{key}: cannot be written as JSON: {exc}") from None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        raise EngineSpecError(f"serve_args: option {key!r} has a non-finite value")
    try:
        word = v_text(value, f"serve_args.{key}", allow_empty=True)
    except ValidationError as exc:
        raise EngineSpecError(str(exc)) from None
    if word.startswith("--"):
        # vLLM's argument parser would take it for an option of its own (--port, --api-key)
        raise EngineSpecError(f"serve_args.{key}: a value must not start with '--', got {word[:40]!r}")
    return word


def build_argv(
    executable: str,
    model: str,
    *,
    mode: str,
    port: int,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    serve_args: t.Mapping[str, t.Any] | None = None,
    host: str = LOOPBACK,
) -> list[str]:
    """The full ``vllm serve`` argv of one canary boot."""
    if mode not in ("profiled", "manual"):
        raise EngineSpecError(f"mode must be 'profiled' or 'manual', not {mode!r}")
    if not executable:
        raise EngineSpecError("executable is required")
    if not model:
        raise EngineSpecError("model is required")
    try:
        v_text(executable, "executable")
        v_text(model, "model")
        v_text(host, "host")
    except ValidationError as exc:
        raise EngineSpecError(str(exc)) from None
    if str(model).startswith("-"):
        raise EngineSpecError(f"model: must not start with '-' (vLLM would read it as an option), got {str(model)[:40]!r}")
    try:
        port = valid_port(port)
    except ValidationError as exc:
        raise EngineSpecError(str(exc)) from None
    argv = [str(executable), "serve", str(model), "--host", host, "--port", str(port)]
    if mode == "manual" and kv_cache_memory_bytes is None:
        raise EngineSpecError("mode=manual needs kv_cache_memory_bytes")
    if mode != "manual" and kv_cache_memory_bytes is not None:
        raise EngineSpecError("kv_cache_memory_bytes is only valid with mode=manual")
    argv += budget_args(kv_cache_memory_bytes, gpu_memory_utilization)
    argv += render_serve_args(serve_args)
    return argv


def budget_args(kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None) -> list[str]:
    """The budget options of ``vllm serve``, for a canary and for a unit (a launch record's figures):
    the byte budget when there is one, and the startup utilization when there is one."""
    args = []
    if kv_cache_memory_bytes is not None:
        if int(kv_cache_memory_bytes) <= 0:
            raise EngineSpecError(
                f"kv_cache_memory_bytes must be positive (vLLM treats {kv_cache_memory_bytes} as unset)"
            )
        args += ["--kv-cache-memory-bytes", str(int(kv_cache_memory_bytes))]
    if gpu_memory_utilization is not None:
        try:
            util = number(gpu_memory_utilization, "gpu_memory_utilization", low=0, high=1, low_open=True)
        except ValidationError as exc:
            raise EngineSpecError(f"{exc} (must be in (0, 1])") from None
        args += ["--gpu-memory-utilization", repr(util)]
    return args


def engine_env(
    extra: t.Mapping[str, t.Any] | None,
    *,
    mode: str,
    cuda_visible_devices: str | None = None,
    base: t.Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Child environment: inherited + ``extra`` (+ ``CUDA_VISIBLE_DEVICES``).

    In manual mode a variable that silently replaces the byte budget is refused
    when given explicitly and dropped when merely inherited.
    """
    env = dict(os.environ if base is None else base)
    extra = dict(extra or {})
    if mode == "manual":
        for name in BUDGET_OVERRIDING_ENV:
            if name in extra:
                raise EngineSpecError(
                    f"env: {name} overrides --kv-cache-memory-bytes silently; "
                    "it cannot be used with mode=manual"
                )
            env.pop(name, None)
    for key, value in extra.items():
        try:
            name = env_name(key, "env")
        except ValidationError as exc:
            raise EngineSpecError(str(exc)) from None
        if isinstance(value, str) and "\0" in value:
            raise EngineSpecError(f"env.{name}: must not contain a NUL character")
        env[name] = "" if value is None else str(value)
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(cuda_visible_devices)
    return env


def redact_argv(argv: t.Sequence[str]) -> list[str]:
    """argv with the value of every secret-looking option replaced."""
    out: list[str] = []
    hide_next = False
    for word in argv:
        if hide_next:
            out.append("********")
            hide_next = False
            continue
        if word.startswith("--") and is_secret_option(word):
            if "=" in word:
                out.append(word.split("=", 1)[0] + "=********")
                continue
            hide_next = True
        out.append(word)
    return out


def api_key_of(serve_args: t.Mapping[str, t.Any] | None, env: t.Mapping[str, t.Any] | None) -> str | None:
    """The API key the engine will demand on ``/v1`` routes, if any."""
    for key, value in (serve_args or {}).items():
        if option_name(key) == "api-key" and value:
            return str(value[0] if isinstance(value, (list, tuple)) else value)
    value = (env or {}).get("VLLM_API_KEY")
    return str(value) if value else None


def without_api_key(serve_args: t.Mapping[str, t.Any] | None) -> dict[str, t.Any]:
    """serve_args less ``api_key``: the canary hands the key over in ``VLLM_API_KEY`` (never in argv)."""
    return {k: v for k, v in (serve_args or {}).items() if option_name(k) != "api-key"}
