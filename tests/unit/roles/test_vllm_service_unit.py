# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vllm_service unit template: ExecStart for manual, auto_profile and multi-instance
plans, quoting, hardening, and `systemd-analyze verify` on the rendered units.

The template is rendered by ansible-playbook itself (the real template engine and
filters), with the role's defaults loaded first, as the role does.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._units._gang import member_launch, parse

ROOT = pathlib.Path(__file__).resolve().parents[3]
ROLE = ROOT / "roles" / "vllm_service"
BIN = pathlib.Path(sys.executable).parent

PLAN_MANUAL = {
    "decision": "deploy",
    "kv_cache_memory_bytes": 30333206528,
    "gpu_memory_utilization": 0.2854,
    "free_floor_bytes": {"0": 43754979328, "1": 43754979328},
    "kv_cache_tokens": 231424,
    "num_blocks": 14464,
}
GANG = {"mode": "mp", "members": ["a1", "a2"], "address": "10.20.0.11", "interface": "ib0"}
# the gang's plan: one engine of four ranks, its floors keyed by the rank in the whole instance (the follower's are 2 and 3)
PLAN_GANG = dict(PLAN_MANUAL, free_floor_bytes={str(r): 43754979328 + r for r in range(4)})
PLAN_AUTO = {"decision": "auto_profile", "kv_cache_memory_bytes": None, "gpu_memory_utilization": None, "reasons": ["moves"]}

CASES = {
    "manual": {
        "vllm_service_instance": {"name": "vllm", "gpus": [0, 1], "port": 8000},
        "vllm_service_plan": PLAN_MANUAL,
        "vllm_service_serve_args": {
            "tensor_parallel_size": 2,
            "max_model_len": 8192,
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]},
            "served_model_name": ["llama", "llama 8b"],
        },
        "vllm_service_env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NOTE": "50% $HOME"},
    },
    "auto": {
        "vllm_service_instance": {"name": "vllm", "gpus": [0], "port": 8000},
        "vllm_service_plan": PLAN_AUTO,
        "vllm_service_serve_args": {"max_model_len": 4096},
    },
    "multi_a": {
        "vllm_service_instance": {"name": "a", "gpus": [0, 1], "port": 8000},
        "vllm_service_plan": PLAN_MANUAL,
        "vllm_service_serve_args": {"tensor_parallel_size": 2},
    },
    "multi_b": {
        "vllm_service_instance": {"name": "b", "gpus": [2, 3], "port": 8001},
        "vllm_service_plan": PLAN_MANUAL,
        "vllm_service_serve_args": {"tensor_parallel_size": 2},
    },
    # the follower of a tensor x pipeline parallel instance over two hosts, on a host with InfiniBand devices; its
    # launch stays set for the cases after it, whose instances have other names
    "gang_follower": {
        "vllm_service_instance": {"name": "dsv3", "gpus": [0, 1], "port": 8000, "gang": GANG},
        "vllm_service_plan": PLAN_GANG,
        "vllm_service_serve_args": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
        "vllm_service_gang_launch": {"dsv3": member_launch(
            parse(GANG, field="gang", serve_args={"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
                  gpus={"a1": 2, "a2": 2}, member_addresses={"a2": "10.20.0.12"}), "a2", infiniband=True)},
    },
    # last: its probe facts (gpufleet_gpus) stay set for the cases after it; the follower's launch is still set (its
    # floors come out of the gang's plan), and an instance of another name gets none of its rank arguments
    "probed": {
        "vllm_service_instance": {"name": "b", "gpus": [2, 3], "port": 8001},
        "vllm_service_plan": PLAN_GANG,
        "vllm_service_serve_args": {"tensor_parallel_size": 2},
        "gpufleet_gpus": [{"index": i, "uuid": f"GPU-{i}a5b0c1d-2e3f-4a5b-8c7d-9e0f1a2b3c4d"} for i in range(4)],
    },
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """Render every case in one ansible-playbook run; return {case: unit text}."""
    playbook_bin = BIN / "ansible-playbook"
    if not playbook_bin.exists():
        playbook_bin = pathlib.Path(shutil.which("ansible-playbook") or "ansible-playbook")
    out = tmp_path_factory.mktemp("units")
    exe = out / "vllm"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    gate = out / "gate"
    gate.write_text("#!/bin/sh\nexit 0\n")
    gate.chmod(0o755)
    tasks = [{"name": "Load the role defaults", "ansible.builtin.include_vars": str(ROLE / "defaults" / "main.yml")},
             {"name": "Load the role's internal vars", "ansible.builtin.include_vars": str(ROLE / "vars" / "main.yml")}]
    for case, facts in CASES.items():
        facts = dict(facts, vllm_service_executable=str(exe), vllm_service_model="/srv/models/llama 3",
                     vllm_service_boot_gate_bin=str(gate))
        tasks.append({"name": f"Facts {case}", "ansible.builtin.set_fact": facts})
        # as the role renders it (tasks/render.yml, the content vllm_unit writes)
        tasks.append({"name": f"Render {case}",
                      "ansible.builtin.include_role": {"name": "gpufleet.vllm.vllm_service", "tasks_from": "render"},
                      "vars": {"vllm_service_instances": [facts["vllm_service_instance"]]}})
        tasks.append({"name": f"Write {case}",
                      "ansible.builtin.copy": {"content": "{{ vllm_service_rendered[0].unit }}",
                                               "dest": str(out / f"{case}.service"), "mode": "0644"}})
        tasks.append({"name": f"Write {case}'s plan file",
                      "ansible.builtin.copy": {"content": "{{ vllm_service_rendered[0].plan | to_json }}",
                                               "dest": str(out / f"{case}.plan.json"), "mode": "0644"}})
        # as the template module renders it (units written by earlier releases)
        tasks.append({"name": f"Render {case} with the template module",
                      "ansible.builtin.template": {"src": str(ROLE / "templates" / "vllm.service.j2"),
                                                   "dest": str(out / f"{case}.template.service"), "mode": "0644"}})
    play = [{"hosts": "localhost", "connection": "local", "gather_facts": False, "tasks": tasks}]
    pb = out / "render.yml"
    pb.write_text(json.dumps(play))
    # The template uses the collection's filters: make this checkout gpufleet.vllm.
    collections = out / "collections"
    (collections / "ansible_collections" / "gpufleet").mkdir(parents=True)
    os.symlink(ROOT, collections / "ansible_collections" / "gpufleet" / "vllm")
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    argv = [str(playbook_bin), "-i", "localhost,", "-e", f"ansible_python_interpreter={sys.executable}", str(pb)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {case: (out / f"{case}.service").read_text() for case in CASES}, out


def test_role_renders_as_the_template_module(rendered):
    """A unit deployed by the template module is byte-equal to the role's rendering: no spurious redeploy."""
    units, out = rendered
    for case, text in units.items():
        assert text == (out / f"{case}.template.service").read_text(), case


def exec_start(text: str, gate: bool = False) -> list[str]:
    """The engine's ExecStart words (continuation lines joined, systemd's quoting undone);
    with ``gate``, the boot gate's words before the engine's instead."""
    joined = text.replace("\\\n", " ")
    line = next(l for l in joined.splitlines() if l.startswith("ExecStart="))
    words = shlex.split(line[len("ExecStart="):].replace("%%", "%").replace("$$", "$"))
    if "--" in words and words[0].endswith("gate"):
        cut = words.index("--")
        return words[:cut] if gate else words[cut + 1:]
    return [] if gate else words


def option(words: list[str], flag: str) -> str | None:
    return words[words.index(flag) + 1] if flag in words else None


def test_manual_budget_exec_start(rendered):
    units, out = rendered
    words = exec_start(units["manual"])
    assert words[0] == str(out / "vllm")
    assert words[1:3] == ["serve", "/srv/models/llama 3"]
    assert option(words, "--kv-cache-memory-bytes") == "30333206528"
    assert option(words, "--gpu-memory-utilization") == "0.2854"
    assert option(words, "--host") == "0.0.0.0" and option(words, "--port") == "8000"
    assert option(words, "--tensor-parallel-size") == "2"
    assert option(words, "--max-model-len") == "8192"
    assert "--enforce-eager" in words
    # false is rendered, not dropped: prefix caching defaults to on in vLLM.
    assert "--enable-prefix-caching" not in words
    assert "--no-enable-prefix-caching" in words
    assert json.loads(option(words, "--compilation-config")) == {"cudagraph_capture_sizes": [1, 2, 4]}
    i = words.index("--served-model-name")
    assert words[i + 1 : i + 3] == ["llama", "llama 8b"]
    assert "Environment=CUDA_VISIBLE_DEVICES=0,1" in units["manual"]
    assert "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID" in units["manual"]
    assert 'Environment="NOTE=50%% $HOME"' in units["manual"]


def test_manual_units_start_through_the_boot_gate(rendered):
    """The gate is the main process (it execs the engine): its refusal status stops the restarts."""
    units, out = rendered
    for case in ("manual", "multi_a", "multi_b"):
        name = {"manual": "vllm", "multi_a": "a", "multi_b": "b"}[case]
        words = exec_start(units[case], gate=True)
        assert words[0] == str(out / "gate")
        assert option(words, "--plan") == f"/etc/gpufleet/{name}.plan.json"
        assert option(words, "--policy") == "shrink"
        assert option(words, "--state") == f"/var/lib/gpufleet-vllm/{name}.boot-gate.json"
        lines = units[case].splitlines()
        assert "RestartPreventExitStatus=78" in lines and "StateDirectory=gpufleet-vllm" in lines
    assert exec_start(units["auto"], gate=True) == []
    assert "RestartPreventExitStatus=78" not in units["auto"]


def test_auto_profile_has_no_byte_budget(rendered):
    units = rendered[0]
    words = exec_start(units["auto"])
    assert "--kv-cache-memory-bytes" not in words
    assert option(words, "--gpu-memory-utilization") == "0.9"
    assert "plan decision: auto_profile" in units["auto"]


def test_multi_instance_units_differ_in_gpus_and_port(rendered):
    units = rendered[0]
    a, b = exec_start(units["multi_a"]), exec_start(units["multi_b"])
    assert option(a, "--port") == "8000" and option(b, "--port") == "8001"
    assert "Environment=CUDA_VISIBLE_DEVICES=0,1" in units["multi_a"]
    assert "Environment=CUDA_VISIBLE_DEVICES=2,3" in units["multi_b"]
    assert "EnvironmentFile=/etc/gpufleet/vllm-a.env" in units["multi_a"]
    # with the probe's UUIDs the same instance names its cards by UUID, in rank order
    uuids = "GPU-2a5b0c1d-2e3f-4a5b-8c7d-9e0f1a2b3c4d,GPU-3a5b0c1d-2e3f-4a5b-8c7d-9e0f1a2b3c4d"
    assert f"Environment=CUDA_VISIBLE_DEVICES={uuids}" in units["probed"]
    assert "EnvironmentFile=/etc/gpufleet/vllm-b.env" in units["multi_b"]
    assert option(a, "--kv-cache-memory-bytes") == option(b, "--kv-cache-memory-bytes") == "30333206528"


def test_a_gang_member_runs_its_rank_at_its_address_with_the_devices_nccl_needs(rendered):
    """The follower's unit: its rank arguments, headless; its own address and the socket
    interface; locked memory for NCCL and the InfiniBand devices next to the GPUs; the rest of the sandbox as closed
    as a one-host instance's. The one-host units get none of it."""
    text = rendered[0]["gang_follower"]
    words = exec_start(text)
    rank = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.20.0.11", "--master-port", "29501", "--headless"]
    assert [words[i:i + len(rank)] for i in range(len(words)) if words[i] == "--nnodes"] == [rank], words
    assert option(words, "--tensor-parallel-size") == "2" and option(words, "--pipeline-parallel-size") == "2"
    lines = text.splitlines()
    for line in ("Environment=VLLM_HOST_IP=10.20.0.12", "Environment=NCCL_SOCKET_IFNAME=ib0", "Environment=GLOO_SOCKET_IFNAME=ib0",
                 "LimitMEMLOCK=infinity", "DeviceAllow=char-nvidia* rw", "DeviceAllow=char-infiniband_verbs rw",
                 "DeviceAllow=/dev/infiniband/rdma_cm rw", "DevicePolicy=closed", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK"):
        assert line in lines, line
    for case in ("manual", "multi_a", "probed"):
        assert not [l for l in rendered[0][case].splitlines() if "VLLM_HOST_IP" in l or "MEMLOCK" in l or "infiniband" in l], case
    # its plan file holds the floors of its own ranks (2 and 3 of the gang's plan), keyed by its GPUs as its gates read them
    plan = json.loads((rendered[1] / "gang_follower.plan.json").read_text())
    assert plan["launch"]["free_floor_bytes"] == {"0": 43754979330, "1": 43754979331} and plan["gpus"] == [0, 1], plan["launch"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_hardening_and_restart_policy(rendered, case):
    text = rendered[0][case]
    for line in (
        "User=vllm",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ReadWritePaths=/var/lib/vllm",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "DevicePolicy=closed",
        "DeviceAllow=char-nvidia* rw",
        "Restart=on-failure",
        "StartLimitBurst=3",
        "CapabilityBoundingSet=",
    ):
        assert line in text.splitlines(), f"{case}: missing {line}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("case", sorted(CASES))
def test_systemd_analyze_verify_accepts_the_unit(rendered, case):
    out = rendered[1]
    unit = out / f"vllm-{case.replace('_', '-')}.service"
    shutil.copy(out / f"{case}.service", unit)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    problems = [l for l in proc.stderr.splitlines() if str(unit.name) in l or "Unknown" in l or "Invalid" in l]
    assert not problems, problems


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_rejects_a_broken_unit(rendered):
    out = rendered[1]
    bad = out / "vllm-broken.service"
    bad.write_text(rendered[0]["manual"].replace(f"ExecStart={out / 'gate'}", "ExecStart=relative/vllm"))
    proc = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert "relative/vllm" in proc.stderr
