# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The EXAMPLES of the modules that run on a GPU host, as ansible-doc shows them, run on a
simulated GPU host.

One systemd guest is created with sim/fleetctl.py: four H200 GPUs from the fake NVML
library, the simulated engine at /opt/vllm/venv/bin/vllm and the model config under
/srv/models (as tests/integration/test_sim_fidelity.py and test_rollout.py set them up).
The test provides what the examples name and a real host would have: the vLLM
virtual environment's interpreter (gpu_memory_info, gpu_memory_facts), engines already running as the
units the examples check (vllm_boot_check, with the plan kv_plan gives), a unit
template and a token (vllm_unit). Every example task must run and succeed.
The controller-side examples run in tests/unit/test_doc_examples.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._geometry import geometry_from_config
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "examples"))

import doc_examples  # noqa: E402  pylint: disable=wrong-import-position,import-error

HOST = "sim-docex"
GIB = 1 << 30
MODEL = "/srv/models/llama-3.1-8b-instruct"
MODEL_CONFIG = REPO / "sim" / "models" / "llama-3.1-8b-instruct" / "config.json"
TOTAL = 150754820096
RESERVED = 644939776
CUDA_CONTEXT = 650969088

FLEET = {
    "engine": {
        "boot_delay_s": 0.5,
        "token_delay_s": 0.004,
        "costs": {"cuda_context_bytes": CUDA_CONTEXT, "peak_activation_bytes": "1.25GiB", "non_torch_bytes": "600MiB",
                  "cuda_graph_bytes": "0.75GiB"},
    },
    "system": {"driver": "580.159.04", "cuda": 13000, "nvml": "13.580.159.04"},
    "gpu_models": {"h200": {"name": "NVIDIA H200", "total": TOTAL, "reserved": RESERVED, "cc": "9.0"}},
    "classes": {"docex-h200": {"gpu_model": "h200", "gpus": 4, "model": "llama-3.1-8b-instruct"}},
    "hosts": {HOST: {"class": "docex-h200", "base_used": [0, 0, 0, 0]}},
}

# What vllm_unit's examples render with lookup('template', 'vllm.service.j2').
UNIT_TEMPLATE = """[Unit]
Description=vLLM instance main
After=network-online.target

[Service]
User=vllm
Environment=CUDA_VISIBLE_DEVICES=0
EnvironmentFile=/etc/gpufleet/vllm-main.env
ExecStart=/opt/vllm/venv/bin/vllm serve {model} --port 8000 --max-model-len 8192

[Install]
WantedBy=multi-user.target
"""


def _fleetctl():
    spec = importlib.util.spec_from_file_location("gpufleet_sim_fleetctl_docex", REPO / "sim" / "fleetctl.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def collections_path(tmp_path_factory):
    return doc_examples.make_collections_tree(tmp_path_factory.mktemp("collections"))


@pytest.fixture(scope="module")
def texts(collections_path) -> dict[str, str]:
    return doc_examples.examples(collections_path, "module",
                                 ["gpu_memory_facts", "gpu_memory_info", "nvml_interpreter", "vllm_account", "vllm_audit", "vllm_boot_check", "vllm_canary",
                                  "vllm_host_snapshot", "vllm_host_tools", "vllm_runtime_info", "vllm_unit"])


@pytest.fixture(scope="module")
def sim(harness, tmp_path_factory):  # harness: conftest (root + rootfs)
    workdir = tmp_path_factory.mktemp("docex")
    fleet_file = workdir / "fleet.yml"
    fleet_file.write_text(yaml.safe_dump(FLEET), encoding="utf-8")
    fleet = _fleetctl().Fleet(fleet_file)
    try:
        fleet.create(reset_state=True)
        # A vLLM virtual environment ships nvidia-ml-py; the guest's one is the system interpreter's.
        fleet.h.exec(HOST, ["ln", "-sf", "/usr/bin/python3", "/opt/vllm/venv/bin/python"], check=True)
        inventory = workdir / "inventory.yml"
        inventory.write_text(yaml.safe_dump(harness.inventory_data(names=[HOST])), encoding="utf-8")
        fleet.inventory = inventory
        yield fleet
    finally:
        fleet.destroy()


def run(sim, collections_path, tmp_path, playbook: list[dict[str, Any]]):
    return doc_examples.run_playbook(playbook, tmp_path, collections_path, inventory=sim.inventory,
                                     env={"ANSIBLE_PIPELINING": "1"})


def keep(path: Path, expression: str) -> dict[str, Any]:
    """A task writing ``expression`` as JSON to ``path`` on the controller."""
    return {
        "name": f"Keep the results in {path.name}",
        "ansible.builtin.copy": {"dest": str(path), "content": "{{ %s | to_json }}" % expression, "mode": "0644"},
        "delegate_to": "localhost",
    }


def test_vllm_canary_examples(sim, collections_path, texts, tmp_path):
    out = tmp_path / "canary.json"
    results = "{'profiled': profiled, 'manual': manual, 'taken_over': taken_over}"
    playbook = doc_examples.module_playbook(texts["vllm_canary"], HOST, post_tasks=[keep(out, results)])
    proc = run(sim, collections_path, tmp_path, playbook)
    doc_examples.assert_examples_ran(proc, texts["vllm_canary"])
    got = json.loads(out.read_text(encoding="utf-8"))
    assert got["profiled"]["verdict"] == "pass" and got["manual"]["verdict"] == "pass", got["manual"]["reasons"]
    assert got["manual"]["kv_cache_memory_bytes"] == min(r["suggested_kv_bytes_fit"] for r in got["profiled"]["ranks"])
    assert got["manual"]["comparison"]["token_ratio"] >= 0.9
    # no instance main serves on this host: nothing stopped or held; NVML read just before the boot
    taken = got["taken_over"]
    assert taken["verdict"] == "pass" and taken["takeover"]["instance_serving"] is False and taken["takeover"]["stopped"] == []
    assert [g["index"] for g in taken["gpu_probe"]["gpus"]] == [0], taken["gpu_probe"]
    # nothing left running on the GPUs
    state = json.loads(sim.h.exec(HOST, ["python3", "-c", NVML_PROCS], check=True).stdout)
    assert state == [[], [], [], []]


def test_vllm_runtime_info_examples(sim, collections_path, texts, tmp_path):
    """On the simulated host the venv's python is the system one: no vLLM, a real model config."""
    out = tmp_path / "runtime.json"
    playbook = doc_examples.module_playbook(texts["vllm_runtime_info"], HOST, post_tasks=[keep(out, "runtime")])
    proc = run(sim, collections_path, tmp_path, playbook)
    doc_examples.assert_examples_ran(proc, texts["vllm_runtime_info"])
    got = json.loads(out.read_text(encoding="utf-8"))
    assert got["vllm_version"] is None and got["missing_libraries"] == []
    assert got["base_python"].startswith("/usr/bin/python3")
    assert got["model_files"]["config.json"]["sha256"] == hashlib.sha256(MODEL_CONFIG.read_bytes()).hexdigest()
    assert got["compat"] == {"model_fingerprint": got["model_fingerprint"]}


NVML_PROCS = """
import json, pynvml
pynvml.nvmlInit()
print(json.dumps([[p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))]
                  for i in range(pynvml.nvmlDeviceGetCount())]))
"""


def test_vllm_unit_examples(sim, collections_path, texts, tmp_path):
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "vllm.service.j2").write_text(UNIT_TEMPLATE.format(model=MODEL), encoding="utf-8")
    out = tmp_path / "unit.json"
    playbook = doc_examples.module_playbook(texts["vllm_unit"], HOST, {"hf_token": "hf_example_token_0123456789"},
                                            post_tasks=[keep(out, "{'status': vllm_status, 'restored': vllm_restored}")])
    proc = run(sim, collections_path, tmp_path, playbook)
    doc_examples.assert_examples_ran(proc, texts["vllm_unit"])
    got = json.loads(out.read_text(encoding="utf-8"))
    assert "main" in got["status"]["pending"]
    assert "hf_example_token_0123456789" not in proc.stdout, "the secret environment is never shown"
    # the snapshot was taken before the unit existed: restoring it removes what the examples wrote
    for path in ("/etc/systemd/system/vllm-main.service", "/etc/gpufleet/vllm-main.env", "/etc/gpufleet/main.plan.json"):
        assert sim.h.exec(HOST, ["test", "-e", path]).returncode != 0, path


def test_vllm_account_examples(sim, collections_path, texts, tmp_path):
    out = tmp_path / "account.json"
    existed = sim.h.exec(HOST, ["getent", "passwd", "vllm"]).returncode == 0
    playbook = doc_examples.module_playbook(texts["vllm_account"], HOST, post_tasks=[keep(out, "access")])
    try:
        proc = run(sim, collections_path, tmp_path, playbook)
        doc_examples.assert_examples_ran(proc, texts["vllm_account"])
        # the first example made the account (useradd on a real host), the second found the model readable as it
        got = json.loads(out.read_text(encoding="utf-8"))
        assert {k: got[k] for k in ("account_changed", "ready", "model_checked")} == {
            "account_changed": [], "ready": True, "model_checked": True}, got
        entry = sim.h.exec(HOST, ["getent", "passwd", "vllm"], check=True).stdout.strip().split(":")
        assert entry[5:] == ["/var/lib/vllm", "/usr/sbin/nologin"], entry
        home = sim.h.exec(HOST, ["stat", "-c", "%U:%G %a", "/var/lib/vllm"], check=True).stdout.strip()
        assert home == "vllm:vllm 750", home
        # a file the user cannot read fails the check, naming it
        sim.h.exec(HOST, ["sh", "-c", f"umask 077; touch {MODEL}/secret.bin"], check=True)
        failed = run(sim, collections_path, tmp_path, playbook)
        assert failed.returncode != 0 and f"the service user vllm cannot read the model {MODEL}: {MODEL}/secret.bin" in failed.stdout, \
            failed.stdout[-3000:]
    finally:
        sim.h.exec(HOST, ["rm", "-f", f"{MODEL}/secret.bin"])
        if not existed:
            sim.h.exec(HOST, ["sh", "-c", "userdel vllm; groupdel vllm; rm -rf /var/lib/vllm"])


def test_vllm_host_tools_examples(sim, collections_path, texts, tmp_path):
    out = tmp_path / "tools.json"
    playbook = doc_examples.module_playbook(texts["vllm_host_tools"], HOST, post_tasks=[keep(out, "tools")])
    try:
        proc = run(sim, collections_path, tmp_path, playbook)
        doc_examples.assert_examples_ran(proc, texts["vllm_host_tools"])
        got = json.loads(out.read_text(encoding="utf-8"))
        assert got["started"] == ["example-tool.timer"] and got["compiled"] == ["/opt/example/lib/example_pkg"], got
        assert sim.h.exec(HOST, ["systemctl", "is-active", "example-tool.timer"]).stdout.strip() == "active"
        assert sim.h.exec(HOST, ["test", "-f", "/opt/example/lib/example_pkg/__pycache__/__init__.cpython-311.pyc"]).returncode == 0
        # the same call again changes nothing
        again = run(sim, collections_path, tmp_path, playbook)
        assert json.loads(out.read_text(encoding="utf-8"))["changed"] is False, again.stdout[-3000:]
    finally:
        sim.h.exec(HOST, ["sh", "-c", "systemctl disable --now example-tool.timer; rm -rf /opt/example /usr/local/bin/example-tool "
                                      "/etc/systemd/system/example-tool.service /etc/systemd/system/example-tool.timer; "
                                      "systemctl daemon-reload"])


@pytest.fixture()
def engines(sim):
    """vllm-main.service on GPUs 2 and 3 with the plan kv_plan gives, and an engine on GPU 1 logging to a file."""
    free = TOTAL - RESERVED
    geometry = geometry_from_config(str(MODEL_CONFIG), {"tensor_parallel_size": 2, "block_size": 16})
    # The reference a profiled canary of this class records (20 GiB of KV at this free memory).
    reference = {"ranks": [{"rank": r, "free_bytes": free, "kv_bytes": 20 * GIB} for r in (0, 1)],
                 "vllm_free_bytes": {0: free - CUDA_CONTEXT, 1: free - CUDA_CONTEXT},
                 "total_bytes": TOTAL, "block_size": 16, "bytes_per_block": geometry.bytes_per_block}
    plan = plan_class({"host_class": "docex-h200", "reference": reference, "guard_bytes": "0.5GiB", "max_model_len": 8192,
                       "hosts": {f"{HOST}/main": [{"rank": 0, "boot_free_bytes": free}, {"rank": 1, "boot_free_bytes": free}]}})
    assert plan["decision"] == "deploy", plan["reasons"]
    sim.h.exec(HOST, ["install", "-d", "-o", "vllm", "-g", "vllm", "/var/log/vllm"], check=True)
    sim.h.exec(HOST, ["systemctl", "daemon-reload"], check=True)
    units = {
        "vllm-main.service": ["--setenv=CUDA_VISIBLE_DEVICES=2,3", "/opt/vllm/venv/bin/vllm", "serve", MODEL, "--port", "8000",
                              "-tp", "2", "--max-model-len", "8192", "--kv-cache-memory-bytes", str(plan["kv_cache_memory_bytes"])],
        "vllm-embedder.service": ["-p", "StandardOutput=append:/var/log/vllm/embedder.log", "-p", "StandardError=append:/var/log/vllm/embedder.log",
                                  "--setenv=CUDA_VISIBLE_DEVICES=1", "/opt/vllm/venv/bin/vllm", "serve", MODEL, "--port", "8001",
                                  "--max-model-len", "8192", "--kv-cache-memory-bytes", str(2 * GIB)],
    }
    try:
        for unit, argv in units.items():
            sim.h.exec(HOST, ["systemd-run", f"--unit={unit}", "-p", "User=vllm", *argv], check=True)
        yield plan
    finally:
        for unit in units:
            sim.h.exec(HOST, ["systemctl", "stop", unit])
            sim.h.exec(HOST, ["systemctl", "reset-failed", unit])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and json.loads(sim.h.exec(HOST, ["python3", "-c", NVML_PROCS], check=True).stdout) != [[]] * 4:
            time.sleep(0.2)


def test_boot_check_and_gpu_memory_examples(sim, collections_path, texts, tmp_path, engines):
    out = tmp_path / "gpus.json"
    facts_out = tmp_path / "facts.json"
    snapshot_out = tmp_path / "snapshot.json"
    interpreter_out = tmp_path / "interpreter.json"
    playbook = doc_examples.module_playbook(texts["vllm_boot_check"], HOST, {"gpufleet_plan": engines})
    playbook += doc_examples.module_playbook(texts["gpu_memory_info"], HOST, post_tasks=[
        keep(out, "{'all': gpu.gpus, 'last': gpu_pair.gpus, 'facts': ansible_facts.gpufleet_gpus | default(none)}")])
    playbook += doc_examples.module_playbook(texts["gpu_memory_facts"], HOST, post_tasks=[
        keep(facts_out, "{'gpus': ansible_facts.gpufleet_gpus, 'nvml': ansible_facts.gpufleet_nvml, 'probed': probed.gpus}")])
    playbook += doc_examples.module_playbook(texts["vllm_host_snapshot"], HOST, post_tasks=[
        keep(snapshot_out, "{'snap': snap, 'facts': ansible_facts.gpufleet_host_snapshot}")])
    playbook += doc_examples.module_playbook(texts["nvml_interpreter"], HOST, post_tasks=[
        keep(interpreter_out, "{'found': nvml_interpreter, 'fact': gpu_probe_interpreter | default(none)}")])
    proc = run(sim, collections_path, tmp_path, playbook)
    doc_examples.assert_examples_ran(proc, texts["vllm_boot_check"])
    doc_examples.assert_examples_ran(proc, texts["gpu_memory_info"])
    doc_examples.assert_examples_ran(proc, texts["gpu_memory_facts"])
    doc_examples.assert_examples_ran(proc, texts["vllm_host_snapshot"])
    doc_examples.assert_examples_ran(proc, texts["nvml_interpreter"])
    # the embedder's 2 GiB: 1024 blocks of 16 tokens of Llama-3.1-8B (2 MiB per block)
    assert "16384 tokens in 2GiB" in proc.stdout, proc.stdout[-3000:]
    got = json.loads(out.read_text(encoding="utf-8"))
    # every GPU; then GPUs 2 and 3, where vllm-main.service's memory counts as this host's own
    assert [g["index"] for g in got["all"]] == [0, 1, 2, 3] and [g["index"] for g in got["last"]] == [2, 3]
    assert len(got["all"][1]["processes"]) == 1 and not got["all"][1]["processes"][0]["own"], "the embedder is not vllm-main"
    for gpu in got["last"]:
        assert gpu["own_used_bytes"] > engines["kv_cache_memory_bytes"] and all(p["own"] for p in gpu["processes"])
        assert gpu["boot_free_bytes"] == TOTAL - RESERVED
    assert got["facts"] is None, "gpu_memory_info sets no facts"
    # gpu_memory_facts: its last probe (every GPU, vllm-main.service's memory its own) is the facts
    facts = json.loads(facts_out.read_text(encoding="utf-8"))
    assert facts["gpus"] == facts["probed"] and [g["index"] for g in facts["gpus"]] == [0, 1, 2, 3]
    assert facts["nvml"]["host"] == HOST and facts["nvml"]["driver_version"] == "580.159.04"
    assert [g["boot_free_bytes"] for g in facts["gpus"][2:]] == [TOTAL - RESERVED] * 2
    # vllm_host_snapshot: the same GPUs, vllm-main.service running (its memory this host's own), no unit for "side"
    snapshot = json.loads(snapshot_out.read_text(encoding="utf-8"))
    snap = snapshot["snap"]
    assert [g["index"] for g in snap["gpus"]] == [0, 1, 2, 3] and [g["boot_free_bytes"] for g in snap["gpus"][2:]] == [TOTAL - RESERVED] * 2
    assert [(i["unit"], i["active_state"], i["unit_exists"]) for i in snap["instances"]] == [
        ("vllm-main.service", "active", True), ("vllm-side.service", "inactive", False)]
    assert snap["interpreter"] == "/opt/vllm/venv/bin/python"
    # the engine's runtime, read by the interpreter beside its CLI (this venv has no vLLM distribution to report)
    assert snap["engine"] == {"executable": "/opt/vllm/venv/bin/vllm", "python": "/opt/vllm/venv/bin/python", "compat": {},
                              "nccl_version": None, "error": None}
    # the venv is a plain directory here, not a release the runtime role switched to: no install record
    assert snap["install_record"] == {} and snap["install_record_error"] is None
    # nvml_interpreter over ssh: the vLLM venv's python3, the first candidate, imports pynvml; no fact is set
    # (tests/integration/test_probe_interpreter.py reads the reasons of the ones passed over, over ssh)
    found = json.loads(interpreter_out.read_text(encoding="utf-8"))
    assert found["found"]["candidates"] == ["/opt/vllm/venv/bin/python3", "/usr/bin/python3", "/opt/gpufleet/nvml-venv/bin/python"], found
    assert found["found"]["interpreter"] == "/opt/vllm/venv/bin/python3" and found["found"]["passed_over"] == [], found
    assert found["fact"] is None, found
    assert snapshot["facts"] == {"host": HOST, "interpreter": snap["interpreter"], "instances": snap["instances"], "engine": snap["engine"],
                                 "install_record": {}, "install_record_error": None}


def test_vllm_audit_examples(sim, collections_path, texts, tmp_path):
    """A plan file as vllm_service writes it (format 2): GPU 0's floor 1 GiB above its free memory."""
    free = TOTAL - RESERVED
    plan = {"format": 2, "instance": "audited", "unit": "vllm-audited.service", "host_class": "docex-h200",
            "decision": "deploy", "gpus": [0], "kv_cache_memory_bytes": 20 * GIB, "gpu_memory_utilization": 0.9,
            "free_floor_bytes": {"0": free + GIB}, "num_blocks": 10240, "kv_cache_tokens": 163840, "max_model_len": 8192,
            "capacity": {"source": "geometry", "bytes_per_block": 2 * 1024 * 1024, "block_size": 16},
            "planned_at": "2026-01-01T00:00:00Z", "boot_gate": {"policy": "refuse", "state_file": None}}
    sim.h.exec(HOST, ["install", "-d", "/etc/gpufleet"], check=True)
    sim.h.exec(HOST, ["sh", "-c", f"echo '{json.dumps(plan)}' > /etc/gpufleet/audited.plan.json"], check=True)
    out = tmp_path / "audit.json"
    try:
        playbook = doc_examples.module_playbook(texts["vllm_audit"], HOST, post_tasks=[keep(out, "audit")])
        proc = run(sim, collections_path, tmp_path, playbook)
        doc_examples.assert_examples_ran(proc, texts["vllm_audit"])
    finally:
        sim.h.exec(HOST, ["rm", "-f", "/etc/gpufleet/audited.plan.json"])
    got = json.loads(out.read_text(encoding="utf-8"))
    (inst,) = got["instances"]
    assert inst["verdict"] == "would_refuse" and got["worst"] == "would_refuse"
    assert inst["ranks"][0]["margin_bytes"] == -GIB
    assert "audited: would_refuse (margin -1GiB)" in proc.stdout
