# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The interpreter the NVML probe runs with, by default, on two real test hosts whose system
Python has no nvidia-ml-py (the guest's pynvml is removed first):

* ``it-pi-venv`` has a vLLM venv at /opt/vllm/venv with nvidia-ml-py (as vllm_runtime leaves
  it): probe.yml and the gpu_probe role run the probe with that venv's python;
* ``it-pi-bare`` has neither (a first run before vllm_runtime) and a wheelhouse directory
  (``vllm_runtime_wheelhouse``): probe.yml, read-only, installs nothing there and fails the host
  naming the playbooks that install the binding, while the other host is probed;
* runtime.yml (an engine installed by hand: ``vllm_runtime_install`` false, its venv without
  the binding) installs the pinned nvidia-ml-py into the collection's small venv
  /opt/gpufleet/nvml-venv from the wheelhouse, with no index; probe.yml then probes from that venv
  as it is, and so does the gpu_probe role (neither builds it again).

The real pynvml loads the fake libnvidia-ml.so.1 bound into each guest.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, TestHosts  # pylint: disable=import-error

sys.path.insert(0, str(REPO / "tests" / "fake_nvml"))
import nvml_state  # noqa: E402  pylint: disable=wrong-import-position,import-error

VENV, BARE = "it-pi-venv", "it-pi-bare"
TOTAL = 85899345920
RESERVED = 536870912
GPUS = {VENV: 2, BARE: 1}
SYSTEM_PYNVML = "/usr/local/lib/python3.11/dist-packages/pynvml.py"
STAMP = "/opt/gpufleet/nvml-venv/.gpufleet-complete"
PINNED = "nvidia-ml-py==13.615.71"  # roles/gpu_probe/defaults


def _wheel() -> Path:
    cache = Path(os.environ.get("GPUFLEET_CACHE") or REPO / ".cache")
    version = PINNED.split("==")[1]
    wheels = sorted((cache / "wheels").glob(f"nvidia_ml_py-{version}-*.whl"))
    assert wheels, f"no nvidia-ml-py {version} wheel in {cache / 'wheels'} (made by `make rootfs`)"
    return wheels[-1]


@pytest.fixture(scope="module")
def hosts(test_hosts, tmp_path_factory) -> TestHosts:
    reports = tmp_path_factory.mktemp("pi-reports")
    th = test_hosts([VENV, BARE], groups={"gpu": [VENV, BARE]},
                    hostvars={VENV: {"gpufleet_report_dir": str(reports)},
                              BARE: {"gpufleet_report_dir": str(reports), "vllm_runtime_wheelhouse": "/srv/wheelhouse"}})
    wheel = _wheel()
    for name, count in GPUS.items():
        state = nvml_state.new_state()
        state["system"].update(driver="560.35.03", cuda=12060, nvml="12.560.35.03")
        state["gpus"] = [nvml_state.make_gpu(i, TOTAL, reserved=RESERVED, name="NVIDIA H100") for i in range(count)]
        path = th.fake_nvml_state(name)
        with nvml_state.locked(path):
            nvml_state.save(path, state)
        th.harness.exec(name, ["rm", "-f", SYSTEM_PYNVML], check=True)
        assert th.harness.exec(name, ["python3", "-c", "import pynvml"]).returncode != 0
        target = Path(th.hosts[name].root) / ("srv/wheelhouse" if name == BARE else "root/wheels")
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, target / wheel.name)
    # the vLLM venv as vllm_runtime leaves it (the engine itself does not matter to the probe)
    th.harness.exec(VENV, ["python3", "-m", "venv", "/opt/vllm/venv"], check=True)
    th.harness.exec(VENV, ["/opt/vllm/venv/bin/pip", "install", "--no-index", "--disable-pip-version-check",
                           f"/root/wheels/{wheel.name}"], check=True)
    th.reports = reports  # type: ignore[attr-defined]
    return th


def probe_report(th: TestHosts, extra_vars: dict[str, Any] | None = None) -> tuple[int, dict[str, Any], str]:
    reports: Path = th.reports  # type: ignore[attr-defined]
    before = set(reports.glob("probe-*"))
    proc = th.playbook(REPO / "playbooks" / "probe.yml", extra_vars=extra_vars)
    runs = sorted(set(reports.glob("probe-*")) - before)
    out = proc.stdout[-5000:] + proc.stderr[-2000:]
    assert len(runs) == 1, out
    report = json.loads((runs[0] / "report.json").read_text(encoding="utf-8"))
    return proc.returncode, {h["host"]: h for h in report["probe"]["hosts"]}, out


def test_read_only_probe_installs_nothing_and_names_the_fix(hosts: TestHosts) -> None:
    rc, seen, out = probe_report(hosts)
    assert rc != 0, out
    error = " ".join(seen[BARE]["error"].split())
    assert "no Python interpreter here imports pynvml (package nvidia-ml-py)" in error, error
    assert "/opt/vllm/venv/bin/python3: not found" in error, error
    assert "/usr/bin/python3: ModuleNotFoundError: No module named 'pynvml'" in error, error
    assert "/opt/gpufleet/nvml-venv/bin/python: not found" in error, error
    assert "This play only reads and installs nothing: playbooks/runtime.yml installs the binding" in error, error
    assert f"else {PINNED} into /opt/gpufleet/nvml-venv), and so does playbooks/rollout.yml" in error, error
    assert hosts.harness.exec(BARE, ["test", "-e", "/opt/gpufleet"]).returncode != 0, "nothing installed"
    assert [g["index"] for g in seen[VENV]["gpus"]] == list(range(GPUS[VENV]))


def test_runtime_installs_the_pinned_binding_and_probe_uses_it(hosts: TestHosts) -> None:
    # an engine installed by hand, whose venv lacks the binding
    hosts.harness.exec(BARE, ["sh", "-c", "mkdir -p /opt/engine/bin && printf '#!/bin/sh\\nexit 0\\n' > /opt/engine/bin/vllm"
                              " && chmod 755 /opt/engine/bin/vllm"], check=True)
    proc = hosts.playbook(REPO / "playbooks" / "runtime.yml", extra_vars={
        "gpufleet_target": BARE, "vllm_runtime_install": False, "vllm_runtime_executable": "/opt/engine/bin/vllm",
        "gpufleet_vllm_executable": "/opt/engine/bin/vllm"})
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    stamp = json.loads(hosts.harness.exec(BARE, ["cat", STAMP], check=True).stdout)
    assert stamp["wheelhouse"] == "/srv/wheelhouse" and stamp["package"] == PINNED, stamp
    assert hosts.harness.exec(BARE, ["/opt/gpufleet/nvml-venv/bin/python", "-c",
                                     "from importlib.metadata import version; print(version('nvidia-ml-py'))"],
                              check=True).stdout.strip() == PINNED.split("==")[1]
    stamp_id = hosts.harness.exec(BARE, ["stat", "-c", "%Y.%i", STAMP], check=True).stdout

    rc, seen, out = probe_report(hosts)
    assert rc == 0, out
    for name, count in GPUS.items():
        assert not seen[name].get("error"), seen[name]
        assert [g["total_bytes"] for g in seen[name]["gpus"]] == [TOTAL] * count
    # the venv host did not need the small venv; the bare host's is used as it is
    assert hosts.harness.exec(VENV, ["test", "-e", "/opt/gpufleet"]).returncode != 0
    assert hosts.harness.exec(BARE, ["stat", "-c", "%Y.%i", STAMP], check=True).stdout == stamp_id
    hosts.stamp = stamp_id  # type: ignore[attr-defined]


def test_role_reports_the_interpreter_it_chose(hosts: TestHosts, tmp_path: Path) -> None:
    out = tmp_path / "chosen"
    playbook = tmp_path / "role.yml"
    playbook.write_text(f"""
- name: Probe with the role's defaults
  hosts: gpu
  gather_facts: false
  roles:
    - role: gpufleet.vllm.gpu_probe
      vars:
        gpu_probe_fail_on_error: true
  post_tasks:
    - name: Keep what was chosen
      ansible.builtin.copy:
        dest: "{out}-{{{{ inventory_hostname }}}}.json"
        mode: "0600"
        content: "{{{{ {{'interpreter': gpu_probe_interpreter, 'gpus': gpufleet_gpus | length}} | to_json }}}}"
      delegate_to: localhost
""", encoding="utf-8")
    proc = hosts.playbook(playbook)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    chosen = {name: json.loads(Path(f"{out}-{name}.json").read_text(encoding="utf-8")) for name in GPUS}
    assert chosen[VENV] == {"interpreter": "/opt/vllm/venv/bin/python3", "gpus": GPUS[VENV]}
    assert chosen[BARE] == {"interpreter": "/opt/gpufleet/nvml-venv/bin/python", "gpus": GPUS[BARE]}
    # the small venv of the run before is used as it is, not built again
    stamp = hosts.harness.exec(BARE, ["stat", "-c", "%Y.%i", STAMP], check=True).stdout
    assert stamp == hosts.stamp, "kept, not rebuilt"  # type: ignore[attr-defined]
