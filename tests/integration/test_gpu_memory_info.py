"""gpu_memory_info, gpu_memory_facts and the gpu_probe role on real systemd test hosts, over SSH.

Inside each guest the real pynvml loads the fake libnvidia-ml.so.1 (bound where the
driver puts it) which reads /etc/fake-nvml/state, written here with nvml_state.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, TestHosts  # pylint: disable=import-error

sys.path.insert(0, str(REPO / "tests" / "fake_nvml"))
import nvml_state  # noqa: E402  pylint: disable=wrong-import-position,import-error
import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error

A, B = "it-gmi-a", "it-gmi-b"
GIB = 1 << 30
TOTAL = 150754820096
RESERVED = 566231040
UNIT = "gmi-engine.service"


@pytest.fixture(scope="module")
def hosts(test_hosts) -> TestHosts:
    return test_hosts([A, B], groups={"gpu": [A, B]})


def write_state(th: TestHosts, name: str, gpus: int = 4, **system: Any) -> dict[str, Any]:
    state = nvml_state.new_state()
    state["system"].update(driver="560.35.03", cuda=12060, nvml="12.560.35.03", **system)
    state["gpus"] = [nvml_state.make_gpu(i, TOTAL, reserved=RESERVED, name="NVIDIA H200") for i in range(gpus)]
    path = th.fake_nvml_state(name)
    with nvml_state.locked(path):
        nvml_state.save(path, state)
    return state


def update_state(th: TestHosts, name: str, change) -> None:
    path = th.fake_nvml_state(name)
    with nvml_state.locked(path):
        state = nvml_state.load(path)
        change(state)
        nvml_state.save(path, state)


def adhoc(th: TestHosts, pattern: str, args: str, module: str = "gpu_memory_info") -> dict[str, dict[str, Any]]:
    """Run ``module`` (gpu_memory_info by default) ad hoc; returns every host's result, failed or not."""
    with tempfile.TemporaryDirectory(prefix="gmi-") as tree:
        argv = ["ansible", "-i", str(th.inventory), pattern, "-m", f"gpufleet.vllm.{module}",
                "-a", args, "--tree", tree]
        env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="False")
        proc = procgroup.run(argv, env=env, timeout=300)
        results = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in Path(tree).iterdir()}
    assert results, f"no result from ansible (rc {proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    # the tree callback drops the "failed" key: ansible's exit status (2) says a host failed
    for result in results.values():
        result.setdefault("failed", "gpus" not in result and proc.returncode == 2)
        result["_output"] = proc.stdout + proc.stderr  # warnings are printed, not kept in the tree
    return results


def guest(th: TestHosts, name: str, command: str) -> str:
    proc = th.harness.exec(name, ["/bin/sh", "-c", command], check=True)
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def engine_unit(hosts: TestHosts) -> dict[str, int]:
    """A real systemd unit in guest A: a shell (MainPID) with a `sleep` child in its cgroup."""
    guest(hosts, A, f"printf '%s\\n' '[Service]' 'ExecStart=/bin/sh -c \"sleep 3600 & wait\"' > /etc/systemd/system/{UNIT}"
                    f" && systemctl daemon-reload && systemctl start {UNIT}")
    main_pid = int(guest(hosts, A, f"systemctl show -p MainPID --value {UNIT}"))
    deadline = time.monotonic() + 10
    child = ""
    while not child and time.monotonic() < deadline:
        child = guest(hosts, A, "for d in /proc/[0-9]*; do set -- $(cat $d/stat 2>/dev/null); "
                                f"[ \"$4\" = {main_pid} ] && [ \"$2\" = '(sleep)' ] && echo ${{d#/proc/}}; done; true")
        time.sleep(0.1)
    assert child, "the unit's sleep child did not start"
    yield {"main": main_pid, "child": int(child.split()[0])}
    guest(hosts, A, f"systemctl stop {UNIT} || true")


def test_several_gpus_with_cotenants_and_our_own_unit(hosts: TestHosts, engine_unit: dict[str, int]) -> None:
    write_state(hosts, A, gpus=4)

    def add(state: dict[str, Any]) -> None:
        nvml_state.add_process(state, gpu=0, pid=1, used=3 * GIB, name="embedder")          # co-tenant
        nvml_state.add_process(state, gpu=1, pid=engine_unit["child"], used=40 * GIB)       # our engine
        nvml_state.add_process(state, gpu=1, pid=engine_unit["main"], used=GIB, kind="both")
        # a pid this host's /proc does not show (a container's process)
        nvml_state.add_process(state, gpu=3, pid=99999, used=512 << 20, kind="graphics", pidns="other")

    update_state(hosts, A, add)
    result = adhoc(hosts, A, f"service_units={UNIT} samples=3 interval=0.1")[A]
    assert result["failed"] is False, result.get("msg")
    assert result["changed"] is False
    assert result["driver_version"] == "560.35.03"
    assert result["cuda_driver_version"] == "12.6"
    assert result["nvml_version"] == "12.560.35.03"
    gpus = result["gpus"]
    assert [g["index"] for g in gpus] == [0, 1, 2, 3]
    assert {engine_unit["main"], engine_unit["child"]} <= set(result["own_pids"])
    free = TOTAL - RESERVED
    g0, g1, g2, g3 = gpus
    assert g0["free_bytes"] == free - 3 * GIB and g0["boot_free_bytes"] == g0["free_bytes"]
    assert [(p["pid"], p["own"], p["name"]) for p in g0["processes"]] == [(1, False, "systemd")]
    assert g1["free_bytes"] == free - 41 * GIB
    assert g1["own_used_bytes"] == 41 * GIB
    assert g1["boot_free_bytes"] == free
    procs = {p["pid"]: p for p in g1["processes"]}
    assert procs[engine_unit["child"]]["own"] and procs[engine_unit["child"]]["name"] == "sleep"
    assert procs[engine_unit["main"]]["own"] and procs[engine_unit["main"]]["kinds"] == ["compute", "graphics"]
    assert g2["processes"] == [] and g2["boot_free_bytes"] == free
    assert g3["processes"][0]["name"] is None and g3["processes"][0]["own"] is False
    for gpu in gpus:
        assert gpu["samples"] == 3 and gpu["free_min_bytes"] == gpu["free_max_bytes"] == gpu["free_bytes"]
        assert gpu["reserved_bytes"] == RESERVED and gpu["memory_info_version"] == 2
        assert gpu["name"] == "NVIDIA H200" and gpu["compute_capability"] == "9.0"
    # (ansible_facts may still hold the interpreter Ansible discovered)
    assert not {"gpufleet_gpus", "gpufleet_nvml"} & set(result.get("ansible_facts") or {}), "gpu_memory_info sets no facts"
    # the same probe through gpu_memory_facts: the same result, kept as facts
    with_facts = adhoc(hosts, A, f"service_units={UNIT} samples=3 interval=0.1", module="gpu_memory_facts")[A]
    assert with_facts["failed"] is False, with_facts.get("msg")
    assert with_facts["gpus"] == gpus and with_facts["own_pids"] == result["own_pids"]
    facts = with_facts["ansible_facts"]
    assert facts["gpufleet_gpus"] == gpus
    assert facts["gpufleet_nvml"]["host"] == A


def test_devices_by_index_and_uuid_in_order(hosts: TestHosts) -> None:
    write_state(hosts, B, gpus=4)
    uuid2 = nvml_state.make_gpu(2, TOTAL)["uuid"]
    result = adhoc(hosts, B, f"devices=3,{uuid2},0")[B]
    assert [g["index"] for g in result["gpus"]] == [3, 2, 0]
    failed = adhoc(hosts, B, "devices=1,1")[B]
    assert failed["failed"] is True and "GPU 1 is listed twice" in failed["msg"]
    failed = adhoc(hosts, B, "devices=7")[B]
    assert failed["msg"] == f"{B}: GPU 7 does not exist (4 GPUs, indices 0-3)"


def test_sampling_sees_free_memory_move(hosts: TestHosts) -> None:
    write_state(hosts, B, gpus=2)
    update_state(hosts, B, lambda s: s["gpus"][1].update(noise=[0, 700 << 20, 200 << 20]))
    result = adhoc(hosts, B, "samples=4 interval=0.05")[B]
    g0, g1 = result["gpus"]
    assert g0["free_min_bytes"] == g0["free_max_bytes"]
    assert g1["free_max_bytes"] - g1["free_min_bytes"] == 700 << 20
    assert g1["samples"] == 4
    assert g1["boot_free_bytes"] == g1["free_min_bytes"]  # no own process: the dip bounds the boot


@pytest.mark.parametrize(("setup", "message"), [
    (lambda s: s["gpus"][2].update(error=15), f"{B}: GPU 2: opening the GPU: GPU is lost"),
    (lambda s: s["gpus"][1].update(error=16), f"{B}: GPU 1: opening the GPU: GPU requires a reset"),
    (lambda s: s["system"].update(init_error=9), f"{B}: NVIDIA driver not loaded"),
    (lambda s: s["system"].update(init_error=4), f"{B}: no permission to query NVML"),
    (lambda s: s["gpus"][0].update(free_override=TOTAL + 1),
     f"{B}: GPU 0 (GPU-00000000-0000-4000-8000-000000000000): NVML reports impossible memory figures"),
])
def test_error_paths_name_host_and_gpu(hosts: TestHosts, setup, message: str) -> None:
    write_state(hosts, B, gpus=3)
    update_state(hosts, B, setup)
    result = adhoc(hosts, B, "samples=1")[B]
    assert result["failed"] is True
    assert result["msg"].startswith(message), result["msg"]
    assert "Traceback" not in result["msg"]


def test_old_driver_without_v2_memory_degrades_with_warning(hosts: TestHosts) -> None:
    write_state(hosts, B, gpus=1, missing=["nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetComputeRunningProcesses_v3"])
    update_state(hosts, B, lambda s: nvml_state.add_process(s, gpu=0, pid=1, used=GIB))
    result = adhoc(hosts, B, "samples=1")[B]
    assert result["failed"] is False, result.get("msg")
    gpu = result["gpus"][0]
    assert gpu["memory_info_version"] == 1 and gpu["reserved_bytes"] is None
    assert gpu["used_bytes"] == RESERVED + GIB  # v1 folds the reserve into used
    assert [p["pid"] for p in gpu["processes"]] == [1]  # listed through the _v2 call
    assert "nvmlDeviceGetMemoryInfo_v2 unavailable" in " ".join(result["_output"].split())


def test_missing_state_means_no_driver(hosts: TestHosts) -> None:
    path = hosts.fake_nvml_state(B)
    with nvml_state.locked(path):
        path.unlink(missing_ok=True)
    result = adhoc(hosts, B, "samples=1")[B]
    assert result["failed"] is True and result["msg"].startswith(f"{B}: NVIDIA driver not loaded")


def test_role_groups_hosts_and_keeps_going(hosts: TestHosts, tmp_path: Path) -> None:
    write_state(hosts, A, gpus=2)
    update_state(hosts, A, lambda s: nvml_state.add_process(s, gpu=1, pid=1, used=2 * GIB))
    write_state(hosts, B, gpus=2, init_error=9)
    out = tmp_path / "probe.json"
    playbook = tmp_path / "probe.yml"
    playbook.write_text(f"""
- name: Probe
  hosts: gpu
  gather_facts: false
  roles:
    - role: gpufleet.vllm.gpu_probe
      vars:
        gpu_probe_samples: 2
        gpu_probe_interval: 0.1

- name: Record what the probe left
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Write groups and facts
      ansible.builtin.copy:
        dest: {out}
        mode: "0600"
        content: >-
          {{{{ {{'ok': groups.gpu_probe_ok | default([]), 'failed': groups.gpu_probe_failed | default([]),
              'gpus': hostvars['{A}'].gpufleet_gpus | default(none),
              'error_a': hostvars['{A}'].gpu_probe_error, 'error_b': hostvars['{B}'].gpu_probe_error}} | to_json }}}}
""")
    proc = hosts.playbook(playbook)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    seen = json.loads(out.read_text())
    assert seen["ok"] == [A] and seen["failed"] == [B]
    assert seen["error_a"] == ""
    assert seen["error_b"].startswith(f"{B}: NVIDIA driver not loaded")
    assert [g["index"] for g in seen["gpus"]] == [0, 1]
    assert seen["gpus"][1]["used_bytes"] == 2 * GIB and seen["gpus"][1]["samples"] == 2


def test_role_installs_the_binding_into_a_venv(tmp_path: Path) -> None:
    """gpu_probe_install_binding on a local host: venv + pip from a local wheel, then the
    probe runs with that venv's python (the fake library found through LD_LIBRARY_PATH)."""
    cache = Path(os.environ.get("GPUFLEET_CACHE") or REPO / ".cache")
    wheels = sorted((cache / "wheels").glob("nvidia_ml_py-*.whl"))
    assert wheels, f"no nvidia-ml-py wheel in {cache / 'wheels'} (made by `make rootfs`)"
    state_path = tmp_path / "state"
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(i, TOTAL, reserved=RESERVED) for i in range(2)]
    nvml_state.add_process(state, gpu=0, pid=os.getpid(), used=GIB)
    nvml_state.save(state_path, state)
    venv = tmp_path / "nvml-venv"
    out = tmp_path / "facts.json"
    playbook = tmp_path / "install.yml"
    playbook.write_text(f"""
- name: Install the binding and probe
  hosts: localhost
  connection: local
  gather_facts: false
  vars:
    ansible_python_interpreter: "{{{{ ansible_playbook_python }}}}"
  roles:
    - role: gpufleet.vllm.gpu_probe
      vars:
        gpu_probe_python: /usr/bin/python3
        gpu_probe_install_binding: true
        gpu_probe_binding_package: {wheels[-1]}
        gpu_probe_binding_venv: {venv}
        gpu_probe_pip_extra_args: --no-index
        gpu_probe_fail_on_error: true
  post_tasks:
    - name: Keep the facts
      ansible.builtin.copy:
        dest: {out}
        mode: "0600"
        content: "{{{{ {{'gpus': gpufleet_gpus, 'interpreter': gpu_probe_interpreter}} | to_json }}}}"
""")
    env = dict(os.environ, LD_LIBRARY_PATH=str(cache / "fake-nvml"), FAKE_NVML_STATE=str(state_path))
    proc = procgroup.run(["ansible-playbook", "-i", "localhost,", str(playbook)], env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    seen = json.loads(out.read_text())
    assert seen["interpreter"] == f"{venv}/bin/python"
    assert (venv / "bin" / "python").exists()
    assert [g["index"] for g in seen["gpus"]] == [0, 1]
    assert seen["gpus"][0]["used_bytes"] == GIB


def test_unknown_unit_is_a_warning_not_an_error(hosts: TestHosts) -> None:
    write_state(hosts, B, gpus=1)
    result = adhoc(hosts, B, "service_units=vllm-typo.service")[B]
    assert result["failed"] is False, result.get("msg")
    assert result["own_pids"] == []
    assert "systemd unit 'vllm-typo.service' not found" in " ".join(result["_output"].split())
