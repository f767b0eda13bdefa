"""The test host harness itself: real systemd guests, SSH, NVML through the fake library,
clean teardown and refusal to start over leftovers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import typing as t
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "hosts"))
sys.path.insert(0, str(REPO / "tests" / "fake_nvml"))
import nvml_state  # noqa: E402  pylint: disable=wrong-import-position,import-error
import testhosts  # noqa: E402  pylint: disable=wrong-import-position,import-error

if t.TYPE_CHECKING:
    from conftest import TestHosts  # pylint: disable=import-error

A, B, C = "it-harness-a", "it-harness-b", "it-harness-c"
TESTHOSTS = [sys.executable, str(REPO / "tests" / "hosts" / "testhosts.py")]
GIB = 1024**3


@pytest.fixture(scope="module")
def pair(test_hosts) -> TestHosts:
    return test_hosts([A, B], groups={"pair": [A, B]})


def _ssh(th: TestHosts, name: str, command: str) -> str:
    proc = th.harness.ssh(name, [command], timeout=60)
    assert proc.returncode == 0, f"{name}: {command}: {proc.stderr}"
    return proc.stdout.strip()


def _owned(harness: testhosts.Harness, name: str) -> list[testhosts.Leftover]:
    return [x for x in harness.leftovers() if x.owner == name]


def test_ansible_ping_over_ssh(pair: TestHosts) -> None:
    results = pair.ansible("pair", "ansible.builtin.ping")
    assert sorted(results) == [A, B]
    assert all(r["ping"] == "pong" for r in results.values())


def test_inventory_reaches_each_guest_at_its_own_address(pair: TestHosts) -> None:
    results = pair.ansible("pair", "ansible.builtin.command", "ip -4 -o addr show dev host0")
    for name in (A, B):
        assert f"inet {pair.hosts[name].address}/24" in results[name]["stdout"]
    assert pair.hosts[A].address != pair.hosts[B].address


def test_the_hosts_reach_each_other_over_the_fabric_only(pair: TestHosts) -> None:
    a, b = pair.hosts[A], pair.hosts[B]
    assert a.fabric_address == f"{testhosts.FABRIC_PREFIX}.{a.index}" and a.fabric_address != b.fabric_address
    assert f"inet {a.fabric_address}/24" in _ssh(pair, A, f"ip -4 -o addr show dev {testhosts.FABRIC_IFACE}")
    # a TCP connection from A to B's fabric address (sshd listens on every address of the guest)
    probe = f"import socket; socket.create_connection(('{b.fabric_address}', 22), timeout=5).close(); print('ok')"
    assert _ssh(pair, A, f'python3 -c "{probe}"') == "ok"
    # the hosts' own links do not route between them: the fabric is their one path
    other = f"import socket; socket.create_connection(('{b.address}', 22), timeout=2)"
    assert pair.harness.ssh(A, [f'python3 -c "{other}"'], timeout=60).returncode != 0
    # the controller is on neither side of the fabric
    assert subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout.count(
        f"{testhosts.FABRIC_PREFIX}.") == 0
    ports = pair.harness._fabric_ports()  # pylint: disable=protected-access
    assert {f"f{a.index}", f"f{b.index}"} <= set(ports)


def test_pid1_is_a_real_systemd(pair: TestHosts) -> None:
    for name in (A, B):
        assert pair.harness.exec(name, ["cat", "/proc/1/comm"], check=True).stdout.strip() == "systemd"
        assert _ssh(pair, name, "readlink /proc/1/exe") in ("/usr/lib/systemd/systemd", "/lib/systemd/systemd")
        assert _ssh(pair, name, "systemctl is-system-running || true") in ("running", "degraded")
        assert _ssh(pair, name, "systemctl is-active ssh.service") == "active"
        assert _ssh(pair, name, "hostname") == name


def test_each_guest_has_its_own_writable_layer(pair: TestHosts) -> None:
    _ssh(pair, A, "mkdir -p /opt/only-a && echo a > /opt/only-a/marker")
    assert pair.harness.exec(B, ["test", "-e", "/opt/only-a"]).returncode == 1
    assert not (pair.harness.rootfs / "opt" / "only-a").exists()


def test_pynvml_in_guest_loads_fake_library(pair: TestHosts) -> None:
    lib = pair.harness.fake_nvml_lib
    if not lib.is_file():
        pytest.fail(f"fake NVML library not built at {lib}: run `make fake-nvml`")
    state_file = pair.fake_nvml_state(A)
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(0, 80 * GIB, name="NVIDIA H100 80GB HBM3", reserved=0),
                     nvml_state.make_gpu(1, 80 * GIB, name="NVIDIA H100 80GB HBM3", reserved=0, base_used=GIB)]
    nvml_state.save(state_file, state)
    probe = ("import json, pynvml; pynvml.nvmlInit(); "
             "hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]; "
             "print(json.dumps([[pynvml.nvmlDeviceGetName(h), pynvml.nvmlDeviceGetMemoryInfo(h).free] for h in hs]))")
    cmd = f"/usr/bin/python3 -c '{probe}'"
    first = json.loads(_ssh(pair, A, cmd))
    assert first == [["NVIDIA H100 80GB HBM3", 80 * GIB], ["NVIDIA H100 80GB HBM3", 79 * GIB]]
    # The guest reads the state file on every call: a change on the controller shows at once.
    with nvml_state.locked(state_file):
        state = nvml_state.load(state_file)
        nvml_state.add_process(state, gpu=0, pid=4242, used=3 * GIB, name="cotenant", pidns="other")
        nvml_state.save(state_file, state)
    second = json.loads(_ssh(pair, A, cmd))
    assert second[0][1] == 77 * GIB
    # The library is the one mapped into the guest process, where a driver puts it.
    maps = _ssh(pair, A, "/usr/bin/python3 -c 'import pynvml; pynvml.nvmlInit(); print(open(\"/proc/self/maps\").read())'")
    assert testhosts.NVML_GUEST_PATH in maps


def test_hosts_added_later_keep_the_running_ones(pair: TestHosts, test_hosts) -> None:
    _ssh(pair, A, "echo kept > /root/state-marker")
    leader = pair.harness.get(A).leader_pid
    more = test_hosts([C])
    assert sorted(more.hosts) == [C]
    assert pair.harness.get(A).leader_pid == leader
    assert _ssh(pair, A, "cat /root/state-marker") == "kept"
    results = more.ansible("all", "ansible.builtin.ping")
    assert sorted(results) == [A, B, C]


def test_up_refuses_over_unknown_leftovers(pair: TestHosts) -> None:
    stray = "it-harness-stray"
    subprocess.run(["ip", "netns", "add", f"gpf-{stray}"], check=True)
    try:
        with pytest.raises(testhosts.HarnessError, match=f"gpf-{stray}"):
            pair.harness.up(["it-harness-d"])
        assert not _owned(pair.harness, "it-harness-d")
        cli = subprocess.run([*TESTHOSTS, "check-clean"], capture_output=True, text=True, check=False)
        assert cli.returncode == 1
        assert f"netns gpf-{stray} (host {stray})" in cli.stderr
        # Running hosts the harness knows about are not leftovers that block a start.
        assert pair.harness.hosts().keys() >= {A, B}
    finally:
        subprocess.run(["ip", "netns", "del", f"gpf-{stray}"], check=False)


def test_down_leaves_nothing_and_is_idempotent(harness: testhosts.Harness) -> None:
    name = "it-harness-e"
    try:
        info = harness.up([name])[0]
        assert _owned(harness, name)
        stats = {"boot_seconds": info.boot_seconds, **harness.memory(name)}
        out = Path(harness.cache) / "integration" / "harness-stats.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        testhosts.atomic_write(out, json.dumps(stats, indent=2) + "\n")
        assert 0 < stats["pss_bytes"] < 512 * 1024**2
        assert stats["processes"] >= 4  # systemd, journald, dbus, sshd at least
    finally:
        harness.down([name])
    assert not _owned(harness, name)
    assert not Path(f"/run/netns/gpf-{name}").exists()
    assert not testhosts.pid_alive(info.nspawn_pid)
    assert not Path(f"/sys/class/net/{info.veth}").exists()
    assert f"f{info.index}" not in harness._fabric_ports()  # pylint: disable=protected-access
    assert not any(p.startswith(str(harness.host_dir(name))) for p in testhosts.read_mountinfo())
    assert harness.down([name]) == [name]  # again: nothing to do, no error
    subprocess.run([*TESTHOSTS, "check-clean", name], check=True)


def test_failed_boot_is_torn_down(harness: testhosts.Harness) -> None:
    name = "it-harness-f"
    with pytest.raises(testhosts.HarnessError, match=f"{name}: not ready before the timeout"):
        harness.up([name], timeout=0.05)
    assert not _owned(harness, name)
    assert name not in harness.registry()


def test_sigterm_during_up_cleans_up(harness: testhosts.Harness) -> None:
    name = "it-harness-g"
    record = harness.host_dir(name) / "host.json"
    proc = subprocess.Popen([*TESTHOSTS, "up", name], stdout=subprocess.DEVNULL,  # pylint: disable=consider-using-with
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        booting = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                info = testhosts.HostInfo.load(record)
            except (OSError, ValueError):
                time.sleep(0.005)
                continue
            if info.nspawn_pid and info.state == "starting":
                booting = True
                break
            time.sleep(0.005)
        assert booting, "the host never reached the booting state"
        os.kill(proc.pid, signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert not _owned(harness, name)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        harness.down([name])
