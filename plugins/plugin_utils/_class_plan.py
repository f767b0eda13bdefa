# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What a class's planning decides: the one home of "needs a profiled canary" and of the class state.

The planning play (``playbooks/plays/plan_classes.yml``) calls :func:`prepare_class` once per
class (``gpufleet.vllm.class_plan``), on its canary host, before any host is touched: the
reference lookup in the profile store, :func:`canary_need` on it and the run's settings, what
moved since an approved plan, and the first-run outline's inputs. Every task that runs, skips
or explains the profiled canary reads that answer. Whatever the class's outcome (planned, stopped for a profile in a dry run, failed, or
never finished on a lost canary host), its state record (``gpufleet_class_state``, which the
rollout, the plan artifact and the report read) is built by :func:`class_state` alone.
Controller-side, plain Python.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._compat import compat_key
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan_inputs import boot_timeout_for, reference_boot_seconds
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._profile_store import ProfileStore
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._rollout import budget_problems, class_batches, host_capacity, parse_budget, plan_drift

__all__ = ["CLASS_OUTCOMES", "CanaryNeed", "ClassPlanError", "ClassPreparation", "ClassState", "canary_need", "class_state", "class_states",
           "deploy_order", "prepare_class"]

QUERY_STATUSES = ("found", "missing", "mismatch")

# planned: a plan (deployable or not); needs_profile: a dry run stopped before a profiled canary;
# failed: the canary or the plan failed; unfinished: the canary host never gave a state (lost)
CLASS_OUTCOMES = ("planned", "needs_profile", "failed", "unfinished")


class ClassPlanError(ValueError):
    """A lookup result that is not one ``kv_profile`` returns; the message names the field."""


@dataclass(frozen=True)
class CanaryNeed:
    """Whether the class runs a profiled canary, and what the run can do with the class."""

    # the store holds a reference profile for the class's compatibility key
    reference_found: bool
    # a profiled canary runs first (with canaries on) or would run (a dry run)
    profiled: bool
    # why a profiled canary is needed ('' when it is not)
    why: str
    # the class is planned in this run: a reference is at hand, or the canaries make one
    plan_now: bool
    # why a dry run stops before planning the class ('' when it does not stop)
    dry_run_stop: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ClassState:
    """A class's state after planning, as every host of the class holds it (``gpufleet_class_state``).

    ``ok``: the class is deployed in this run; ``failed``: its canary or plan failed (the run
    stops the class); ``needs_profile``: a dry run found no reference (a rollout profiles first).
    The optional fields are those of a planned class (and ``first_run`` of a class whose outline
    was made); they are left out of :meth:`as_dict` when unset, as the record always had them.
    """

    ok: bool
    failed: bool
    needs_profile: bool
    plan: dict[str, Any]
    key_hash: str
    reasons: list[str]
    profile_path: str | None = None
    compat: dict[str, Any] | None = None
    applied_plan: str | None = None
    manual_canary: str | None = None
    first_run: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        # not dataclasses.asdict: it rebuilds nested containers by their type, which Ansible's lazy templated ones refuse
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _mapping(value: Any, field: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ClassPlanError(f"class state: {field} must be a mapping, got {type(value).__name__}")
    return dict(value)


def class_state(outcome: str, host_class: str, *, deployable: bool = False, plan: Any = None, key_hash: Any = "",
                reasons: Any = (), profile_path: Any = None, compat: Any = None, applied_plan: Any = None,
                manual_canary: Any = None, first_run: Any = None, canary_host: str = "") -> ClassState:
    """The state record of one class (``outcome`` one of :data:`CLASS_OUTCOMES`).

    ``planned``: ``ok`` is ``deployable``; the plan's own ``reasons`` are the class's unless
    ``reasons`` are given. ``unfinished`` (the canary host ``canary_host`` was lost before it gave a
    state) says so. A failed or unfinished class has no key hash: nothing of it is deployed.
    """
    if outcome not in CLASS_OUTCOMES:
        raise ClassPlanError(f"class state: outcome must be one of {', '.join(CLASS_OUTCOMES)}, got {outcome!r}")
    plan_doc = _mapping(plan, "plan")
    if isinstance(reasons, str) or not isinstance(reasons, (list, tuple)):
        raise ClassPlanError("class state: reasons must be a list of texts")
    why = [str(r) for r in reasons]
    if outcome == "unfinished":
        why = why or [f"class {host_class}: the canary host {canary_host} did not finish planning"]
        return ClassState(ok=False, failed=True, needs_profile=False, plan={}, key_hash="", reasons=why)
    if outcome == "failed":
        return ClassState(ok=False, failed=True, needs_profile=False, plan=plan_doc, key_hash="", reasons=why)
    outline = None if first_run is None else _mapping(first_run, "first_run")
    if outcome == "needs_profile":
        return ClassState(ok=False, failed=False, needs_profile=True, plan={}, key_hash=str(key_hash or ""), reasons=why,
                          first_run=outline)
    if not why:
        why = [str(r) for r in plan_doc.get("reasons") or []]
    return ClassState(ok=bool(deployable), failed=False, needs_profile=False, plan=plan_doc, key_hash=str(key_hash or ""),
                      reasons=why, profile_path=str(profile_path or ""), compat=_mapping(compat, "compat"),
                      applied_plan=str(applied_plan or ""), manual_canary=None if manual_canary is None else str(manual_canary),
                      first_run=outline)


def _differences(query: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    differences = query.get("differences") or []
    if not isinstance(differences, list) or not all(isinstance(d, Mapping) for d in differences):
        raise ClassPlanError("profile query: differences must be a list of {field, reference, current}")
    return differences


def canary_need(query: Mapping[str, Any], host_class: str, *, force_profile: bool, run_canaries: bool) -> CanaryNeed:
    """The decision for one class from its reference lookup.

    A profiled canary is needed when the store has no reference for the key (``missing``), the
    key changed (``mismatch``), or the run asks for a fresh profile (``gpufleet_force_profile``).
    Without canaries (``plan.yml``) a class without a reference is not planned, and says why.
    """
    if not isinstance(query, Mapping):
        raise ClassPlanError("profile query: expected the result of gpufleet.vllm.kv_profile state=query")
    status = query.get("status")
    if status not in QUERY_STATUSES:
        raise ClassPlanError(f"profile query: status must be one of {', '.join(QUERY_STATUSES)}, got {status!r}")
    differences = _differences(query)
    found = status == "found"
    if force_profile:
        why = "a fresh profile was asked for (gpufleet_force_profile)"
    elif status == "missing":
        why = "no reference profile in the store yet"
    elif status == "mismatch":
        why = "the compatibility key changed: " + ", ".join(json.dumps(dict(d)) for d in differences)
    else:
        why = ""
    dry_run_stop = ""
    if not run_canaries and not found:
        fields = ", ".join(str(d.get("field")) for d in differences)
        dry_run_stop = (f"class {host_class} has no reference profile for its compatibility key ({status}"
                        f"{': ' + fields if differences else ''}); a rollout runs a profiled canary first")
    return CanaryNeed(reference_found=found, profiled=bool(why), why=why, plan_now=bool(run_canaries or found),
                      dry_run_stop=dry_run_stop)


@dataclass(frozen=True)
class ClassPreparation:
    """What a class's planning knows before any host is touched (``gpufleet.vllm.class_plan``'s result)."""

    # the class's compatibility key, canonical, and its hash
    key_hash: str
    compat: dict[str, Any]
    # the profile store's answer for the key: status found/mismatch/missing, the profile (the
    # reference when found, the class's newest under another key on a mismatch), differences,
    # unreadable files (corrupt) and how many records the class has (count)
    reference: dict[str, Any]
    # whether a profiled canary runs, and why (:func:`canary_need`)
    canary: CanaryNeed
    # what moved since the approved plan (empty without one); any entry stops every class
    plan_moved: list[str]
    # the inputs of the first-run outline (``_first_run.outline``) but the manual canary, which
    # is decided after the class is planned
    first_run_spec: dict[str, Any]
    # why the class is refused before any host is touched (its capacity budget holds none of its
    # hosts, or not one of them); empty when it is not: no canary runs for a refused class
    refusal: list[str]
    # the class's batches as the rollout cuts them (its serial entries within its capacity budget)
    batches: list[list[str]]

    def as_dict(self) -> dict[str, Any]:
        return {"key_hash": self.key_hash, "compat": self.compat, "reference": self.reference, "canary": self.canary.as_dict(),
                "plan_moved": self.plan_moved, "first_run_spec": self.first_run_spec, "refusal": self.refusal,
                "batches": self.batches}


def _snapshot_of(snapshots: Mapping[str, Any], host: str) -> Mapping[str, Any]:
    """A host's snapshot, with the instance list the outline reads; an error names what is missing."""
    snapshot = snapshots.get(host)
    if not isinstance(snapshot, Mapping):
        raise ClassPlanError(f"snapshots: no host snapshot of {host} (gpufleet.vllm.vllm_host_snapshot's result)")
    if not isinstance(snapshot.get("instances"), list):
        raise ClassPlanError(f"snapshots[{host}].instances: expected the list the host snapshot returns")
    return snapshot


def _canary_facts(profile: Any) -> Mapping[str, Any]:
    """The canary part of a profile-store record (``profile.canary``), {} when it has none (its load
    test; its boot is :func:`_plan_inputs.reference_boot_seconds`'s to read)."""
    inner = profile.get("profile") if isinstance(profile, Mapping) else None
    canary = inner.get("canary") if isinstance(inner, Mapping) else None
    return canary if isinstance(canary, Mapping) else {}


def _load_seconds(canary: Mapping[str, Any]) -> float | None:
    """One canary load test as the profile measured it (warm-up included), None when unknown. The
    outline only estimates with it: a figure that is not a number counts as unknown, never fails the class."""
    raw = canary.get("load")
    load: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    total = 0.0
    for name in ("seconds", "warmup_seconds"):
        value = load.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            total += float(value)
    return total or None


def prepare_class(store: ProfileStore, host_class: str, compat: Mapping[str, Any], *, hosts: Sequence[str],
                  snapshots: Mapping[str, Any], canary_host: str, canary_instance: str, canary_chosen: bool = False,
                  approved_plan: Any = None, force_profile: bool = False, run_canaries: bool = True, serial: Any = None,
                  max_unavailable: Any = None, boot_timeout: Any = 0, enforce_eager: Any = False,
                  drain: bool = False, gangs: Sequence[Sequence[str]] = ()) -> ClassPreparation:
    """What one class's planning decides before any host is touched.

    ``hosts``: the class's hosts in their order (the canary host among them); ``snapshots``: host
    -> its ``vllm_host_snapshot`` result (the instances' unit states for the outline, the GPUs for
    an approved plan's floors). ``approved_plan``: the plan artifact being applied, or None.
    ``serial`` and ``max_unavailable``: the run's batches and the class's capacity budget
    (``gpufleet_rollout_serial``, ``gpufleet_max_unavailable``); a budget that holds none of the
    class's hosts refuses the class (``refusal``: no canary runs), as does one that cannot take a whole gang
    (``gangs``: the members of each instance over several of the class's hosts, leader first). ``boot_timeout`` and
    ``enforce_eager`` (the service's serve option): the outline's upper bound when no boot was
    measured. Raises :class:`ClassPlanError`, and the store's, the key's, the plan's and the
    batches' own errors (each names its field).
    """
    if not hosts or canary_host not in hosts:
        raise ClassPlanError(f"hosts: expected the class's hosts with the canary host {canary_host} among them, got {list(hosts)}")
    by_host = {host: _snapshot_of(snapshots, host) for host in hosts}
    key = compat_key(compat)
    answer = store.query(host_class, key)
    need = canary_need(answer, host_class, force_profile=force_profile, run_canaries=run_canaries)
    order = [canary_host] + [h for h in hosts if h != canary_host]
    budget = parse_budget(max_unavailable)
    capacity = {h: host_capacity(s) for h, s in by_host.items()}
    members = [[str(h) for h in gang] for gang in gangs]
    refusal = budget_problems(budget, order, capacity, members)
    if refusal:  # nothing of the class runs: no canary stops its canary host's instance
        need = CanaryNeed(reference_found=need.reference_found, profiled=False, why="", plan_now=False, dry_run_stop="")
    batches = [b["hosts"] for b in class_batches(
        [{"class": host_class, "hosts": order, "max_unavailable": None if refusal else max_unavailable, "capacity": capacity,
          "gangs": members}], [1, "10%", "50%"] if serial is None else serial)]
    found = answer["status"] == "found"
    moved: list[str] = []
    if isinstance(approved_plan, Mapping):
        profile_path = (answer.get("profile") or {}).get("path") if found else None
        moved = plan_drift(approved_plan, host_class, {"key_hash": answer["key_hash"], "compat": dict(compat),
                                                       "reference_id": os.path.basename(profile_path) if profile_path else None,
                                                       "hosts": {h: list(s.get("gpus") or []) for h, s in by_host.items()}})
        if force_profile:
            moved.append("gpufleet_force_profile would record a new reference profile")
    # the boot the outline counts with: the reference's canary, else (another key) the class's newest profile's
    timed = answer.get("profile") or {}
    canary = _canary_facts(timed)
    spec = {
        "host_class": host_class,
        "canary_host": canary_host,
        "canary_chosen": bool(canary_chosen),
        "canary_instance": canary_instance,
        "profiled_canary": need.profiled,
        "manual_canary": None,
        "hosts": {h: s["instances"] for h, s in by_host.items()},
        "batches": batches,
        "boot_seconds": reference_boot_seconds(timed),
        "boot_source": "the reference profile's canary" if found else "the class's newest profile (another compatibility key)",
        "boot_timeout": boot_timeout_for(boot_timeout, timed, {"enforce_eager": enforce_eager}, "vllm_service_boot_timeout"),
        "load_seconds": _load_seconds(canary),
        "drain": bool(drain),
    }
    return ClassPreparation(key_hash=str(answer["key_hash"]), compat=dict(key.fields), reference=dict(answer), canary=need,
                            plan_moved=moved, first_run_spec=spec, refusal=refusal, batches=batches)


def deploy_order(hosts: Mapping[str, Mapping[str, Any]], classes: Sequence[str],
                 gangs: Sequence[tuple[Any, Sequence[str]]] = ()) -> list[dict[str, Any]]:
    """The classes the batches are cut from (``rollout_batches``), each ``{class, hosts,
    max_unavailable, capacity, bake, on_failure}``, and ``gangs`` in a class with instances over
    several hosts (``gangs``: ``(class, members)`` pairs, leader first; each rolled out whole).

    ``hosts``: host -> ``{host_class, ok, canary, max_unavailable, capacity, bake, on_failure}`` (its class, whether
    the class is deployable, the class's canary host, the class's capacity budget as the canary host
    gives it, None when unset, the KV-cache tokens the host serves, None when not known, and the class's
    bake as the canary host gives it, None when it does not bake, and its failure policy, None when unset).
    Classes come in the order of ``classes`` (``gpufleet_classes`` as given, else
    sorted by name); a class with no deployable host is left out. Within a class the canary host
    goes first (its production instance already stopped for the canaries), then the others by name.
    """
    if not isinstance(hosts, Mapping):
        raise ClassPlanError("hosts: expected host -> {host_class, ok, canary}")
    order: list[dict[str, Any]] = []
    for cls in classes:
        members = sorted(h for h, st in hosts.items() if isinstance(st, Mapping) and st.get("host_class") == cls and st.get("ok") is True)
        if not members:
            continue
        canary = hosts[members[0]].get("canary") or ""
        if canary in members:
            members = [canary] + [h for h in members if h != canary]
        first = hosts[members[0]]
        order.append({"class": cls, "hosts": members, "max_unavailable": first.get("max_unavailable"),
                      "capacity": {h: hosts[h].get("capacity") for h in members}, "bake": first.get("bake"),
                      "on_failure": first.get("on_failure")})
        own = [list(m) for c, m in gangs if c == cls]
        if own:
            order[-1]["gangs"] = own
    return order


def class_states(hosts: Sequence[tuple[str, Any, Any]]) -> dict[str, dict[str, Any]]:
    """Every class's state, as the plan artifact records it (``rollout_plan``'s classes).

    ``hosts``: ``(host, class, class state or None)`` per planned host. Every host of a class
    holds the same state (the planning play gives it the canary host's); the first host by name
    gives it, ``{}`` when it holds none (a class that never finished planning), with
    ``reference_id``, the file name of the class's reference profile (``profile_path``).
    """
    classes: dict[str, dict[str, Any]] = {}
    for _host, host_class, state in sorted(hosts, key=lambda row: str(row[0])):
        if host_class is None or str(host_class) in classes:
            continue
        out = dict(state) if isinstance(state, Mapping) else {}
        out["reference_id"] = os.path.basename(str(out.get("profile_path") or "")) or None
        classes[str(host_class)] = out
    return classes
