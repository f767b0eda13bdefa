# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The gangs of a run (instances that span hosts), checked from the inventory and from the probe.

Controller side: reads each host's variables (``hostvars``) and, after the probe, each host's
snapshot. The gang's own rules (mode, members, sizes, rank arguments) live in
``module_utils/_units/_gang.py``; this module applies them to a run's hosts:

- :func:`inventory_problems`, before any host is contacted: each gang as its hosts give it
  (:func:`._gang.parse`), what its members must agree on (:func:`._gang.across_hosts`), and that
  its members are hosts of one class with the same model and serve options;
- :func:`addresses_to_resolve`: what a follower must resolve (the gang's address), asked of the
  host snapshot (``vllm_host_snapshot`` ``resolve``);
- :func:`probed_problems`, after the probe: every member probed, one GPU model over every rank
  of the gang, and the gang's address resolved on every follower;
- :func:`member_launches`: what a member's units add for its rank (arguments, environment, sandbox);
- :func:`rank_places`: where each member's ranks lie in its gang, for planning the gang as one engine;
- :func:`members_of`: the members of a host's gang, for what runs on all of them at once (a canary gang);
- :func:`key_fields`: what a gang adds to the compatibility key of its canary (layout, interconnect);
- :func:`stragglers`: the members of a gang that did not reach a step of its deploy, with what stopped them;
- :func:`one_at_a_time`: hosts one at a time, but a gang's members together (``rollback.yml``).
"""
from __future__ import annotations

import json
import typing as t

from ansible_collections.gpufleet.vllm.plugins.module_utils._units._gang import (
    Gang,
    GangError,
    across_hosts,
    key_fields as gang_key_fields,
    member_launch,
    parse,
)
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._report import failure_message

__all__ = ["GangView", "RankPlace", "addresses_to_resolve", "canary_hosts", "described", "inventory_problems", "key_fields", "member_launches",
           "members_of", "one_at_a_time", "probed_problems", "rank_places", "stragglers"]

FIELD = "gpufleet_instances"
# the inventory variable that names a class's canary host (on the class's first host by name)
CANARY_HOST = "gpufleet_canary_host"
SERVE_ARGS = "gpufleet_serve_args"
# what every member of a gang must give alike: one engine runs one model with one set of serve options
_ALIKE = ("gpufleet_host_class", "gpufleet_model", SERVE_ARGS)


class GangView(t.NamedTuple):
    """A gang as a host's inventory gives it: ``field`` names where (``gpufleet_instances[0].gang``)."""

    host: str
    name: str
    field: str
    gang: t.Mapping[str, t.Any]
    gpus: t.Sequence[t.Any]


class _Hosts:
    """The hosts' variables as one call reads them: each host's variables and gang views read once
    (every read of ``hostvars[host]`` templates that host's variables anew)."""

    def __init__(self, hostvars: t.Mapping[str, t.Any]) -> None:
        self._hostvars = hostvars
        self._vars: dict[str, t.Mapping[str, t.Any]] = {}
        self._views: dict[str, list[GangView]] = {}

    def vars(self, host: str) -> t.Mapping[str, t.Any]:
        if host not in self._vars:
            found = self._hostvars.get(host)
            self._vars[host] = found if isinstance(found, t.Mapping) else {}
        return self._vars[host]

    def views(self, host: str) -> list[GangView]:
        if host not in self._views:
            instances = self.vars(host).get(FIELD)
            self._views[host] = [] if not isinstance(instances, (list, tuple)) else [
                GangView(host, str(inst.get("name")), f"{FIELD}[{i}].gang", inst["gang"], inst.get("gpus") or [])
                for i, inst in enumerate(instances) if isinstance(inst, t.Mapping) and "gang" in inst]
        return self._views[host]


class RankPlace(t.NamedTuple):
    """Where one member's instance lies in its gang: ``member`` the gang's planning member (``<leader>/<instance>``),
    ``first_rank`` the instance-wide number of the host's first rank, ``members`` the gang's hosts in node-rank order."""

    member: str
    first_rank: int
    members: tuple[str, ...]


def _key(view: GangView) -> tuple[str, str]:
    """One gang as every member gives it (the same instance name and the same mapping, in any key order)."""
    return view.name, json.dumps(view.gang, sort_keys=True, default=str)


def _gpu_counts(hosts: _Hosts, members: t.Iterable[t.Any], name: str) -> dict[str, int]:
    """How many GPUs each member's instance ``name`` has (members without it are left out)."""
    counts: dict[str, int] = {}
    for member in members:
        if not isinstance(member, (str, int)) or isinstance(member, bool):
            continue  # parse() names it
        for view in hosts.views(str(member)):
            if view.name == name and isinstance(view.gpus, (list, tuple)):
                counts[str(member)] = len(view.gpus)
    return counts


def _parse(hosts: _Hosts, view: GangView) -> Gang:
    gang = view.gang
    members = gang.get("members") if isinstance(gang, t.Mapping) else None
    listed = members if isinstance(members, (list, tuple)) else []
    leader = gang.get("leader", listed[0] if listed else None) if isinstance(gang, t.Mapping) else None
    leader_vars = hosts.vars(str(leader)) if isinstance(leader, (str, int)) and not isinstance(leader, bool) else {}
    # each member's own address, where the gang's addresses give none: its ansible_host
    reach = {str(m): hosts.vars(str(m)).get("ansible_host") for m in listed if isinstance(m, (str, int)) and not isinstance(m, bool)}
    own = {m: str(a) for m, a in reach.items() if a}
    return parse(gang, field=view.field, serve_args=hosts.vars(view.host).get(SERVE_ARGS),
                 gpus=_gpu_counts(hosts, listed, view.name),
                 leader_address=leader_vars.get("ansible_host") or (str(leader) if leader_vars else None),
                 serve_args_field=SERVE_ARGS, member_addresses=own)


def _alike(values: t.Iterable[t.Any]) -> bool:
    """Whether every value equals the first (serve options in any key order; no options is an empty mapping)."""
    seen = [value if value is not None else {} for value in values]
    return all(value == seen[0] for value in seen[1:])


def inventory_problems(hostvars: t.Mapping[str, t.Any], hosts: t.Sequence[str]) -> list[str]:
    """Every problem with the gangs of ``hosts`` (the run's hosts), each naming the host and field."""
    cache = _Hosts(hostvars)
    problems: list[str] = []
    checked: set[tuple[str, str]] = set()
    run_hosts = [str(h) for h in hosts]
    views = {h: {v.name: v.gang for v in cache.views(h)} for h in run_hosts}
    for host in run_hosts:
        instances = cache.vars(host).get(FIELD)
        if cache.views(host) and isinstance(instances, (list, tuple)) and len(instances) > 1:
            # the class's plan is the gang's, its floors keyed by the gang's ranks: another instance has no plan here
            problems.append(f"{host}: {FIELD}: a member of an instance that spans hosts runs no other instance (got "
                            f"{len(instances)}: {', '.join(str(i.get('name')) if isinstance(i, t.Mapping) else '?' for i in instances)}); "
                            "its class is planned as the gang's engine")
        for view in cache.views(host):
            if _key(view) in checked:
                continue  # the same gang as another member gives it: checked once
            checked.add(_key(view))
            try:
                gang = _parse(cache, view)
            except GangError as exc:
                problems.append(f"{host}: {exc}")
                continue
            for var in _ALIKE:
                given = {m: cache.vars(m).get(var) for m in gang.members if m in views}
                if not _alike(given.values()):
                    problems.append(f"{host}: {view.field}: every member must give the same {var} (one engine runs over them), got "
                                    + "; ".join(f"{m}: {value!r}" for m, value in given.items()))
    problems.extend(across_hosts(views, FIELD))
    return list(dict.fromkeys(problems))


def _gangs(cache: _Hosts, hosts: t.Sequence[str]) -> dict[str, Gang]:
    found: dict[str, Gang] = {}
    seen: set[tuple[str, str]] = set()
    for host in hosts:
        for view in cache.views(str(host)):
            if _key(view) not in seen:
                seen.add(_key(view))
                gang = _parse(cache, view)
                found.setdefault(f"{view.name}@{gang.leader}", gang)
    return found


def described(hostvars: t.Mapping[str, t.Any], hosts: t.Sequence[str]) -> list[dict[str, t.Any]]:
    """The checked gangs of ``hosts`` as plain data, sorted by instance and leader: ``{name, mode, members,
    leader, address, port, tensor_parallel_size, pipeline_parallel_size, data_parallel_size, gpus, host_class}``."""
    cache = _Hosts(hostvars)
    return [{"name": label.split("@", 1)[0], "mode": gang.mode, "members": list(gang.members), "leader": gang.leader,
             "address": gang.address, "port": gang.port, "tensor_parallel_size": gang.tensor_parallel_size,
             "pipeline_parallel_size": gang.pipeline_parallel_size, "data_parallel_size": gang.data_parallel_size,
             "gpus": dict(gang.gpus), "host_class": cache.vars(gang.leader).get("gpufleet_host_class")}
            for label, gang in sorted(_gangs(cache, hosts).items())]


def addresses_to_resolve(hostvars: t.Mapping[str, t.Any], host: str) -> list[str]:
    """The addresses ``host`` must resolve as a follower: the address of each gang it follows."""
    cache = _Hosts(hostvars)
    wanted: list[str] = []
    for view in cache.views(host):
        try:
            gang = _parse(cache, view)
        except GangError:
            continue  # named before the probe (inventory_problems)
        if host in gang.members and host != gang.leader:
            wanted.append(gang.address)
    return sorted(set(wanted))


def probed_problems(hostvars: t.Mapping[str, t.Any], hosts: t.Sequence[str], snapshot_var: str = "gpufleet_probe_result") -> list[str]:
    """What the probe shows wrong with each gang of ``hosts``: a member not probed, a GPU of the instance the
    member does not have, GPU models that differ between ranks, a follower that cannot resolve the gang's
    address. Raises GangError for a gang the inventory gets wrong (:func:`inventory_problems` first).

    A gang whose members the probe skipped (their class is not one the run chose) is not looked at."""
    cache = _Hosts(hostvars)
    problems: list[str] = []
    for label, gang in sorted(_gangs(cache, hosts).items()):
        name = label.split("@", 1)[0]
        snaps = {m: cache.vars(m).get(snapshot_var) for m in gang.members}
        if all(isinstance(snap, t.Mapping) and snap.get("skipped") for snap in snaps.values()):
            continue  # a class the run does not choose (gpufleet_classes): nothing of it was probed
        models: dict[str, list[str]] = {}
        for member in gang.members:
            snap = snaps[member]
            if not isinstance(snap, t.Mapping) or snap.get("failed") or snap.get("unreachable") or snap.get("skipped") \
                    or "gpus" not in snap:
                why = snap.get("msg") if isinstance(snap, t.Mapping) and snap.get("msg") else "no snapshot"
                problems.append(f"{member}: {FIELD} instance {name}: this member of the gang was not probed ({why}); "
                                "a gang runs on all of its members or not at all")
                continue
            view = next(v for v in cache.views(member) if v.name == name)
            by_index: dict[int, t.Mapping[str, t.Any]] = {int(g["index"]): g for g in snap.get("gpus") or []
                                                          if isinstance(g, t.Mapping) and isinstance(g.get("index"), int)}
            missing = [int(i) for i in view.gpus if int(i) not in by_index]
            if missing:
                problems.append(f"{member}: {FIELD} instance {name}: GPU(s) {', '.join(map(str, missing))} of the gang are not on "
                                f"this host (the probe found {', '.join(str(i) for i in sorted(by_index)) or 'none'})")
            for index in view.gpus:
                if int(index) in by_index:
                    model = str(by_index[int(index)].get("name") or "an unnamed GPU")
                    models.setdefault(model, []).append(f"{member} GPU {int(index)}")
            if member != gang.leader:
                resolved = {r.get("name"): r for r in snap.get("resolved") or [] if isinstance(r, t.Mapping)}
                entry = resolved.get(gang.address)
                if entry is None:
                    problems.append(f"{member}: {FIELD} instance {name}: the snapshot did not resolve the gang's address {gang.address}")
                elif entry.get("error") or not entry.get("addresses"):
                    problems.append(f"{member}: {FIELD} instance {name}: the gang's address {gang.address} (the leader "
                                    f"{gang.leader}) does not resolve on this follower: {entry.get('error') or 'no address'}; "
                                    "set gang.address to an address every member resolves")
        if len(models) > 1:
            problems.append(f"{gang.leader}: {FIELD} instance {name}: ranks on different GPU models ("
                            + "; ".join(f"{model}: {', '.join(where)}" for model, where in sorted(models.items()))
                            + "); one engine runs at the pace and memory of the least")
    return problems


def _infiniband(cache: _Hosts, host: str, snapshot_var: str) -> list[str]:
    """The InfiniBand devices ``host``'s snapshot found (``vllm_host_snapshot``'s ``infiniband``)."""
    snap = cache.vars(host).get(snapshot_var)
    return [str(d) for d in (snap.get("infiniband") if isinstance(snap, t.Mapping) else None) or []]


def api_instances(instances: t.Sequence[t.Any], launches: t.Mapping[str, t.Any]) -> list[t.Any]:
    """Of a host's ``instances``, those that serve an API there: not those of a gang the host follows headless
    (its ``launches``, :func:`member_launches`, with ``serves_api`` false), which have no API server, so
    no load balancer sends them requests and no ``/metrics`` is read from them."""
    headless = {name for name, launch in launches.items() if isinstance(launch, t.Mapping) and launch.get("serves_api", True) is False}
    return [i for i in instances if not (isinstance(i, t.Mapping) and i.get("name") in headless)]


def member_launches(hostvars: t.Mapping[str, t.Any], host: str, snapshot_var: str = "gpufleet_probe_result") -> dict[str, dict[str, t.Any]]:
    """``{instance name: launch}`` for each gang ``host`` is a member of (:func:`._gang.member_launch`): its rank
    arguments, environment and sandbox. The InfiniBand devices are allowed where the host's snapshot found them.
    Raises GangError for a gang the inventory gets wrong (:func:`inventory_problems` first)."""
    cache = _Hosts(hostvars)
    infiniband = bool(_infiniband(cache, host, snapshot_var))
    launches: dict[str, dict[str, t.Any]] = {}
    for view in cache.views(host):
        gang = _parse(cache, view)
        if host in gang.members:
            launches[view.name] = member_launch(gang, host, infiniband=infiniband)
    return launches


def key_fields(hostvars: t.Mapping[str, t.Any], host: str, instance: str, snapshot_var: str = "gpufleet_probe_result") -> dict[str, t.Any]:
    """The fields an instance that spans hosts adds to its compatibility key on ``host`` (its canary): the
    gang's layout (:func:`._gang.key_fields`) and the InfiniBand devices ``host``'s snapshot found. Empty
    when ``instance`` is not a gang ``host`` is a member of (a one-host instance's key is unchanged). The
    NCCL version is the engine runtime's, which the canary reads (``_compat.host_fields``).
    Raises GangError for a gang the inventory gets wrong (:func:`inventory_problems` first)."""
    cache = _Hosts(hostvars)
    for view in cache.views(host):
        if view.name != instance:
            continue
        gang = _parse(cache, view)
        if host in gang.members:
            return {**gang_key_fields(gang), "infiniband": _infiniband(cache, host, snapshot_var)}
    return {}


def rank_places(hostvars: t.Mapping[str, t.Any], hosts: t.Sequence[str]) -> dict[tuple[str, str], RankPlace]:
    """``{(host, instance): RankPlace}`` for every instance of ``hosts`` that spans hosts: the planner plans a gang
    as one member whose ranks are all of its members' (one engine), numbered as vLLM numbers them.
    Raises GangError for a gang the inventory gets wrong (:func:`inventory_problems` first)."""
    cache = _Hosts(hostvars)
    places: dict[tuple[str, str], RankPlace] = {}
    for label, gang in _gangs(cache, hosts).items():
        name = label.split("@", 1)[0]
        for host in gang.members:
            places[(host, name)] = RankPlace(f"{gang.leader}/{name}", gang.first_rank(host), gang.members)
    return places


def members_of(hostvars: t.Mapping[str, t.Any], host: str, instance: str) -> list[str]:
    """The members of the gang of ``host``'s instance ``instance``, in node-rank order (the leader first); empty when
    that instance is on ``host`` alone. Raises GangError for a gang the inventory gets wrong."""
    return _members(_Hosts(hostvars), host, instance)


def _members(cache: _Hosts, host: str, instance: str) -> list[str]:
    for view in cache.views(host):
        if view.name == instance:
            gang = _parse(cache, view)
            return list(gang.members) if host in gang.members else []
    return []


def canary_hosts(hostvars: t.Mapping[str, t.Any], class_hosts: t.Sequence[str]) -> list[str]:
    """The hosts that run a class's canaries, the canary host first: the host its first host by name names in
    ``gpufleet_canary_host``, else that first host; when that host's first instance spans hosts, every member of its
    gang, the leader first (the leader is then the canary host). One call per host of the class, each host's
    variables read once. Raises GangError for a gang the inventory gets wrong."""
    names = sorted(str(h) for h in class_hosts)
    if not names:
        return []
    cache = _Hosts(hostvars)
    named = cache.vars(names[0]).get(CANARY_HOST) or names[0]
    named = str(named)
    instances = cache.vars(named).get(FIELD)
    first = instances[0] if isinstance(instances, (list, tuple)) and instances and isinstance(instances[0], t.Mapping) else {}
    return _members(cache, named, str(first.get("name") or "vllm")) or [named]


def stragglers(hostvars: t.Mapping[str, t.Any], mates: t.Sequence[str], step: str, reached_var: str,
               result_var: str = "") -> list[str]:
    """The members of ``mates`` that did not reach ``step`` of a gang's deploy, each as ``"<host>: <why>"``.

    Every member runs the deploy in the same play, task by task; at each step a member records the step it
    reached (``reached_var``). A member whose deploy failed before the step went to its rescue and recorded
    nothing since: its ``reached_var`` names an earlier step. ``why`` is what its ``result_var`` (the result
    registered by the step's task that can fail) said when that failed, else that it stopped before the step."""
    out: list[str] = []
    for mate in mates:
        seen = hostvars.get(mate) or {}
        if seen.get(reached_var) == step:
            continue
        result = seen.get(result_var) if result_var else None
        failed = isinstance(result, t.Mapping) and bool(result.get("failed") or result.get("unreachable"))
        why = failure_message(result) if failed else f"it stopped before {step} (its own failure names why)"
        out.append(f"{mate}: {why}")
    return out


def one_at_a_time(hostvars: t.Mapping[str, t.Any], hosts: t.Sequence[str]) -> list[list[str]]:
    """``hosts`` in batches of one host, but the members of a gang, which make one batch (the leader first) where
    its first member comes in ``hosts``: what must change one at a time (a rollback host by host) still takes a
    gang whole, since its members restart together or not at all. Raises GangError naming a gang that has members
    outside ``hosts``, and for a gang the inventory gets wrong."""
    chosen = [str(h) for h in hosts]
    wanted = set(chosen)
    cache = _Hosts(hostvars)
    gang_of: dict[str, tuple[str, ...]] = {}
    problems: list[str] = []
    for label, gang in sorted(_gangs(cache, chosen).items()):
        missing = [m for m in gang.members if m not in wanted]
        if missing:
            problems.append(f"instance {label.split('@', 1)[0]} spans {', '.join(gang.members)}: {', '.join(missing)} "
                            "must be chosen with the others (a gang changes with all of its members or not at all)")
            continue
        for member in gang.members:
            gang_of[member] = gang.members
    if problems:
        raise GangError("; ".join(problems))
    batches: list[list[str]] = []
    placed: set[str] = set()
    for host in chosen:
        if host in placed:
            continue
        batch = list(gang_of.get(host, (host,)))
        placed.update(batch)
        batches.append(batch)
    return batches
