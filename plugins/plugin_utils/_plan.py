# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Class planner behind ``gpufleet.vllm.kv_plan``.

Plain Python, no Ansible import. One call plans one host class.

Symbols (per rank ``r`` of the reference profile):

* ``F_ref`` NVML free bytes just before the profiled boot, ``B_ref`` vLLM's
  "fit into requested memory" suggestion, ``G`` the guard;
* ``F_boot`` the free bytes a host rank will see at boot (NVML, plus what this
  host's own vLLM holds: ``boot_free_bytes``).

Rules:

1. drift: ``B_adj = B_ref - max(0, F_ref - F_boot) - G``; never above ``B_ref - G``
   (more free memory than the reference is *headroom*, usable only after a
   re-profile; decision ``reprofile`` when every rank has at least
   ``reprofile_headroom`` of it);
2. ``B_launch = min(B_adj)`` over all ranks of all hosts, recorded with its host/rank;
3. the deployed budget ``D`` is ``B_launch`` (``max_safe``) or the whole
   blocks the admission plan needs plus ``fit_headroom`` (``fit_admission``,
   never above ``B_launch``);
4. free floor per reference rank: ``F_floor = F_ref - (B_ref - G - D)``; a
   boot is safe while ``F_boot >= F_floor``;
5. startup utilization, see :func:`startup_utilization`;
6. blocks/tokens/concurrency from the KV geometry (or the engine's measured
   figures scaled by bytes for models whose geometry is unpredictable);
7. decision, first that applies: ``refuse`` > ``auto_profile`` > ``split`` >
   ``reprofile`` > ``deploy``, each with reasons.

The input types and their parsing live in ``_plan_inputs``, the KV capacity model in
``_plan_capacity``; this module holds the planner's stages and the public API.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import GIB_ROUNDING_BYTES
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._geometry import KVGeometry
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._kv_capacity import floor_utilization, one_request_blocks, profiled_utilization_cap
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._kv_layout import KVLayout
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import deployed as launch_deployed, from_plan as launch_from_plan
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import human_bytes
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError, boolean, number as valid_number
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan_capacity import Capacity, class_capacity, geometry_family, reference_geometry, what_if_fp8
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan_inputs import (
    Host,
    PlanError,
    Reference,
    RefRank,
    admission_need,
    parse_hosts,
    parse_reference,
    size,
)

__all__ = ["DECISIONS", "DEFAULTS", "SPLIT_POLICIES", "UNSTABLE_SCOPES", "PlanError", "host_plan", "keep_deployed", "plan_class",
           "plan_deployable", "round_budget", "startup_utilization"]

GIB = 1024**3
MIB = 1024**2

DECISIONS = ("deploy", "reprofile", "split", "auto_profile", "refuse")
# What a split decision does: per_host gives each group of hosts its own plan (the outliers the weakest
# rank's budget, the others their own), warn deploys the weakest rank's budget on every host, fail stops
# the class.
SPLIT_POLICIES = ("per_host", "warn", "fail")
# Which hosts an unsteady rank sends to vLLM's own profiling (auto_profile): its host alone (the other
# hosts are planned without it) or the whole class.
UNSTABLE_SCOPES = ("host", "class")

# plan_class's own defaults: the collection's (module_utils/_defaults.py), except the budget settling
# (round_budget and keep_deployed), off unless asked for, so that plan_class alone gives the protocol's exact
# formulas; the kv_plan action, the role and the playbooks ask for the table's margin, granule and keep step.
DEFAULTS: dict[str, Any] = {
    **{key: default(key) for key in ("guard_bytes", "budget_mode", "fit_headroom", "max_capacity_loss", "unstable_share",
                                     "cuda_context_bytes")},
    # None: 10 % of the smallest reference suggestion B_ref
    "reprofile_headroom": None,
    "gate_margin_bytes": 0,
    "budget_granularity_bytes": 0,
    "keep_step_bytes": 0,
}


_LIST_LIMIT = 10

_BUG_HINT = (
    "known vLLM bugs: CUDA-graph memory counted twice (vLLM issue 57936) and graph memory "
    "extrapolated from two sampled graphs (45178); re-profile (e.g. with enforce_eager or fewer "
    "capture sizes) or record a corrected reference"
)


def _names(items: list[str]) -> str:
    shown = ", ".join(str(i) for i in items[:_LIST_LIMIT])
    more = len(items) - _LIST_LIMIT
    return shown + (f" and {more} more" if more > 0 else "")


def _hb(n: int | None) -> str | None:
    return None if n is None else human_bytes(int(n))


def _number(spec: Mapping[str, Any], key: str, low: float, high: float | None, low_open: bool = False) -> float:
    value = spec.get(key)
    if value is None:
        value = DEFAULTS[key]
    try:
        return valid_number(value, key, low=low, high=high, low_open=low_open, high_open=True)
    except ValidationError as exc:
        raise PlanError(str(exc)) from None


def startup_utilization(
    ranks: Sequence[RefRank],
    total_bytes: int,
    budget: int,
    guard: int,
    vllm_free: Mapping[int, int] | None,
    cuda_context_bytes: int,
) -> tuple[float, str, dict[int, int]]:
    """``--gpu-memory-utilization`` for a unit with a manual budget.

    vLLM still runs its startup check ``free >= ceil(total * utilization)``,
    where ``free`` is *vLLM's own* figure, measured after its CUDA context is
    up and lower than NVML's. At a boot exactly on the floor, NVML free memory
    is ``F_ref - (B_ref - G - D)``: it moved by ``B_ref - G - D`` from the
    reference, and vLLM's figure moves by the same amount. So per rank::

        vllm_floor = vllm_free_ref - (B_ref - G - D) - log_rounding
        utilization = floor4(min(vllm_floor) / total)

    ``log_rounding`` (0.005 GiB) covers vLLM logging its free memory with two
    decimals of GiB. ``floor4`` rounds down to 4 decimals and steps down until
    ``ceil(total * u) <= vllm_floor``, so the check passes at the floor.

    Without vLLM's figures for every rank, the NVML floor minus
    ``cuda_context_bytes`` stands in for ``vllm_floor`` (source ``nvml``).
    Returns ``(utilization, source, {rank: vllm_floor_bytes})``.
    """
    vllm_figures: Mapping[int, int] = vllm_free or {}
    use_vllm = bool(vllm_figures) and all(r["rank"] in vllm_figures for r in ranks)
    floors: dict[int, int] = {}
    for r in ranks:
        shift = r["kv_bytes"] - guard - budget
        if use_vllm:
            floors[r["rank"]] = vllm_figures[r["rank"]] - shift - GIB_ROUNDING_BYTES
        else:
            floors[r["rank"]] = r["free_bytes"] - shift - cuda_context_bytes
    lowest = min(floors.values())
    return floor_utilization(lowest, total_bytes), ("vllm" if use_vllm else "nvml"), floors


# ---------------------------------------------------------------- settling the budget (no churn)
def round_budget(max_safe_bytes: int, bytes_per_block: int | None, granularity_bytes: int, margin_bytes: int) -> int:
    """The budget a class deploys from its max safe bytes: ``max_safe - margin``, rounded down to a
    multiple of ``granularity_bytes`` and then to whole KV blocks.

    What the margin and the rounding take off the budget is what the weakest rank keeps above its
    free floor at planning time: a few MiB less free memory at the gate still passes it. A budget
    smaller than one granule is rounded to whole blocks only (small GPUs, the CPU build). With
    neither a margin nor a granule the max safe bytes are returned as they are.
    """
    budget = max(0, max_safe_bytes) - max(0, margin_bytes)
    if budget <= 0:
        return 0
    if granularity_bytes <= 0 and margin_bytes <= 0:
        # settling off: the exact formula (vLLM still makes whole blocks of it)
        return budget
    if granularity_bytes > 0 and budget >= granularity_bytes:
        budget -= budget % granularity_bytes
    if bytes_per_block:
        budget -= budget % bytes_per_block
    return budget


def keep_deployed(
    planned_bytes: int,
    safe_bytes: int,
    deployed: Mapping[str, Any] | None,
    key_hash: str | None,
    keep_step_bytes: int,
    blocks_of: Any,
    need_blocks: int | None,
) -> tuple[int, bool, str]:
    """Keep the budget the class runs now instead of the freshly planned one, when that is safe.

    ``deployed`` is the plan file of the class's canary host (any format, ``_launch.deployed``);
    ``safe_bytes`` the most this plan allows (max safe less the gate margin);
    ``blocks_of`` gives the blocks of a budget; ``need_blocks`` the blocks the admission plan (or
    one ``max_model_len`` request) needs. The deployed budget is kept when its key is this plan's,
    it is still safe, it still holds ``need_blocks`` and it is within ``keep_step_bytes`` of the
    planned budget: a few MiB of drift then restarts nothing. Returns ``(budget, kept, reason)``.
    """
    if keep_step_bytes <= 0:
        return planned_bytes, False, "keeping a deployed budget is off (keep step 0)"
    deployed = launch_deployed(deployed)
    if not deployed:
        return planned_bytes, False, "no budget deployed yet on the canary host"
    raw = deployed.get("kv_cache_memory_bytes")
    if raw in (None, "", 0) or deployed.get("decision") == "auto_profile":
        return planned_bytes, False, "the canary host runs no manual budget"
    current = size(raw, "deployed.kv_cache_memory_bytes")
    deployed_key = deployed.get("compat_key_hash") or None
    if not key_hash or deployed_key != key_hash:
        return planned_bytes, False, f"the deployed budget {human_bytes(current)} was planned for another compatibility key"
    if current == planned_bytes:
        return planned_bytes, True, f"the deployed budget {human_bytes(current)} is the planned one"
    if current > safe_bytes:
        return planned_bytes, False, (
            f"the deployed budget {human_bytes(current)} is no longer safe (at most {human_bytes(max(0, safe_bytes))} "
            "with the gate margin): the new budget is deployed")
    if need_blocks is not None and blocks_of(current) < need_blocks:
        return planned_bytes, False, (
            f"the deployed budget {human_bytes(current)} ({blocks_of(current)} blocks) no longer holds the "
            f"{need_blocks} blocks the admission plan needs: the new budget is deployed")
    step = abs(planned_bytes - current)
    if step > keep_step_bytes:
        return planned_bytes, False, (
            f"the planned budget {human_bytes(planned_bytes)} differs from the deployed {human_bytes(current)} by "
            f"{human_bytes(step)}, more than the keep step {human_bytes(keep_step_bytes)}: the new budget is deployed")
    return current, True, (
        f"the deployed budget {human_bytes(current)} is kept (no canary, no restart): still safe, it holds the admission "
        f"plan and differs from the planned {human_bytes(planned_bytes)} by {human_bytes(step)}, within the keep step "
        f"{human_bytes(keep_step_bytes)}")


# ---------------------------------------------------------------- the planner
def _auto_profile_utilization(result: dict[str, Any], reasons: list[str], lowest_seen: tuple[int, str, int] | None,
                              total: int | None, guard: int, cuda_ctx: int,
                              label: Callable[[str, int], str] = lambda host, rank: f"host {host} rank {rank}") -> None:
    """The utilization an ``auto_profile`` class runs with: vLLM's startup check must pass at the
    lowest free memory seen on any rank (this probe's samples and the recent probes), less the
    guard and the CUDA-context allowance (vLLM measures after its context is up)."""
    if lowest_seen is None or not total:
        result["gpu_memory_utilization"] = None
        result["utilization_source"] = None
        reasons.append("auto_profile: no GPU total memory known, the unit's default utilization applies")
        return
    low, host, rank = lowest_seen
    util = floor_utilization(low - guard - cuda_ctx, total)
    result["gpu_memory_utilization"] = util if util > 0 else None
    result["utilization_source"] = "lowest_free" if util > 0 else None
    if util > 0:
        reasons.append(
            f"auto_profile: --gpu-memory-utilization {util} from the lowest free memory seen, {human_bytes(low)} on "
            f"{label(host, rank)}, minus the guard {human_bytes(guard)} and a {human_bytes(cuda_ctx)} CUDA-context allowance"
        )
    else:
        reasons.append(f"auto_profile: the lowest free memory seen ({human_bytes(low)} on {label(host, rank)}) leaves no "
                       "utilization after the guard and the CUDA-context allowance; the unit's default utilization applies")


def _empty_result(host_class: str, budget_mode: str) -> dict[str, Any]:
    return {
        "host_class": host_class,
        "decision": "refuse",
        "reasons": [],
        "budget_mode": budget_mode,
        "kv_cache_memory_bytes": None,
        "max_safe_bytes": None,
        "free_floor_bytes": {},
        "gpu_memory_utilization": None,
        "utilization_source": None,
        "vllm_floor_bytes": {},
        "block_size": None,
        "bytes_per_block": None,
        "bytes_per_token": None,
        "num_blocks": None,
        "kv_cache_tokens": None,
        "max_concurrency": None,
        "max_concurrency_vllm": None,
        "blocks_per_request": None,
        "kv_layout": None,
        "capacity_source": None,
        "one_request_bytes": None,
        "per_rank": [],
        "weakest": None,
        "split": [],
        "capacity": None,
        "kv_capacity": None,
        "profile_max_utilization": None,
        "unstable": [],
        "admission": None,
        "fit": None,
        "what_if_fp8": None,
        "headroom": None,
        "guard_bytes": None,
        "host_count": 0,
        "rank_count": 0,
        "boot_seconds": None,
        "human": {},
    }


@dataclass
class _Inputs:
    """The checked ``kv_plan`` input of one class."""

    spec: Mapping[str, Any]
    host_class: str
    budget_mode: str
    guard: int
    fit_headroom: float
    max_loss: float
    unstable_share: float
    cuda_ctx: int
    max_model_len: int | None
    ref: Reference | None
    hosts: dict[str, Host]


@dataclass
class _Drift:
    """What the drift stage found: the weakest rank and what every rank keeps."""

    launch: int
    weakest: tuple[str, int]
    host_min: dict[str, int]
    rows: list[tuple[str, int, int, int, int, bool, int | None]]
    min_headroom: int | None
    max_headroom: int
    headroom_ranks: int
    unstable: list[dict[str, Any]]
    lowest_seen: tuple[int, str, int] | None
    share_limit: float


@dataclass
class _Planning:
    """One class's planning as it goes: the inputs, what each stage found, the result being built.
    ``refuse`` collects what makes the class unplannable; ``reasons`` is the result's own list."""

    inputs: _Inputs
    ref: Reference
    result: dict[str, Any]
    refuse: list[str] = field(default_factory=list)
    geo: KVGeometry | KVLayout | None = None
    cap: Capacity | None = None
    cap_why: str | None = None
    totals: dict[str, Any] = field(default_factory=dict)
    drift: _Drift | None = None
    need: tuple[int, int] | None = None
    one_req_blocks: int | None = None
    margin: int = 0
    granularity: int = 0
    safe_budget: int = 0
    budget: int = 0
    floors: dict[int, int] = field(default_factory=dict)
    total: int | None = None
    num_blocks: int | None = None
    reprofile: bool = False
    split_groups: list[dict[str, Any]] = field(default_factory=list)
    unstable_reason: str = ""
    # (member, rank) -> the card a rank entry names: its GPU and, on an instance over several hosts, its host
    cards: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)

    def rank_label(self, name: str, rank: int) -> str:
        """``host NAME rank R``, and the host the rank runs on where that is another (a gang's rank on a follower)."""
        on = self.cards.get((name, rank), {}).get("member")
        return f"host {name} rank {rank}" + (f" (on {on})" if on and not name.startswith(f"{on}/") else "")

    @property
    def reasons(self) -> list[str]:
        reasons: list[str] = self.result["reasons"]
        return reasons


def _read_inputs(spec: Mapping[str, Any]) -> _Inputs:
    if not isinstance(spec, Mapping):
        raise PlanError("plan input must be a mapping")
    host_class = str(spec.get("host_class") or "class")
    budget_mode = spec.get("budget_mode") or DEFAULTS["budget_mode"]
    if budget_mode not in ("max_safe", "fit_admission"):
        raise PlanError(f"budget_mode: expected max_safe or fit_admission, got {budget_mode!r}")
    guard = size(spec["guard_bytes"] if spec.get("guard_bytes") is not None else DEFAULTS["guard_bytes"], "guard_bytes")
    fit_headroom = _number(spec, "fit_headroom", 0.0, None)
    max_loss = _number(spec, "max_capacity_loss", 0.0, 1.0)
    unstable_share = _number(spec, "unstable_share", 0.0, None, low_open=True)
    cuda_ctx = size(spec["cuda_context_bytes"] if spec.get("cuda_context_bytes") is not None else DEFAULTS["cuda_context_bytes"], "cuda_context_bytes")
    max_model_len = spec.get("max_model_len")
    ref = parse_reference(spec.get("reference"))
    if max_model_len is None and ref and isinstance(ref.get("geometry"), Mapping):
        max_model_len = (ref["geometry"].get("serve_args") or {}).get("max_model_len")
    if max_model_len is not None:
        max_model_len = size(max_model_len, "max_model_len")
        if max_model_len <= 0:
            raise PlanError("max_model_len must be positive")
    hosts = parse_hosts(spec.get("hosts"))
    return _Inputs(spec, host_class, budget_mode, guard, fit_headroom, max_loss, unstable_share, cuda_ctx,
                   max_model_len, ref, hosts)


def _settle_reference_kv(p: _Planning) -> None:
    """The capacity model, then B_ref of a reference without vLLM's suggestion: the bytes its blocks hold."""
    ref, reasons = p.ref, p.reasons
    geo, geo_why = reference_geometry(ref, reasons)
    p.geo = geo
    p.cap, p.cap_why = class_capacity(ref, geo, geo_why, p.inputs.max_model_len, reasons)
    in_use = [r for r in ref["ranks"] if r["kv_source"] == "in_use"]
    cap_bpb = p.cap.bytes_per_block if p.cap is not None else None
    ref_blocks = ref.get("num_blocks")
    for r in in_use:
        blocks_bytes = ref_blocks * cap_bpb if cap_bpb and ref_blocks else None
        if blocks_bytes is not None and blocks_bytes <= r["kv_bytes"] + GIB_ROUNDING_BYTES:
            # the blocks the engine made hold exactly these bytes; the logged figure is rounded to 0.01 GiB
            r["kv_bytes"] = blocks_bytes
        elif ref.get("engine_kv_bytes") is None:
            if blocks_bytes is not None:
                reasons.append(
                    f"the engine's {ref_blocks} blocks of {cap_bpb} bytes exceed the KV memory it logged "
                    f"({human_bytes(r['kv_bytes'])}): the logged figure less its rounding is used"
                )
            r["kv_bytes"] -= GIB_ROUNDING_BYTES
    if in_use:
        reasons.append(
            "B_ref is the KV memory the profiled canary's engine allocated (this build logs no 'fit into requested memory' "
            "suggestion): " + ", ".join(f"rank {r['rank']}: {human_bytes(r['kv_bytes'])}" for r in in_use[:8])
        )


def _check_reference_suggestions(p: _Planning) -> None:
    """Suggestions vLLM got wrong make the reference unusable."""
    refuse = p.refuse
    for r in p.ref["ranks"]:
        if r["kv_bytes"] <= 0 and r["kv_source"] == "in_use":
            refuse.append(f"reference rank {r['rank']}: the engine allocated no KV memory ({r['kv_bytes']} bytes): re-profile")
        elif r["kv_bytes"] <= 0:
            refuse.append(f"reference rank {r['rank']}: vLLM's suggested KV bytes {r['kv_bytes']} are not positive ({_BUG_HINT})")
        full = r.get("kv_bytes_full")
        if full is not None and full <= 0:
            refuse.append(f"reference rank {r['rank']}: vLLM's 'fully utilize' suggestion {full} is not positive ({_BUG_HINT})")
        elif full is not None and r["kv_bytes"] > full:
            refuse.append(
                f"reference rank {r['rank']}: the 'fit into requested memory' suggestion {r['kv_bytes']} exceeds the "
                f"'fully utilize' one {full}, which cannot be ({_BUG_HINT})"
            )
        if r["kv_bytes"] > r["free_bytes"]:
            refuse.append(f"reference rank {r['rank']}: suggested KV bytes {r['kv_bytes']} exceed the free memory {r['free_bytes']} it was measured with")


def _check_rank_layout(p: _Planning) -> None:
    """Every host has the reference's ranks, no more, no fewer."""
    ref_ranks = {r["rank"] for r in p.ref["ranks"]}
    missing_hosts: list[str] = []
    for name, host in p.inputs.hosts.items():
        seen = [r[0] for r in host["ranks"]]
        host_ranks = set(seen)
        if len(seen) != len(host_ranks):
            raise PlanError(f"hosts.{name}: a rank appears twice")
        if host_ranks != ref_ranks:
            extra = sorted(host_ranks - ref_ranks)
            lack = sorted(ref_ranks - host_ranks)
            bits = []
            if extra:
                bits.append(f"ranks {extra} have no reference rank")
            if lack:
                bits.append(f"reference ranks {lack} are missing")
            missing_hosts.append(f"{name} ({'; '.join(bits)})")
    if missing_hosts:
        p.refuse.append(
            f"rank layout differs from the reference ({len(ref_ranks)} ranks {sorted(ref_ranks)}): {_names(missing_hosts)}; "
            "plan such hosts in their own class with their own reference"
        )


def _check_uniform_class(p: _Planning) -> None:
    """One GPU model, one memory size and one compatibility key across the class and its reference."""
    ref, refuse, host_class = p.ref, p.refuse, p.inputs.host_class

    def mixed(label: str, ref_value: Any, per_host: dict[str, Any]) -> None:
        groups: dict[str, list[str]] = {}
        for host_name, value in per_host.items():
            if value is not None:
                groups.setdefault(str(value), []).append(host_name)
        if ref_value is not None and groups and set(groups) != {str(ref_value)}:
            other = {v: h for v, h in groups.items() if v != str(ref_value)}
            text = "; ".join(f"{v}: {_names(h)}" for v, h in sorted(other.items()))
            refuse.append(f"{label} differs from the reference ({ref_value}): {text}; profile these hosts separately")
        elif len(groups) > 1:
            text = "; ".join(f"{v}: {_names(h)}" for v, h in sorted(groups.items()))
            refuse.append(f"mixed {label} within class {host_class}: {text}; split the class by {label}")

    names: dict[str, Any] = {}
    totals: dict[str, Any] = {}
    for name, host in p.inputs.hosts.items():
        rank_names = {r[4] for r in host["ranks"] if r[4] is not None}
        rank_totals = {size(r[5], f"hosts.{name} rank {r[0]} total_bytes") for r in host["ranks"] if r[5] is not None}
        if host["gpu_name"] is not None:
            rank_names.add(host["gpu_name"])
        if host["total_bytes"] is not None:
            rank_totals.add(size(host["total_bytes"], f"hosts.{name}.total_bytes"))
        if len(rank_names) > 1:
            refuse.append(f"host {name} mixes GPU models {sorted(rank_names)} in one engine")
        if len(rank_totals) > 1:
            refuse.append(f"host {name} mixes GPU memory sizes {sorted(rank_totals)} in one engine")
        names[name] = next(iter(rank_names)) if len(rank_names) == 1 else None
        totals[name] = next(iter(rank_totals)) if len(rank_totals) == 1 else None
    mixed("GPU name", ref.get("gpu_name"), names)
    ref_total = ref.get("total_bytes")
    if ref_total is not None and all(v is None or abs(v - ref_total) <= 2 * GIB_ROUNDING_BYTES for v in totals.values()):
        # a reference total taken from vLLM's log is rounded to 0.01 GiB: NVML's exact figure matches it
        ref_total = None
    mixed("GPU total memory", ref_total, totals)
    mixed("compatibility key hash", ref.get("key_hash"), {n: h["key_hash"] for n, h in p.inputs.hosts.items()})
    p.totals = totals


def _weakest_rank(p: _Planning) -> _Drift | None:
    """Per rank: the drift from the reference's free memory, B_ref less the drift and the guard; the
    lowest of those sets the class's max safe budget. None when no host rank has a reference rank."""
    inp = p.inputs
    ref_by_rank = {r["rank"]: r for r in p.ref["ranks"]}
    launch: int | None = None
    weakest: tuple[str, int] | None = None
    host_min: dict[str, int] = {}
    rows: list[tuple[str, int, int, int, int, bool, int | None]] = []
    min_headroom: int | None = None
    max_headroom = 0
    headroom_ranks = 0
    unstable: list[dict[str, Any]] = []
    lowest_seen: tuple[int, str, int] | None = None
    share_limit = inp.unstable_share * inp.guard
    for name, host in inp.hosts.items():
        hmin: int | None = None
        for rank, free, fmin, fmax, _gname, _total, r_unstable, moved, seen_low in host["ranks"]:
            reference = ref_by_rank.get(rank)
            if reference is None:
                continue
            drift = reference["free_bytes"] - free
            adjusted = reference["kv_bytes"] - (drift if drift > 0 else 0) - inp.guard
            head = -drift if drift < 0 else 0
            spread = None if fmin is None or fmax is None else fmax - fmin
            moved_too_far = moved is not None and moved > share_limit
            is_unstable = r_unstable or (spread is not None and spread > share_limit) or moved_too_far
            rows.append((name, rank, free, drift, adjusted, is_unstable, spread))
            if is_unstable:
                unstable.append({"host": name, "rank": rank, "spread_bytes": spread, "flagged": r_unstable,
                                 "moved_bytes": moved if moved_too_far else None})
            # the lowest boot-free memory seen on this rank: boot_free_bytes already comes from this
            # probe's lowest sample (free_min_bytes is raw free, without this host's running engine)
            low = free if seen_low is None else min(free, seen_low)
            if lowest_seen is None or low < lowest_seen[0]:
                lowest_seen = (low, name, rank)
            if head:
                headroom_ranks += 1
                if head > max_headroom:
                    max_headroom = head
            if min_headroom is None or head < min_headroom:
                min_headroom = head
            if hmin is None or adjusted < hmin:
                hmin = adjusted
            if launch is None or adjusted < launch:
                launch, weakest = adjusted, (name, rank)
        if hmin is not None:
            host_min[name] = hmin
        if host["unstable"]:
            unstable.append({"host": name, "rank": None, "spread_bytes": None, "flagged": True, "moved_bytes": None})
    if launch is None or weakest is None:
        return None
    return _Drift(launch, weakest, host_min, rows, min_headroom, max_headroom, headroom_ranks, unstable, lowest_seen,
                  share_limit)


def _admission_blocks(p: _Planning) -> Any:
    """The block geometry of the result and the blocks the admission plan needs; returns the admission spec."""
    inp, cap, geo, result = p.inputs, p.cap, p.geo, p.result
    block_size = cap.block_size if cap else p.ref["block_size"]
    result["block_size"] = block_size
    result["bytes_per_block"] = cap.bytes_per_block if cap else None
    result["bytes_per_token"] = geo.bytes_per_token if isinstance(geo, KVGeometry) and cap and cap.source == "geometry" else None
    result["kv_layout"] = (
        cap.layout.as_dict() if cap and cap.layout else ({"family": geometry_family(p.ref, geo)} if cap and cap.geometry else None)
    )
    adm = admission_need(inp.spec.get("admission"))
    need = cap.admission_blocks(adm, inp.max_model_len) if cap and adm else None
    if cap and adm and need is None:
        p.reasons.append("admission {tokens: N} of a multi-group model needs max_model_len: the admission check was skipped")
    one_req_blocks = one_request_blocks(cap.request_blocks(inp.max_model_len)) if cap and inp.max_model_len else None
    if need and one_req_blocks and need[1] < one_req_blocks:
        need = (max(need[0], inp.max_model_len or 0), one_req_blocks)
    p.need, p.one_req_blocks = need, one_req_blocks
    return adm


def _choose_budget(p: _Planning, drift: _Drift, adm: Any) -> None:
    """Max safe less the gate margin, rounded down (granularity, whole blocks); fit_admission's smaller
    one; a deployed budget kept when it is still safe."""
    inp, cap, result, reasons, refuse = p.inputs, p.cap, p.result, p.reasons, p.refuse
    spec, launch, need = inp.spec, drift.launch, p.need
    # an explicit 0 turns each off
    margin, granularity, keep_step = (size(spec[key] if spec.get(key) is not None else DEFAULTS[key], key)
                                      for key in ("gate_margin_bytes", "budget_granularity_bytes", "keep_step_bytes"))
    deployed = spec.get("deployed") or None
    if deployed is not None and not isinstance(deployed, Mapping):
        raise PlanError(f"deployed: expected the plan record a host runs (a mapping), got {type(deployed).__name__}")
    deployed = launch_deployed(deployed) or None  # its launch figures, whichever plan file format wrote it
    safe_budget = round_budget(launch, cap.bytes_per_block if cap else None, granularity, margin)
    budget = safe_budget
    if inp.budget_mode == "fit_admission":
        if adm is None:
            raise PlanError("budget_mode fit_admission needs admission ({tokens: N} or {concurrency: C, tokens_per_request: L})")
        if cap is None or not cap.bytes_per_block or need is None:
            refuse.append(f"budget_mode fit_admission needs the bytes of one KV block: {p.cap_why or 'the layout is derived from engine figures only'}")
        else:
            launch_blocks = safe_budget // cap.bytes_per_block
            target = need[1] + math.ceil(need[1] * inp.fit_headroom)
            blocks = min(target, launch_blocks)
            budget = blocks * cap.bytes_per_block
            result["fit"] = {
                "required_blocks": need[1],
                "target_blocks": target,
                "blocks": blocks,
                "budget_bytes": budget,
                "max_safe_bytes": max(0, launch),
                "left_free_bytes_per_gpu": max(0, launch) - budget,
                "capped_at_max_safe": target > launch_blocks,
            }
            reasons.append(
                f"fit_admission: {blocks} blocks ({human_bytes(budget)}) instead of the max safe {human_bytes(max(0, launch))}, "
                f"leaving {human_bytes(max(0, launch) - budget)} per GPU for other work"
            )
    planned_budget = budget
    keep_need = max(need[1] if need else 0, p.one_req_blocks or 0) or None
    budget, kept, keep_reason = keep_deployed(
        budget, max(0, launch) - margin, deployed, p.ref.get("key_hash"), keep_step,
        cap.num_blocks if cap is not None else (lambda _bytes: 0), keep_need if cap is not None else None)
    result["budget_choice"] = {
        "max_safe_bytes": max(0, launch),
        "gate_margin_bytes": margin,
        "granularity_bytes": granularity,
        "rounded_bytes": safe_budget,
        "planned_bytes": planned_budget,
        "deployed_bytes": size(deployed["kv_cache_memory_bytes"], "deployed.kv_cache_memory_bytes")
        if deployed and deployed.get("kv_cache_memory_bytes") not in (None, "", 0) else None,
        "keep_step_bytes": keep_step,
        "kept": kept,
        "reason": keep_reason,
    }
    if margin or granularity:
        reasons.append(
            f"budget {human_bytes(safe_budget)}: the max safe {human_bytes(max(0, launch))} less the gate margin "
            f"{human_bytes(margin)}, rounded down to {human_bytes(granularity) if granularity else 'no granule'} and whole blocks; "
            f"the weakest rank keeps {human_bytes(max(0, launch) - safe_budget)} above its floor")
    if deployed:
        reasons.append(keep_reason)
    result["kv_cache_memory_bytes"] = budget
    p.margin, p.granularity, p.safe_budget, p.budget = margin, granularity, safe_budget, budget


def _floors_and_utilization(p: _Planning) -> None:
    """Per-rank NVML floors, vLLM's startup utilization and floors, the profile policy's cap."""
    inp, ref, result, reasons, budget = p.inputs, p.ref, p.result, p.reasons, p.budget
    floors = {r["rank"]: r["free_bytes"] - (r["kv_bytes"] - inp.guard - budget) for r in ref["ranks"]}
    result["free_floor_bytes"] = floors
    p.floors = floors
    # NVML's exact total from the hosts when they agree, else the reference's
    host_totals = {v for v in p.totals.values() if v is not None}
    total = host_totals.pop() if len(host_totals) == 1 else ref.get("total_bytes")
    p.total = total
    if not total:
        reasons.append("no GPU total memory in the reference or the hosts: --gpu-memory-utilization not computed")
        return
    util, source, vfloors = startup_utilization(ref["ranks"], total, budget, inp.guard, ref["vllm_free"], inp.cuda_ctx)
    result["gpu_memory_utilization"] = util
    result["utilization_source"] = source
    result["vllm_floor_bytes"] = vfloors
    if source == "nvml":
        reasons.append(
            f"startup utilization {util} comes from the NVML floor minus a {human_bytes(inp.cuda_ctx)} CUDA-context allowance: "
            "the reference has no vLLM-logged free memory for every rank (record it from the profiled canary's log for a tighter value)"
        )
    if util <= 0:
        p.refuse.append(f"no --gpu-memory-utilization lets vLLM's startup check pass at the free floor (floor {human_bytes(min(vfloors.values()))})")
    # the boot gate's `profile` policy: vLLM's own profiling must not size more than the plan
    caps = [profiled_utilization_cap(budget, ref["vllm_free"][r["rank"]], r["kv_bytes_full"], total)
            for r in ref["ranks"] if r["rank"] in ref["vllm_free"] and r.get("kv_bytes_full") is not None]
    result["profile_max_utilization"] = min(caps) if caps and len(caps) == len(ref["ranks"]) else None


def _blocks_and_tokens(p: _Planning, drift: _Drift) -> None:
    """Blocks, tokens and concurrency of the budget; the one-request check; the admission shortfall."""
    inp, cap, result, reasons, budget, need = p.inputs, p.cap, p.result, p.reasons, p.budget, p.need
    max_model_len = inp.max_model_len
    num_blocks = tokens = None
    if cap is not None:
        num_blocks = cap.num_blocks(budget)
        if cap.source == "geometry" or max_model_len:
            tokens = cap.tokens(num_blocks, max_model_len)
        else:
            reasons.append("tokens not computed: a multi-group model's tokens are vLLM's max concurrency x max_model_len; give max_model_len")
    else:
        reasons.append(f"blocks and tokens not computed: {p.cap_why}")
    result.update(num_blocks=num_blocks, kv_cache_tokens=tokens, capacity_source=cap.source if cap else None,
                  kv_capacity=cap.record(max_model_len) if cap else None)
    p.num_blocks = num_blocks
    if cap is not None and num_blocks is not None and max_model_len:
        per_req = cap.request_blocks(max_model_len)
        result["blocks_per_request"] = per_req
        result["max_concurrency"] = max(0, num_blocks - 1) // per_req
        result["max_concurrency_vllm"] = round(num_blocks / per_req, 2)
        result["one_request_bytes"] = one_request_blocks(per_req) * cap.bytes_per_block if cap.bytes_per_block else None
        if num_blocks < one_request_blocks(per_req):
            have = human_bytes(budget)
            groups = f" summed over {len(cap.layout.groups)} KV-cache groups" if cap.layout and len(cap.layout.groups) > 1 else ""
            p.refuse.append(
                f"the budget {have} ({num_blocks} blocks) cannot hold one request of max_model_len {max_model_len} "
                f"({per_req} blocks{groups} + the null block): vLLM would refuse to start; lower max_model_len or free memory on "
                + p.rank_label(*drift.weakest)
            )
    elif num_blocks is not None:
        reasons.append("max_model_len not given: max concurrency and the one-request check were skipped")

    if need is not None and num_blocks is not None:
        block_size = result["block_size"]
        short_blocks = max(0, need[1] - num_blocks)
        short_tokens = short_blocks * block_size if cap and cap.source == "geometry" else (
            need[0] - (tokens or 0) if short_blocks else 0
        )
        result["admission"] = {
            "required_tokens": need[0],
            "required_blocks": need[1],
            "available_blocks": num_blocks,
            "available_tokens": tokens,
            "shortfall_blocks": short_blocks,
            "shortfall_tokens": max(0, short_tokens),
            "ok": short_blocks == 0,
        }
        if short_blocks:
            reasons.append(
                f"admission shortfall: the plan needs {need[1]} blocks ({need[0]} tokens + null block) but the budget gives "
                f"{num_blocks}; {max(0, short_tokens)} tokens short (deployable, but requests will queue or be preempted; "
                "lower the admission plan, use fp8 KV, or split off the weak hosts)"
            )


def _headroom(p: _Planning, drift: _Drift) -> None:
    """Free memory above the reference on every rank: a fresh profile would give more."""
    reasons = p.reasons
    threshold = p.inputs.spec.get("reprofile_headroom")
    threshold = size(threshold, "reprofile_headroom") if threshold is not None else max(1, min(max(1, r["kv_bytes"]) for r in p.ref["ranks"]) // 10)
    min_head = drift.min_headroom or 0
    p.result["headroom"] = {
        "min_bytes": min_head,
        "max_bytes": drift.max_headroom,
        "ranks_with_headroom": drift.headroom_ranks,
        "reprofile_threshold_bytes": threshold,
    }
    if min_head >= threshold:
        p.reprofile = True
        reasons.append(
            f"every rank has at least {human_bytes(min_head)} more free memory than the reference (threshold "
            f"{human_bytes(threshold)}): a fresh profiled canary would give a larger budget"
        )
    elif drift.headroom_ranks:
        reasons.append(
            f"{drift.headroom_ranks} rank(s) have up to {human_bytes(drift.max_headroom)} more free memory than the reference; "
            "the budget is capped at B_ref - G: re-profile the class to use it"
        )


def _split(p: _Planning, drift: _Drift) -> None:
    """Outlier hosts that cost the class more than max_capacity_loss of the median host's budget."""
    inp, launch, host_min = p.inputs, drift.launch, drift.host_min
    values = sorted(host_min.values())
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) // 2
    limit = (1.0 - inp.max_loss) * median
    # Host lists in name order: the plan must not depend on the order the hosts were probed in.
    outliers = sorted(n for n, v in host_min.items() if v < limit)
    p.result["capacity"] = {
        "median_host_bytes": median,
        "loss_share": round(1.0 - launch / median, 4) if median > 0 else None,
        "max_capacity_loss": inp.max_loss,
        "threshold_bytes": int(limit),
        "outlier_hosts": outliers,
    }
    if launch < limit and outliers:
        keep = sorted(n for n in host_min if n not in set(outliers))
        keep_budget = min(host_min[n] for n in keep) if keep else None
        # Each sub-class's budget is settled like the class's own (margin, granularity, whole
        # blocks): the low group's is the budget the class deploys under split_policy warn.
        bpb = p.cap.bytes_per_block if p.cap else None
        p.split_groups = [
            {"name": f"{inp.host_class}-main", "hosts": keep,
             "kv_cache_memory_bytes": round_budget(keep_budget, bpb, p.granularity, p.margin) if keep_budget is not None else None},
            {"name": f"{inp.host_class}-low", "hosts": outliers, "kv_cache_memory_bytes": p.safe_budget},
        ]
        p.reasons.append(
            f"the weakest hosts cost {round(100 * (1 - launch / median), 1)}% of the typical host's budget "
            f"({human_bytes(launch)} vs median {human_bytes(median)}, allowed {round(100 * inp.max_loss, 1)}%): split outliers "
            f"{_names(outliers)} into their own class ({human_bytes(launch)}); the rest could run "
            f"{human_bytes(keep_budget) if keep_budget is not None else 'n/a'}"
        )
    p.result["split"] = p.split_groups


def _instability(p: _Planning, drift: _Drift) -> None:
    """Ranks whose free memory moves more than unstable_share x guard."""
    unstable, share_limit = drift.unstable, drift.share_limit
    p.result["unstable"] = unstable
    if not unstable:
        return
    shown = [
        (p.rank_label(u["host"], u["rank"]).removeprefix("host ") if u["rank"] is not None else u["host"])
        + (f" (moves {human_bytes(u['spread_bytes'])})" if u["spread_bytes"] is not None and u["spread_bytes"] > share_limit
           else f" (moved {human_bytes(u['moved_bytes'])} across recent probes)" if u.get("moved_bytes") is not None
           else " (flagged unstable)")
        for u in unstable
    ]
    p.unstable_reason = (
        f"free memory is not steady on {_names(shown)} (limit {human_bytes(int(share_limit))} = "
        f"{p.inputs.unstable_share} x guard): a fixed byte budget is the wrong tool there; use automatic profiling "
        f"(--gpu-memory-utilization) there"
    )


def _rank_cards(raw_hosts: Any) -> dict[tuple[str, int], dict[str, Any]]:
    """(member, rank) -> the card a rank entry of the input names (``gpu`` index, ``uuid``, ``pci_bus_id``, and on an
    instance over several hosts the ``member`` host the rank runs on), where it names one."""
    cards: dict[tuple[str, int], dict[str, Any]] = {}
    for name, value in (raw_hosts.items() if isinstance(raw_hosts, Mapping) else ()):
        entries = value.get("ranks") if isinstance(value, Mapping) else value
        for i, entry in enumerate(entries if isinstance(entries, list) else ()):
            if isinstance(entry, Mapping) and isinstance(entry.get("rank", i), int):
                card = {k: entry[k] for k in ("gpu", "uuid", "pci_bus_id", "member") if entry.get(k) is not None}
                if card:
                    cards[(str(name), entry.get("rank", i))] = card
    return cards


def _per_rank_table(p: _Planning, drift: _Drift) -> None:
    per_rank = []
    # the card of each rank, where the probe named it: a plan read later says which GPU it was made for
    cards = p.cards
    for name, rank, free, drift_bytes, adjusted, is_unstable, spread in drift.rows:
        floor = p.floors[rank]
        per_rank.append(
            {
                **cards.get((name, rank), {}),
                "host": name,
                "rank": rank,
                "boot_free_bytes": free,
                "drift_bytes": drift_bytes,
                "adjusted_bytes": adjusted,
                "headroom_bytes": -drift_bytes if drift_bytes < 0 else 0,
                "floor_bytes": floor,
                "margin_bytes": free - floor,
                "weakest": (name, rank) == drift.weakest,
                "unstable": is_unstable,
                "spread_bytes": spread,
            }
        )
    p.result["per_rank"] = per_rank


def _decide(p: _Planning, drift: _Drift) -> None:
    """refuse, auto_profile, split, reprofile or deploy, in that order of precedence."""
    inp, result, reasons, budget, weakest = p.inputs, p.result, p.reasons, p.budget, drift.weakest
    if p.refuse:
        decision = "refuse"
        reasons[:0] = p.refuse
    elif drift.unstable:
        decision = "auto_profile"
        reasons.insert(0, p.unstable_reason)
        _auto_profile_utilization(result, reasons, drift.lowest_seen, p.total, inp.guard, inp.cuda_ctx, p.rank_label)
    elif p.split_groups:
        decision = "split"
    elif p.reprofile:
        decision = "reprofile"
    else:
        decision = "deploy"
        reasons.insert(
            0,
            f"deploy {human_bytes(budget)} ({budget} bytes) on every GPU of class {inp.host_class}: the weakest rank is "
            f"{p.rank_label(*weakest)}; every boot needs NVML free memory >= the floor "
            + ", ".join(f"rank {r}: {human_bytes(v)}" for r, v in sorted(p.floors.items())[:8]),
        )
    result["decision"] = decision
    result["human"] = {
        "kv_cache_memory_bytes": _hb(budget),
        "max_safe_bytes": _hb(drift.launch),
        "guard_bytes": _hb(inp.guard),
        "free_floor_bytes": {r: human_bytes(v) for r, v in p.floors.items()},
    }


def plan_deployable(plan: Mapping[str, Any], split_policy: str = "warn", require_admission: bool = False) -> bool:
    """Whether a class's plan may be deployed: the one rule ``kv_plan`` returns as ``deployable``.

    ``deploy``, ``reprofile`` and ``auto_profile`` plans are; a ``split`` is with
    ``split_policy`` ``per_host`` (each group its own plan) or ``warn`` (the weakest
    rank's budget on every host), not with ``fail``; ``refuse`` never is. With
    ``require_admission``, a plan whose admission check failed (``admission.ok`` false)
    is not deployable either; a plan without an admission check passes it. A plan with
    ``host_groups`` is deployable when each group's plan is too.
    """
    if not isinstance(plan, Mapping):
        raise PlanError(f"plan: expected a kv_plan result (a mapping), got {type(plan).__name__}")
    if split_policy not in SPLIT_POLICIES:
        raise PlanError(f"split_policy: expected {', '.join(SPLIT_POLICIES)}, got {split_policy!r}")
    try:
        require_admission = boolean(require_admission, "require_admission")
    except ValidationError as exc:
        raise PlanError(str(exc)) from None
    decision = plan.get("decision")
    if decision not in DECISIONS:
        raise PlanError(f"plan.decision: expected one of {', '.join(DECISIONS)}, got {decision!r}")
    if decision == "refuse" or (decision == "split" and split_policy == "fail"):
        return False
    admission = plan.get("admission")
    admission_failed = isinstance(admission, Mapping) and admission.get("ok") is False
    if require_admission and admission_failed:
        return False
    groups = plan.get("host_groups") or ()
    return all(isinstance(g, Mapping) and isinstance(g.get("plan"), Mapping) and plan_deployable(g["plan"], split_policy, require_admission)
               for g in groups)


def plan_class(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Plan one host class. ``spec`` is the ``kv_plan`` input; raises :class:`PlanError` on malformed input.

    Returns the plan (all bytes integers): the analysis, and under ``launch`` the class's
    launch contract (``_launch``), which is what every start and check reads. A class that
    cannot be planned safely is not an error: ``decision`` is ``refuse`` and ``reasons`` say why.
    """
    split_policy = _choice(spec, "split_policy", SPLIT_POLICIES, default("split_policy"))
    scope = _choice(spec, "unstable_scope", UNSTABLE_SCOPES, default("unstable_scope"))
    result = _analyse_class(spec)
    result["launch"] = launch_from_plan(result)
    result["host_groups"] = []
    if scope == "host" and result["decision"] == "auto_profile":
        result = _unsteady_hosts_apart(spec, result)
    if split_policy == "per_host" and result["decision"] == "split":
        _split_groups_apart(spec, result)
    return result


def _choice(spec: Mapping[str, Any], key: str, choices: Sequence[str], fallback: str) -> str:
    value = spec.get(key)
    if value is None:
        return fallback
    if value not in choices:
        raise PlanError(f"{key}: expected one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _inventory_hosts(spec: Mapping[str, Any], member: Any) -> set[str]:
    """The inventory hosts of a planned member: ``<host>/<instance>`` (``hosts_from``) runs on its host; an instance over
    several hosts (a gang, named after its leader) on the ``member`` host of each of its ranks. A host group takes
    all of them or none: one engine runs one plan."""
    raw = (spec.get("hosts") or {}).get(member)
    entries = raw.get("ranks") if isinstance(raw, Mapping) else raw
    hosts = {str(e["member"]) for e in entries or () if isinstance(e, Mapping) and e.get("member") is not None} \
        if isinstance(entries, list) else set()
    return hosts or {str(member).split("/", 1)[0]}


def _hosts_of(spec: Mapping[str, Any], members: Any) -> set[str]:
    return {host for member in members for host in _inventory_hosts(spec, member)}


def _sub_plan(spec: Mapping[str, Any], hosts: Sequence[str]) -> dict[str, Any]:
    """The plan of some of the class's inventory hosts alone (all their members), as the class would be planned with only them."""
    raw = spec.get("hosts") or {}
    wanted = set(hosts)
    sub = dict(spec, hosts={m: v for m, v in raw.items() if _inventory_hosts(spec, m) & wanted}, unstable_scope="class",
               split_policy="warn")
    plan = _analyse_class(sub)
    plan["launch"] = launch_from_plan(plan)
    plan["host_groups"] = []
    return plan


def _unsteady_hosts_apart(spec: Mapping[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """unstable_scope host: the hosts whose free memory is not steady run vLLM's own profiling
    (auto_profile), and the class is planned from its steady hosts; with none steady, the class is
    auto_profile as a whole. The unsteady hosts' group is that plan of them alone."""
    # a host's instances share its plan: one unsteady member sends the whole host (and a gang's, every member host)
    unsteady = sorted(_hosts_of(spec, {u["host"] for u in result["unstable"]}))
    steady = sorted(_hosts_of(spec, spec.get("hosts") or {}) - set(unsteady))
    if not steady or not unsteady:
        return result
    main = _sub_plan(spec, steady)
    if main["decision"] in ("refuse", "auto_profile"):
        return result
    apart = _sub_plan(spec, unsteady)
    main["unstable"] = result["unstable"]
    main["host_count"] = result["host_count"]
    main["rank_count"] = result["rank_count"]
    main["host_groups"] = [{"name": f"{main['host_class']}-unsteady", "hosts": unsteady, "why": "unstable", "plan": apart}]
    one = len(unsteady) == 1
    main["reasons"].insert(
        1, f"{apart['reasons'][0]}: only {_names(unsteady)} {'runs' if one else 'run'} vLLM's own profiling (auto_profile); "
           f"the class's {len(steady)} other hosts are planned without {'it' if one else 'them'} (unstable_scope host)")
    main["reasons"].extend(r for r in apart["reasons"][1:] if r.startswith("auto_profile:"))
    return main


def _split_groups_apart(spec: Mapping[str, Any], result: dict[str, Any]) -> None:
    """split_policy per_host: the outliers run the class's budget (the weakest rank's), the other hosts
    the plan of their own group, so that one outlier does not cost every host its budget."""
    main_group = next((g for g in result["split"] if g["name"].endswith("-main")), None)
    low_group = next((g for g in result["split"] if g["name"].endswith("-low")), None)
    if not main_group or not low_group:
        return
    # a host's instances share its plan: a host with one outlier member runs the class's budget (a gang: all its hosts)
    low_hosts = _hosts_of(spec, low_group["hosts"])
    hosts = sorted(_hosts_of(spec, main_group["hosts"]) - low_hosts)
    if not hosts:
        return
    main = _sub_plan(spec, hosts)
    if main["decision"] not in ("deploy", "reprofile"):
        return
    result["host_groups"].append({"name": main_group["name"], "hosts": hosts, "why": "split", "plan": main})
    result["reasons"].insert(
        1, f"split_policy per_host: {_names(hosts)} run their own budget "
           f"{human_bytes(main['kv_cache_memory_bytes'])}; the outliers run the class's {human_bytes(result['kv_cache_memory_bytes'])}")


def host_plan(plan: Mapping[str, Any], host: str) -> Mapping[str, Any]:
    """The plan a host of the class runs: its group's (``host_groups``), else the class's."""
    for group in plan.get("host_groups") or ():
        sub = group.get("plan") if isinstance(group, Mapping) else None
        if isinstance(sub, Mapping) and host in group.get("hosts", ()):
            return sub
    return plan


def _analyse_class(spec: Mapping[str, Any]) -> dict[str, Any]:
    inputs = _read_inputs(spec)
    result = _empty_result(inputs.host_class, inputs.budget_mode)
    result["guard_bytes"] = inputs.guard
    result["host_count"] = len(inputs.hosts)
    refuse: list[str] = []
    if inputs.ref is None:
        refuse.append(
            f"class {inputs.host_class}: no reference profile: run a profiled canary for this class and "
            "compatibility key (playbooks/profile.yml) before planning a manual budget"
        )
    if not inputs.hosts:
        refuse.append(f"class {inputs.host_class}: no hosts to plan (probe them with gpu_memory_facts first)")
    if refuse or inputs.ref is None:  # no reference is one of the refusals
        result["reasons"] = refuse + result["reasons"]
        return result

    p = _Planning(inputs, inputs.ref, result, cards=_rank_cards(inputs.spec.get("hosts")))
    # the reference canary's boot: what a unit's start is given to answer /health (boot_timeout 0)
    result["boot_seconds"] = inputs.ref["boot_seconds"]
    result["rank_count"] = sum(len(h["ranks"]) for h in inputs.hosts.values())
    _settle_reference_kv(p)
    _check_reference_suggestions(p)
    _check_rank_layout(p)
    _check_uniform_class(p)
    drift = _weakest_rank(p)
    if drift is None:
        p.refuse.append(f"class {inputs.host_class}: no host rank matches a reference rank")
        result["reasons"] = p.refuse + result["reasons"]
        return result
    result["max_safe_bytes"] = drift.launch
    result["weakest"] = {"host": drift.weakest[0], "rank": drift.weakest[1], "adjusted_bytes": drift.launch,
                         **{k: v for k, v in p.cards.get(drift.weakest, {}).items() if k == "member"}}
    if drift.launch <= 0:
        p.refuse.append(
            f"the weakest rank ({p.rank_label(*drift.weakest)}) leaves no KV memory ({drift.launch} bytes) "
            f"after drift and guard {human_bytes(inputs.guard)}: free memory there is far below the reference; find the "
            "co-tenant or re-profile"
        )
    adm = _admission_blocks(p)
    _choose_budget(p, drift, adm)
    _floors_and_utilization(p)
    _blocks_and_tokens(p, drift)
    result["what_if_fp8"] = what_if_fp8(p.ref, p.geo, p.cap, drift.launch, adm, inputs.max_model_len, p.reasons)
    _headroom(p, drift)
    _split(p, drift)
    _instability(p, drift)
    _per_rank_table(p, drift)
    _decide(p, drift)
    return result
