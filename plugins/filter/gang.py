# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters: gang_problems, gang_addresses, gangs, gang_members, gang_member_launch, gang_key_fields, gang_stragglers,
gang_batches (documentation in the YAML files beside this one).

Calls into ``plugin_utils/_gangs``, the run's view of its instances that span hosts."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _gangs


def _checked(name: str, hostvars: Any, hosts: Any) -> tuple[Mapping[str, Any], list[str]]:
    if not isinstance(hostvars, Mapping):
        raise AnsibleFilterError(f"{name}: expected hostvars as the input, got {type(hostvars).__name__}")
    if isinstance(hosts, str) or not isinstance(hosts, Sequence):
        raise AnsibleFilterError(f"{name}: expected a list of hosts, got {type(hosts).__name__}")
    return hostvars, [str(h) for h in hosts]


def gang_problems(hostvars: Any, hosts: Any, probed: Any = False) -> list[str]:
    """hostvars, the run's hosts -> what is wrong with their gangs (the inventory's view, or with
    ``probed`` the probe's)."""
    given, names = _checked("gang_problems", hostvars, hosts)
    if not isinstance(probed, bool):
        raise AnsibleFilterError(f"gang_problems: probed must be true or false, got {probed!r}")
    if not probed:
        return _gangs.inventory_problems(given, names)
    try:
        return _gangs.probed_problems(given, names)
    except ValueError as exc:  # GangError: the inventory's checks come first
        raise AnsibleFilterError(f"gang_problems: {exc} (the inventory's gang checks, gang_problems without probed, come first)") from None


def gang_addresses(hostvars: Any, host: Any) -> list[str]:
    """hostvars, a host -> the gang addresses that host must resolve as a follower."""
    given, names = _checked("gang_addresses", hostvars, [host] if isinstance(host, str) else host)
    return [address for name in names for address in _gangs.addresses_to_resolve(given, name)]


def gangs(hostvars: Any, hosts: Any) -> list[dict[str, Any]]:
    """hostvars, the run's hosts -> their gangs, checked (gang_problems first names what is wrong)."""
    given, names = _checked("gangs", hostvars, hosts)
    problems = _gangs.inventory_problems(given, names)
    if problems:
        raise AnsibleFilterError(f"gangs: {'; '.join(problems)}")
    return _gangs.described(given, names)


def gang_member_launch(hostvars: Any, host: Any) -> dict[str, dict[str, Any]]:
    """hostvars, a host -> {instance name: what its unit adds for its rank of the gang} (gang_problems first
    names what is wrong)."""
    given, names = _checked("gang_member_launch", hostvars, [host] if isinstance(host, str) else [])
    if len(names) != 1:
        raise AnsibleFilterError(f"gang_member_launch: expected one host name, got {host!r}")
    try:
        return _gangs.member_launches(given, names[0])
    except ValueError as exc:  # GangError
        raise AnsibleFilterError(f"gang_member_launch: {exc}") from None


def _host_instance_call(name: str, hostvars: Any, host: Any, instance: Any, call: Callable[[Mapping[str, Any], str, str], Any]) -> Any:
    """One host's one instance: the inputs checked, ``call(hostvars, host, instance)``, a GangError as the filter's error."""
    given, names = _checked(name, hostvars, [host] if isinstance(host, str) else [])
    if len(names) != 1:
        raise AnsibleFilterError(f"{name}: expected one host name, got {host!r}")
    if not isinstance(instance, str) or not instance:
        raise AnsibleFilterError(f"{name}: expected the instance's name, got {instance!r}")
    try:
        return call(given, names[0], instance)
    except ValueError as exc:  # GangError
        raise AnsibleFilterError(f"{name}: {exc}") from None


def gang_members(hostvars: Any, host: Any, instance: Any) -> list[str]:
    """hostvars, a host, an instance name -> the members of that instance's gang, the leader first (empty for a
    one-host instance)."""
    members: list[str] = _host_instance_call("gang_members", hostvars, host, instance, _gangs.members_of)
    return members


def gang_key_fields(hostvars: Any, host: Any, instance: Any) -> dict[str, Any]:
    """hostvars, a host, an instance name -> what the instance's gang adds to its compatibility key on that
    host (empty for a one-host instance)."""
    fields: dict[str, Any] = _host_instance_call("gang_key_fields", hostvars, host, instance, _gangs.key_fields)
    return fields


def gang_stragglers(hostvars: Any, mates: Any, step: Any, reached_var: Any = "__vllm_service_gang_reached",
                    result_var: Any = "") -> list[str]:
    """hostvars, the other members of a gang -> those that did not reach ``step`` of its deploy, each with what
    stopped it (the vllm_service role's gang steps)."""
    given, names = _checked("gang_stragglers", hostvars, mates)
    for label, value in (("step", step), ("reached_var", reached_var)):
        if not isinstance(value, str) or not value:
            raise AnsibleFilterError(f"gang_stragglers: {label} must be a non-empty text, got {value!r}")
    if not isinstance(result_var, str):
        raise AnsibleFilterError(f"gang_stragglers: result_var must be a variable name, got {result_var!r}")
    return _gangs.stragglers(given, names, step, reached_var, result_var)


def gang_batches(hostvars: Any, hosts: Any) -> list[list[str]]:
    """hostvars, hosts -> the hosts one at a time, but each gang's members in one batch (the leader first); a gang
    with members outside ``hosts`` fails, naming them."""
    given, names = _checked("gang_batches", hostvars, hosts)
    try:
        return _gangs.one_at_a_time(given, names)
    except ValueError as exc:  # GangError
        raise AnsibleFilterError(f"gang_batches: {exc}") from None


def gang_api_instances(instances: Any, launches: Any) -> list[Any]:
    """A host's instances, its gang launches (gang_member_launch) -> the instances that serve an API on the host."""
    if isinstance(instances, (str, Mapping)) or not isinstance(instances, Sequence):
        raise AnsibleFilterError("gang_api_instances: expected the host's instances, a list")
    if not isinstance(launches, Mapping):
        raise AnsibleFilterError("gang_api_instances: expected the host's gang launches by instance (gang_member_launch), a mapping")
    return _gangs.api_instances(instances, launches)


class FilterModule:
    """gpufleet.vllm filters for instances that span hosts."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"gang_problems": gang_problems, "gang_addresses": gang_addresses, "gangs": gangs, "gang_members": gang_members,
                "gang_member_launch": gang_member_launch, "gang_key_fields": gang_key_fields,
                "gang_stragglers": gang_stragglers, "gang_batches": gang_batches, "gang_api_instances": gang_api_instances}
