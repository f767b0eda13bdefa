#!/usr/bin/python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
from __future__ import annotations

DOCUMENTATION = r"""
---
module: rollout_lease
short_description: Take, renew or release the leases that let one run at a time change a host class, or a host
version_added: 2.0.0
description:
  - With O(store), runs on the controller. A class lease is a file C(<store>/.leases/<class>.json) in the profile
    store, which every controller of a fleet shares, naming its owner (user and host of the controller), the run id,
    its start, its last renewal and its expiry, and what the run does (O(purpose)).
  - With O(host_dir), runs on the host, for the lease of that host, C(<host_dir>/.leases/host.json). A run holds it
    while it changes the host (its canaries, its batch), so that two runs never change one host at once, even when
    their controllers do not share a profile store. It follows the same rules as a class lease, its expiry judged by
    the host's clock; a lease of a run named in O(superseded) is taken over at once.
  - O(state=present) takes the lease of every class in O(classes), all or none, in name order (two runs that want
    overlapping classes never hold one each and wait on the other). A class held by another run, not expired,
    stops the task with the holder's identity - or, with O(wait), the task waits up to that many seconds for it.
    An expired lease (its controller was killed, or crashed) is taken over and returned in RV(taken_over), for the
    run's report. Taking a lease the run holds already renews it.
  - O(state=renewed) pushes the expiry of the run's leases on by O(ttl) seconds; a lease the run no longer holds
    (it expired and another run took it over) is an error.
  - O(state=absent) removes the run's leases; a lease another run holds now is left as it is.
  - A lease is created whole or not at all (a complete temporary file linked into place); two controllers that
    race for it see exactly one winner.
author:
  - gpufleet maintainers (@gpufleet)
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.ACTION_PLUGIN
attributes:
  check_mode:
    support: full
    details:
      - In check mode nothing is written; a lease another run holds is still reported as a warning.
  diff_mode:
    support: none
  idempotent:
    support: partial
    details:
      - Taking or renewing a lease writes a new expiry every time; releasing a released lease changes nothing.
  platform:
    platforms: posix
options:
  state:
    description: Take (V(present)), renew (V(renewed)) or release (V(absent)) the leases.
    type: str
    choices: [present, renewed, absent]
    default: present
  store:
    description:
      - The profile store directory (C(gpufleet_profile_store)), shared by every controller of the fleet, for the
        leases of O(classes).
      - With O(host_dir), the store of this run's class leases. The host lease names the store, and a host held by a
        run of this store that no longer holds its class lease (it ended, or was taken over) is taken over at once.
    type: path
  classes:
    description:
      - The host classes the run changes; requires O(store). Each is a host class name (letters, digits, C(.), C(_)
        and C(-), at most 128, starting with a letter or a digit).
      - One of O(classes) and O(host_dir) is required.
    type: list
    elements: str
  host_dir:
    description:
      - The state directory of the host (C(vllm_service_state_dir)), for the lease of the host itself.
      - One of O(classes) and O(host_dir) is required.
    type: path
  run_id:
    description:
      - The id of this run; the lease names it, and only this run renews or releases its lease.
      - Letters, digits, C(.), C(_) and C(-), at most 128, starting with a letter or a digit (it names a file).
    type: str
    required: true
  ttl:
    description:
      - Seconds a lease holds without renewal (60 to 604800). The rollout renews it at every batch; a controller that
        dies leaves the class to the next run after this long.
    type: int
    default: 7200
  wait:
    description: Seconds to wait for a held lease before giving up (0 to 86400); 0 refuses at once.
    type: int
    default: 0
  purpose:
    description: What the run does, in the lease and in the refusal of another run (for example V(rollout), V(profile)).
    type: str
    default: rollout
  details:
    description: More to name in the lease (for example C(awx_job_id), C(limit)); plain values only.
    type: dict
    default: {}
  superseded:
    description:
      - Runs whose leases count as expired (O(state=present)). With O(host_dir) and O(store) the action adds the
        holder of the host when it is a run of this store that no longer holds its class lease.
    type: list
    elements: str
    default: []
  owner:
    description: Who holds the lease; the controller's user and host name by default.
    type: str
  controller:
    description:
      - The controller process that holds the lease (V(host), V(pid), V(pid_start)); the action plugin sets it to the
        C(ansible-playbook) process of the run.
    type: dict
notes:
  - Every controller that changes a class must use the same store, so that they see each other's leases; on AWX
    the store is a directory every execution node mounts (see the collection's AWX guide).
seealso:
  - module: gpufleet.vllm.rollout_report
"""

EXAMPLES = r"""
- name: Take the lease of the classes this run changes
  gpufleet.vllm.rollout_lease:
    store: "{{ gpufleet_profile_store }}"
    classes: [h200-tp1, l40s]
    run_id: "{{ gpufleet_run_id }}"
    details:
      awx_job_id: "{{ awx_job_id | default('') }}"
  register: lease

- name: Take the lease of this host for its batch (on the host)
  gpufleet.vllm.rollout_lease:
    host_dir: "{{ vllm_service_state_dir }}"
    run_id: "{{ gpufleet_run_id }}"
    details:
      host_class: h200-tp1
  register: host_lease

- name: Release the lease of this host when its batch is done
  gpufleet.vllm.rollout_lease:
    state: absent
    host_dir: "{{ vllm_service_state_dir }}"
    run_id: "{{ gpufleet_run_id }}"

- name: Release the class leases at the end of the run
  gpufleet.vllm.rollout_lease:
    state: absent
    store: "{{ gpufleet_profile_store }}"
    classes: [h200-tp1, l40s]
    run_id: "{{ gpufleet_run_id }}"
"""

RETURN = r"""
leases:
  description: The leases this run holds (O(state=present), O(state=renewed)), one per class.
  returned: success
  type: list
  elements: dict
  sample: [{"scope": "h200-tp1", "run_id": "3f2a9c1e0b7d4a51", "owner": "awx@awx-task-1", "expires": 1796400000.0}]
taken_over:
  description: Expired leases this run took over, with a sentence each for the report.
  returned: success
  type: list
  elements: dict
  sample: [{"scope": "h200-tp1", "holder": {"run_id": "9c1e", "owner": "ops@bastion"}, "msg": "took over the expired lease ..."}]
released:
  description: The classes whose lease this run removed (O(state=absent)); V(host) for a host's lease.
  returned: success
  type: list
  elements: str
holder:
  description: The lease of the run that holds the host or class, when the task failed on it.
  returned: failure
  type: dict
held_by:
  description: In check mode, the leases another run holds (a warning each).
  returned: check mode
  type: list
  elements: dict
"""

from typing import Any

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpufleet.vllm.plugins.module_utils import _lease


def main() -> None:
    module = AnsibleModule(argument_spec=_lease.ARGUMENT_SPEC, supports_check_mode=True, **_lease.ARGUMENT_RULES)
    if not module.params["host_dir"]:
        module.fail_json(msg="host_dir: the module takes a host's lease; class leases are the action plugin's (store)")
    try:
        result: dict[str, Any] = _lease.apply(module.params["host_dir"], [_lease.HOST_SCOPE], module.params,
                                              check_mode=module.check_mode, process=module.params["controller"] or {})
    except _lease.LeaseHeld as exc:
        module.fail_json(msg=str(exc), holder=exc.holder)
    except _lease.LeaseError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
