#!/usr/bin/env python
"""Dynamic part of the simulated fleet's inventory: how to reach each host.

The simulated hosts are systemd-nspawn guests whose addresses are handed out
when they boot, so the static ``hosts.yml`` beside this script names the hosts
and their classes, and this script adds the connection variables of those of
them that are up, as recorded by the test host harness.  Hosts that are down
get no connection variables and show up as unreachable; other test hosts are
never added.

It also gives every host, the implicit localhost included, ``sim_checkout``: the
absolute path of the checkout this inventory lies in. The group variables build the
controller paths (profile store, report directory, model configs) from it, because
Ansible's playbook directory is that of whichever playbook file holds the play (a play
of an imported playbook such as ``playbooks/plays/plan_classes.yml`` sees
``playbooks/plays``) and the implicit localhost has no inventory directory.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _names(node: object) -> set[str]:
    """Every host name under a YAML inventory node (``hosts:`` of any group, nested)."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "hosts" and isinstance(value, dict):
                found |= set(value)
            else:
                found |= _names(value)
    return found


def inventory_hosts() -> set[str]:
    import yaml  # pylint: disable=import-outside-toplevel

    with open(os.path.join(HERE, "hosts.yml"), encoding="utf-8") as handle:
        return _names(yaml.safe_load(handle))


def connection_vars() -> dict[str, dict[str, object]]:
    sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))
    try:
        import testhosts  # pylint: disable=import-error,import-outside-toplevel
    except ImportError:
        return {}
    harness = testhosts.Harness()
    try:
        data = harness.inventory_data()
    except testhosts.HarnessError:
        return {}
    wanted = inventory_hosts()
    return {name: hv for name, hv in data["all"]["hosts"].items() if name in wanted}


def main(argv: list[str]) -> int:
    hostvars = connection_vars()
    if len(argv) > 2 and argv[1] == "--host":
        print(json.dumps(hostvars.get(argv[2], {})))
        return 0
    print(json.dumps({"_meta": {"hostvars": hostvars},
                      "all": {"hosts": sorted(hostvars), "vars": {"sim_checkout": REPO}}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
