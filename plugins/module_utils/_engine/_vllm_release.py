# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vLLM releases the capacity model knows, and the rules that differ between them.

Plain Python, no Ansible import, no vLLM import. The planner, the boot gate and the
canary's comparisons take the runtime's vLLM version (the compatibility key's
``vllm_version``) and apply that release's rules (:func:`release_rules`). A version
newer than the newest release known here is planned with the newest release's rules,
and the rules' ``notes`` say so; an unknown version is planned the same way.

``docs/model-families.md`` has the supported-versions table: per release, what
changed and how the collection follows it. ``SUPPORTED_WHEELS`` is the list the
oracle matrix of ``make test`` imports vLLM's own planning code from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RELEASES", "SUPPORTED_WHEELS", "ReleaseRules", "parse_version", "release_rules"]

# The wheel of each supported release that the oracle matrix reads (tests/engine/prepare-vllm-sources.sh).
SUPPORTED_WHEELS: tuple[str, ...] = ("0.32.0", "0.33.0", "0.34.0")


@dataclass(frozen=True)
class ReleaseRules:
    """What differs between vLLM releases in the figures the collection predicts or parses.

    ``release`` is the minor series whose rules apply (``"0.33"``); ``version`` the
    version the runtime reported (None when unknown); ``notes`` say when the rules
    are not the version's own (newer than known, unknown, older than known).
    """

    release: str
    version: str | None
    # --mamba-cache-mode is read (0.32); from 0.33 it is ignored and the mode follows prefix caching
    mamba_cache_mode_flag: bool
    # GDN layers keep one prefill checkpoint block per request and the attention block is a
    # multiple of 64 when vLLM picks the FlashInfer GDN prefill kernel (0.33+)
    gdn_flashinfer_prefill: bool
    # an explicit float16/bfloat16 kv_cache_dtype other than the model's dtype is refused at startup (0.33+)
    refuses_half_kv_dtype_mismatch: bool
    # the CPU build checks the NUMA node's available memory against the utilization at startup (0.32)
    cpu_startup_check: bool
    # CacheConfig.DEFAULT_BLOCK_SIZE: what CUDA attention backends keep when no block size is given (64 from 0.34)
    cuda_default_block: int
    # a profiled CUDA engine sizes its KV cache after warmup and skips the startup free-memory check (0.34, unless
    # --kv-cache-memory-bytes is given: the fixed budgets the collection deploys never use it)
    extensible_kv_cache: bool
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        return {"release": self.release, "version": self.version, "notes": list(self.notes)}


_RULES: dict[str, dict[str, Any]] = {
    "0.32": {"mamba_cache_mode_flag": True, "gdn_flashinfer_prefill": False, "refuses_half_kv_dtype_mismatch": False,
             "cpu_startup_check": True, "cuda_default_block": 16, "extensible_kv_cache": False},
    "0.33": {"mamba_cache_mode_flag": False, "gdn_flashinfer_prefill": True, "refuses_half_kv_dtype_mismatch": True,
             "cpu_startup_check": False, "cuda_default_block": 16, "extensible_kv_cache": False},
    "0.34": {"mamba_cache_mode_flag": False, "gdn_flashinfer_prefill": True, "refuses_half_kv_dtype_mismatch": True,
             "cpu_startup_check": False, "cuda_default_block": 64, "extensible_kv_cache": True},
}
RELEASES: tuple[str, ...] = tuple(sorted(_RULES, key=lambda r: tuple(int(p) for p in r.split("."))))

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(version: object) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a vLLM version string (``0.33.0``, ``0.32.0+cpu``, ``0.34.0rc1``); None if unreadable."""
    if not isinstance(version, str):
        return None
    match = _VERSION.match(version)
    if not match:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def release_rules(version: object) -> ReleaseRules:
    """The rules for a runtime's vLLM ``version``; the newest known release's (with a note) when it is newer or unknown."""
    parsed = parse_version(version)
    newest, oldest = RELEASES[-1], RELEASES[0]
    text = version if isinstance(version, str) and version.strip() else None
    if parsed is None:
        note = (f"vLLM version {text!r} is not readable" if text else "the runtime's vLLM version is not known") + (
            f": planned with vLLM {newest}'s rules, the newest release this collection knows"
        )
        return ReleaseRules(newest, text, notes=(note,), **_RULES[newest])
    series = f"{parsed[0]}.{parsed[1]}"
    if series in _RULES:
        return ReleaseRules(series, text, **_RULES[series])
    key = (parsed[0], parsed[1])
    if key > tuple(int(p) for p in newest.split(".")):
        note = f"vLLM {text} is newer than {newest}, the newest release this collection knows: planned with {newest}'s rules"
        return ReleaseRules(newest, text, notes=(note,), **_RULES[newest])
    note = f"vLLM {text} is older than {oldest}, the oldest release this collection models: planned with {oldest}'s rules"
    return ReleaseRules(oldest, text, notes=(note,), **_RULES[oldest])
