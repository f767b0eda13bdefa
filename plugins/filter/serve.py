# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters: vllm_serve_argv, vllm_secret_options (documentation in the YAML files beside this one)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.module_utils._vllm_engine import (
    _SECRET_WORDS,
    EngineSpecError,
    option_name,
    render_serve_args,
)


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise AnsibleFilterError(f"{name}: expected a mapping of vllm serve options, got {type(value).__name__}")
    return value


def vllm_serve_argv(serve_args: Any) -> list[str]:
    """``{'max_model_len': 4096, 'enable_prefix_caching': False}`` -> ``['--enable-prefix-caching'...]`` words."""
    try:
        return render_serve_args(_mapping(serve_args, "vllm_serve_argv"))
    except EngineSpecError as exc:
        raise AnsibleFilterError(f"vllm_serve_argv: {exc}") from None


def _names_a_secret(key: str) -> bool:
    """``api_key``, ``hf_token``, ``ssl_keyfile_password``: the last word of the option is a secret word.

    The canary's redaction matches the secret words anywhere in the name, which also
    catches ``max_num_batched_tokens`` or ``tokenizer``: harmless when hiding a value,
    wrong when refusing an option, so only the last word counts here.
    """
    last = option_name(key).lower().rsplit("-", 1)[-1]
    return last in _SECRET_WORDS or (last.endswith("s") and last[:-1] == "credential")


def vllm_secret_options(serve_args: Any) -> list[str]:
    """The keys of ``serve_args`` that name a secret (api_key, hf_token, ...), sorted."""
    return sorted(str(key) for key in _mapping(serve_args, "vllm_secret_options") if _names_a_secret(str(key)))


class FilterModule:
    """gpufleet.vllm vllm serve option filters."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {
            "vllm_serve_argv": vllm_serve_argv,
            "vllm_secret_options": vllm_secret_options,
        }
