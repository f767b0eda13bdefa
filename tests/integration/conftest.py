"""Real test hosts for integration tests.

The ``test_hosts`` fixture is a factory: call it with host names and get a
:class:`TestHosts` whose hosts are up (systemd guests reached over SSH) and whose
Ansible inventory is written. Everything the factory started in a test module is torn
down when the module ends, even when a test fails::

    def test_something(test_hosts):
        th = test_hosts(["it-x-a", "it-x-b"], groups={"gpu": ["it-x-a", "it-x-b"]})
        th.ansible("gpu", "ansible.builtin.ping")            # ad-hoc over SSH
        th.playbook(Path("playbooks/probe.yml"), extra_vars={...})
        th.harness.exec("it-x-a", ["systemctl", "is-active", "ssh"])
        th.fake_nvml_state("it-x-a")                         # the host's NVML state file

Host names must be unique across the test modules that run together (prefix them with
the module, as above) and at most 31 characters. Hosts may be added later in the same
module by calling the factory again; hosts already up are kept.

The hosts need root and the rootfs built by ``make rootfs`` (``make integration``
builds it first).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "hosts"))

import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error
import testhosts  # noqa: E402  pylint: disable=wrong-import-position,import-error


@dataclasses.dataclass
class TestHosts:
    """Hosts started by one ``test_hosts(...)`` call, with their inventory."""

    __test__ = False  # not a test class for pytest

    harness: testhosts.Harness
    hosts: dict[str, testhosts.HostInfo]
    inventory: Path

    def fake_nvml_state(self, name: str) -> Path:
        """The fake NVML state file of ``name`` (``/etc/fake-nvml/state`` in the guest)."""
        return Path(self.hosts[name].fake_nvml_dir) / "state"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("ANSIBLE_HOST_KEY_CHECKING", "False")
        return env

    def ansible(self, pattern: str, module: str, args: str = "", timeout: float = 300) -> dict[str, Any]:
        """Run an ad-hoc module; returns ``{host: result}`` (raises if a host failed)."""
        with tempfile.TemporaryDirectory(prefix="adhoc-") as tree:
            argv = ["ansible", "-i", str(self.inventory), pattern, "-m", module, "--tree", tree]
            if args:
                argv += ["-a", args]
            proc = procgroup.run(argv, timeout=timeout, env=self._env())
            results = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in Path(tree).iterdir()}
        if proc.returncode != 0 or not results:
            raise AssertionError(f"ansible {pattern} -m {module} failed (rc {proc.returncode}): "
                                 f"{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
        return results

    def playbook(self, path: Path, extra_vars: Mapping[str, Any] | None = None,
                 args: Sequence[str] = (), timeout: float = 1800) -> subprocess.CompletedProcess[str]:
        """Run ``ansible-playbook`` against these hosts; returns the finished process (not checked), its
        whole output in ``stdout``; nothing of it outlives the call (``procgroup.run``)."""
        argv = ["ansible-playbook", "-i", str(self.inventory), str(path), *args]
        if extra_vars:
            argv += ["--extra-vars", json.dumps(dict(extra_vars))]
        return procgroup.run(argv, timeout=timeout, env=self._env(), cwd=REPO)


# The integration stage runs the modules on two pytest-xdist workers, a module per worker
# at a time (tests/tools/run-integration.sh, --dist loadfile --no-loadscope-reorder): the
# longest start first so that both workers finish at about the same time. Seconds on a
# 2-core machine (the sum of a module's test times in .cache/integration-junit.xml, which the
# stage writes); only their order matters. Modules not listed run after these, in name order.
MODULE_SECONDS = {
    "test_real_engine": 2170,
    "test_rollout": 1880,
    "test_rollout_faults": 840,
    "test_rollout_ramps": 450,
    "test_rollout_runtime": 290,
    "test_kv_families": 210,
    "test_vllm_canary": 160,
    "test_boot_gate": 150,
    "test_playbook_reports": 120,
    "test_doc_examples_hosts": 80,
    "test_kv_oracle_matrix": 70,
    "test_report_render": 65,
    "test_gpu_memory_info": 60,
    "test_probe_interpreter": 55,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first (a stable sort: a module's tests keep their order)."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.module.__name__ if item.module else "", 0))


@pytest.fixture(scope="session")
def harness() -> testhosts.Harness:
    """The harness on ``$GPUFLEET_CACHE`` (root and a built rootfs are required)."""
    if os.geteuid() != 0:
        pytest.fail("test hosts need root (systemd-nspawn, network namespaces, mounts)")
    h = testhosts.Harness()
    if not (h.rootfs / "etc" / "gpufleet-rootfs.json").is_file():
        pytest.fail(f"no test host rootfs at {h.rootfs}: run `make rootfs`")
    return h


@pytest.fixture(scope="module")
def test_hosts(harness: testhosts.Harness,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., TestHosts]]:
    """Factory ``test_hosts(names, groups=None, binds=(), binds_ro=(), hostvars=None) -> TestHosts``.

    The inventory lists every host this module started (so later calls see earlier hosts),
    with ``groups`` as child groups and ``hostvars`` as extra host variables.
    """
    started: list[str] = []
    inv_dir = tmp_path_factory.mktemp("inventory")

    def factory(names: Sequence[str], groups: Mapping[str, Sequence[str]] | None = None,
                binds: Sequence[str] = (), binds_ro: Sequence[str] = (),
                hostvars: Mapping[str, Mapping[str, Any]] | None = None, timeout: float = 120.0) -> TestHosts:
        new = [n for n in names if n not in started]
        started.extend(new)  # recorded first: torn down even if `up` fails half-way
        infos = harness.up(list(names), binds=binds, binds_ro=binds_ro, timeout=timeout)
        up = harness.hosts()
        inv = inv_dir / f"inventory-{len(list(inv_dir.iterdir()))}.yml"
        # Only this module's hosts: other modules' hosts stay out of its inventory.
        harness.inventory(inv, groups=groups, hostvars=hostvars, names=[n for n in started if n in up])
        return TestHosts(harness=harness, hosts={i.name: i for i in infos}, inventory=inv)

    try:
        yield factory
    finally:
        if started:
            harness.down(started)
