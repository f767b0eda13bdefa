# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The run reports of playbooks/plan.yml under --check and of playbooks/probe.yml, for real,
over SSH, on two simulated hosts of one class (sim/fleetctl.py, as test_rollout.py sets
them up: fake NVML GPUs, the simulated engine).

* plan.yml --check (after profile.yml recorded the class's reference profile) writes its
  report on the controller, says it was a dry run, and changes nothing on the hosts;
* probe.yml writes a probe report: per host and GPU the memory and processes, per
  instance the unit state and its plan; a host that cannot be reached is in the report
  with its error and fails the run;
* an unwritable report directory stops probe.yml before any host is contacted;
* an instance that spans both hosts (a gang, docs/multi-host.md) is checked across its members,
  by plan.yml before any host is contacted (the inventory) and by rollout.yml from the probe (GPU
  models, the leader's address resolved on the follower), which writes its report and releases its
  lease; no host gets a unit or a plan record.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import human_bytes

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "tests" / "fake_nvml"))

import nvml_state  # noqa: E402  pylint: disable=wrong-import-position,import-error
import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error
import test_report_render as render  # noqa: E402  pylint: disable=wrong-import-position,import-error

HOSTS = ["sim-rp-1", "sim-rp-2"]
CLASS = "rp-l40s"
MODEL = "/srv/models/llama-3.1-8b-instruct"
TOTAL = 48305799168
RESERVED = 462422016
COTENANT = 1 << 30
GIB = 1 << 30

FLEET = {
    "engine": {
        "boot_delay_s": 0.5,
        "token_delay_s": 0.002,
        "costs": {"cuda_context_bytes": "500MiB", "peak_activation_bytes": "1.25GiB", "non_torch_bytes": "600MiB",
                  "cuda_graph_bytes": "0.75GiB"},
    },
    "system": {"driver": "550.127.05", "cuda": 12040, "nvml": "12.550.127.05"},
    "gpu_models": {"l40s": {"name": "NVIDIA L40S", "total": TOTAL, "reserved": RESERVED, "cc": "8.9"}},
    "classes": {CLASS: {"gpu_model": "l40s", "gpus": 2, "model": "llama-3.1-8b-instruct"}},
    "hosts": {
        "sim-rp-1": {"class": CLASS, "base_used": [0, 0]},
        "sim-rp-2": {"class": CLASS, "base_used": [0, 0], "cotenants": [{"gpu": 1, "bytes": COTENANT, "name": "python3", "pid": 61001}]},
    },
}
# An inventory host that refuses connections at once (nothing listens on port 1).
GONE = {"rp-gone": {"ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_user": "root", "gpufleet_host_class": CLASS}}


def _fleetctl():
    spec = importlib.util.spec_from_file_location("gpufleet_sim_fleetctl_reports", REPO / "sim" / "fleetctl.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def playbook(inventory: Path, name: str, *args: str, extra_vars: dict[str, Any] | None = None) -> tuple[int, str]:
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_PIPELINING="1", ANSIBLE_HOST_KEY_CHECKING="False",
               ANSIBLE_TIMEOUT="10", ANSIBLE_SSH_ARGS="-C -o ControlMaster=auto -o ControlPersist=60s")
    argv = ["ansible-playbook", "-i", str(inventory), str(REPO / "playbooks" / name), *args]
    if extra_vars:
        argv += ["--extra-vars", json.dumps(extra_vars)]
    proc = procgroup.run(argv, env=env, cwd=REPO, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def run_dirs(reports: Path, kind: str) -> list[Path]:
    return sorted(p for p in reports.glob(f"{kind}-*") if p.is_dir())


class Fleet:
    def __init__(self, workdir: Path, harness: Any) -> None:
        self.workdir = workdir
        self.harness = harness
        fleet_file = workdir / "fleet.yml"
        fleet_file.write_text(yaml.safe_dump(FLEET), encoding="utf-8")
        self.sim = _fleetctl().Fleet(fleet_file)
        self.store = workdir / "profiles"
        self.reports = workdir / "reports"
        self.inventory = workdir / "inventory.yml"

    def create(self) -> None:
        self.sim.create(reset_state=True)
        data = self.harness.inventory_data(names=HOSTS)
        group_vars = {
            "gpufleet_host_class": CLASS,
            "gpufleet_model": MODEL,
            "gpufleet_model_config": str(REPO / "sim" / "models" / "llama-3.1-8b-instruct" / "config.json"),
            "gpufleet_serve_args": {"max_model_len": 8192, "tensor_parallel_size": 2, "max_num_seqs": 32,
                                    "dtype": "bfloat16", "block_size": 16},
            "gpufleet_instances": [{"name": "main", "gpus": [0, 1], "port": 8000}],
            "gpufleet_guard": "0.5GiB",
            "gpufleet_profile_store": str(self.store),
            "gpufleet_canary_load": {"requests": 4, "concurrency": 2, "prompt_tokens": 32, "max_tokens": 8},
        }
        # run settings for every host (the playbooks read them from the first target host)
        inventory = {"all": {"vars": {"gpufleet_report_dir": str(self.reports)}, "children": {
            "rp_l40s": {"hosts": {name: data["all"]["hosts"][name] for name in HOSTS}, "vars": group_vars},
            "gone": {"hosts": GONE},
        }}}
        self.inventory.write_text(yaml.safe_dump(inventory), encoding="utf-8")

    def exists(self, host: str, path: str) -> bool:
        return self.harness.exec(host, ["test", "-e", path]).returncode == 0


@pytest.fixture(scope="module")
def fleet(harness, tmp_path_factory):  # harness: conftest (root + rootfs)
    f = Fleet(tmp_path_factory.mktemp("reports"), harness)
    try:
        f.create()
        yield f
    finally:
        f.sim.destroy()


def test_unwritable_report_dir_stops_the_probe_before_any_host(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n", encoding="utf-8")
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": GONE}}), encoding="utf-8")
    rc, out = playbook(inventory, "probe.yml", extra_vars={"gpufleet_report_dir": str(blocker / "reports")})
    assert rc != 0
    assert f"gpufleet_report_dir {blocker / 'reports'} cannot be created or written on the controller" in out, out[-3000:]
    assert "PLAY [Probe GPU memory and vLLM units]" not in out, "no host may be contacted"


def test_plan_check_writes_its_report_and_changes_nothing(fleet):
    rc, out = playbook(fleet.inventory, "profile.yml", extra_vars={"gpufleet_class": CLASS, "gpufleet_target": "rp_l40s"})
    assert rc == 0, out[-6000:]
    profiles = sorted(fleet.store.glob(f"{CLASS}/*"))
    assert len(profiles) == 1
    before = run_dirs(fleet.reports, "plan")

    rc, out = playbook(fleet.inventory, "plan.yml", "--check", "--diff", extra_vars={"gpufleet_target": "rp_l40s"})
    assert rc == 0, out[-6000:]
    runs = [p for p in run_dirs(fleet.reports, "plan") if p not in before]
    assert len(runs) == 1, f"one plan report expected under --check, got {runs}\n{out[-4000:]}"
    run = runs[0]
    assert sorted(p.name for p in run.iterdir()) == ["report.html", "report.json", "report.md"]
    report = json.loads((run / "report.json").read_text(encoding="utf-8"))
    assert report["kind"] == "plan" and report["check_mode"] is True and report["schema_version"] == 2
    cls = report["classes"][0]
    assert (cls["name"], cls["status"], cls["decision"]) == (CLASS, "deployable", "deploy"), cls["reasons"]
    assert cls["plan"]["kv_cache_memory_bytes"] > 0 and cls["hosts"] == HOSTS
    # the co-tenant's 1 GiB on sim-rp-2's GPU 1 makes it the weakest rank
    assert (cls["weakest"]["host"], cls["weakest"]["rank"]) == ("sim-rp-2/main", 1)
    assert {h["host"]: h["outcome"] for h in report["hosts"]} == {h: "planned" for h in HOSTS}
    assert f"report: {run}/report.html" in out
    assert "check mode: nothing was changed on the hosts" in out
    # --diff shows the unit each host would get (no unit on the hosts yet: all of it is new)
    assert re.search(r"\+\+\+ after: /etc/systemd/system/vllm-main\.service", out), out[-6000:]
    # a manual budget starts through the boot gate, which execs the engine named after "--"
    assert re.search(r"\+ExecStart=/usr/local/libexec/gpufleet-vllm-boot-gate", out), out[-6000:]
    assert re.search(r"\+ +-- /opt/vllm/venv/bin/vllm serve", out), out[-6000:]
    assert "dry run (check mode)" in (run / "report.md").read_text(encoding="utf-8")
    # a dry run: no unit, no plan record, no new profile
    for host in HOSTS:
        assert not fleet.exists(host, "/etc/systemd/system/vllm-main.service"), host
        assert not fleet.exists(host, "/etc/gpufleet/main.plan.json"), host
    assert sorted(fleet.store.glob(f"{CLASS}/*")) == profiles


@pytest.fixture()
def running_instance(fleet):
    """sim-rp-1 runs vllm-main.service on its two GPUs and has the plan record a rollout leaves."""
    budget = 20 * GIB
    plan = {"format": 1, "instance": "main", "unit": "vllm-main.service", "host_class": CLASS, "compat_key_hash": "0123456789abcdef",
            "model": MODEL, "gpus": [0, 1], "port": 8000, "decision": "deploy", "reasons": [], "kv_cache_memory_bytes": budget,
            "gpu_memory_utilization": 0.9, "free_floor_bytes": {}, "num_blocks": 20480, "kv_cache_tokens": 327680,
            "max_concurrency": 40.0}
    host = HOSTS[0]
    fleet.harness.exec(host, ["install", "-d", "/etc/gpufleet"], check=True)
    fleet.harness.exec(host, ["sh", "-c", f"cat > /etc/gpufleet/main.plan.json <<'EOF'\n{json.dumps(plan)}\nEOF"], check=True)
    fleet.harness.exec(host, ["systemd-run", "--unit=vllm-main.service", "-p", "User=vllm", "--setenv=CUDA_VISIBLE_DEVICES=0,1",
                              "/opt/vllm/venv/bin/vllm", "serve", MODEL, "--port", "8000", "-tp", "2", "--max-model-len", "8192",
                              "--kv-cache-memory-bytes", str(budget)], check=True)
    probe = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=1)"
    healthy = False
    for _attempt in range(100):
        if fleet.harness.exec(host, ["python3", "-c", probe]).returncode == 0:
            healthy = True
            break
        fleet.harness.exec(host, ["sleep", "0.2"])
    try:
        assert healthy, fleet.harness.exec(host, ["journalctl", "-u", "vllm-main.service", "--no-pager", "-o", "cat"]).stdout[-3000:]
        yield plan
    finally:
        fleet.harness.exec(host, ["systemctl", "stop", "vllm-main.service"])
        fleet.harness.exec(host, ["systemctl", "reset-failed", "vllm-main.service"])
        fleet.harness.exec(host, ["rm", "-f", "/etc/gpufleet/main.plan.json"])


@pytest.fixture(scope="module")
def chromium() -> str:
    return render.find_chromium()


def test_probe_writes_a_probe_report(fleet, running_instance, chromium, tmp_path):
    before = run_dirs(fleet.reports, "probe")
    rc, out = playbook(fleet.inventory, "probe.yml")
    runs = [p for p in run_dirs(fleet.reports, "probe") if p not in before]
    assert len(runs) == 1, out[-6000:]
    run = runs[0]
    assert rc != 0, "a host that cannot be reached fails the probe"
    assert "Probe failed on rp-gone" in out, out[-4000:]
    report = json.loads((run / "report.json").read_text(encoding="utf-8"))
    assert report["kind"] == "probe" and report["schema_version"] == 2 and report["classes"] == []
    assert {h["host"]: h["outcome"] for h in report["hosts"]} == {"rp-gone": "failed", "sim-rp-1": "probed", "sim-rp-2": "probed"}
    hosts = {h["host"]: h for h in report["probe"]["hosts"]}
    assert hosts["rp-gone"]["error"].startswith("unreachable: ") and "Connection refused" in hosts["rp-gone"]["error"]
    one, two = hosts["sim-rp-1"], hosts["sim-rp-2"]
    assert one["driver_version"] == "550.127.05" and [g["index"] for g in one["gpus"]] == [0, 1]
    for gpu in one["gpus"]:
        # the running engine's memory is the host's own: boot free is the whole GPU again
        assert gpu["total_bytes"] == TOTAL and gpu["boot_free_bytes"] == TOTAL - RESERVED
        assert gpu["processes"] and all(p["own"] for p in gpu["processes"])
        assert gpu["free_bytes"] < TOTAL - RESERVED - running_instance["kv_cache_memory_bytes"]
    assert two["gpus"][0]["processes"] == [] and two["gpus"][0]["boot_free_bytes"] == TOTAL - RESERVED
    assert two["gpus"][1]["processes"] == [{"pid": 61001, "name": two["gpus"][1]["processes"][0]["name"], "used_bytes": COTENANT, "own": False}]
    assert two["gpus"][1]["boot_free_bytes"] == TOTAL - RESERVED - COTENANT
    (main1,), (main2,) = one["instances"], two["instances"]
    assert (main1["unit"], main1["active_state"], main1["sub_state"], main1["gpus"], main1["port"]) == (
        "vllm-main.service", "active", "running", [0, 1], 8000)
    assert main1["plan"]["kv_cache_memory_bytes"] == running_instance["kv_cache_memory_bytes"]
    assert main1["plan"]["compat_key_hash"] == running_instance["compat_key_hash"]
    assert main2["load_state"] == "not-found" and main2["plan"] is None
    summary = report["summary"]["probe"]
    assert (summary["hosts"], summary["probed"], summary["gpus"], summary["instances"], summary["active_instances"]) == (3, 2, 4, 2, 1)
    assert summary["lowest_boot_free"] == {"host": "sim-rp-2", "index": 1, "bytes": TOTAL - RESERVED - COTENANT}
    line = (f"probe: 2 of 3 host(s) probed, 4 GPU(s), 1 of 2 instance(s) active; lowest boot free "
            f"{human_bytes(TOTAL - RESERVED - COTENANT)} (sim-rp-2 GPU 1); failed hosts rp-gone")
    assert f"{line}; report: {run}/report.html" in out, out[-3000:]
    md = (run / "report.md").read_text(encoding="utf-8")
    assert "## Host sim-rp-1" in md and "| main | vllm-main.service | active (running) | 0, 1 | 8000 | 20GiB |" in md
    assert "| 1 | 61001 |" in md and "not installed" in md
    page = (run / "report.html").read_text(encoding="utf-8")
    assert 'class="gpu-own"' in page and 'class="gpu-other"' in page and "<script" not in page

    # Rendered by headless Chromium: the GPU bars (own engine in blue, the co-tenant in
    # orange, at 80 % over white) are drawn and the DOM holds the figures.
    shot = tmp_path / "probe.png"
    res = render.chromium_run(chromium, tmp_path, f"--screenshot={shot}", (run / "report.html").as_uri())
    assert shot.exists(), res.stderr[-3000:]
    _width, _height, rows = render.png_pixels(shot)
    assert render.color_share(rows, (68, 132, 205)) > 2000, "no own-engine bar in the rendered page"
    assert render.color_share(rows, (242, 137, 51)) > 50, "no co-tenant bar in the rendered page"
    dom = render.chromium_run(chromium, tmp_path, "--dump-dom", (run / "report.html").as_uri())
    assert dom.returncode == 0, dom.stderr[-3000:]
    for needle in ("Host sim-rp-1", "active (running)", "not installed", "Connection refused", "<td>61001</td>"):
        assert needle in dom.stdout, f"{needle!r} not in the rendered DOM"


def gang_inventory(fleet: Fleet, path: Path, gang: dict[str, Any], serve_args: dict[str, Any] | None = None) -> Path:
    """The fleet's inventory with its instance made a gang over both hosts."""
    inventory = yaml.safe_load(fleet.inventory.read_text(encoding="utf-8"))
    group = inventory["all"]["children"]["rp_l40s"]["vars"]
    group["gpufleet_instances"] = [{"name": "main", "gpus": [0, 1], "port": 8000, "gang": gang}]
    group["gpufleet_serve_args"] = serve_args or {**group["gpufleet_serve_args"], "pipeline_parallel_size": 2}
    path.write_text(yaml.safe_dump(inventory), encoding="utf-8")
    return path


def test_a_gang_is_checked_across_its_members_before_any_host_is_touched(fleet, tmp_path):
    members = {"mode": "mp", "members": HOSTS}
    # the inventory: the leader is no member, and TP 2 x PP 2 x DP 2 asks for 8 GPUs of the 4 the members give
    wrong = gang_inventory(fleet, tmp_path / "wrong.yml", {**members, "leader": "sim-rp-9"},
                           {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2, "max_model_len": 8192})
    rc, out = playbook(wrong, "plan.yml", extra_vars={"gpufleet_target": "rp_l40s"})
    assert rc != 0
    assert "sim-rp-1: gpufleet_instances[0].gang.leader: 'sim-rp-9' is not one of the members (sim-rp-1, sim-rp-2)" in out, out[-4000:]
    assert "no host was probed or touched" in out and "TASK [Read the host" not in out, out[-4000:]

    # the probe: sim-rp-2's GPU 1 is another model, and the gang's address does not resolve on sim-rp-2 (the follower)
    state_path = Path(fleet.harness.get("sim-rp-2").fake_nvml_dir) / "state"
    with nvml_state.locked(str(state_path)):
        original = nvml_state.load(str(state_path))
        changed = json.loads(json.dumps(original))
        changed["gpus"][1]["name"] = "NVIDIA L40"
        nvml_state.save(str(state_path), changed)
    # rollout.yml, which took its class's lease: the run report is written, naming both members, and the lease released
    before = run_dirs(fleet.reports, "rollout")
    try:
        unresolved = gang_inventory(fleet, tmp_path / "unresolved.yml", {**members, "address": "rp-leader.invalid"})
        rc, out = playbook(unresolved, "rollout.yml", extra_vars={"gpufleet_target": "rp_l40s"})
    finally:
        with nvml_state.locked(str(state_path)):
            nvml_state.save(str(state_path), original)
    assert rc != 0
    resolve = ("sim-rp-2: gpufleet_instances instance main: the gang's address rp-leader.invalid (the leader sim-rp-1) does not "
               "resolve on this follower: ")
    models = ("sim-rp-1: gpufleet_instances instance main: ranks on different GPU models (NVIDIA L40: sim-rp-2 GPU 1; "
              "NVIDIA L40S: sim-rp-1 GPU 0, sim-rp-1 GPU 1, sim-rp-2 GPU 0)")
    assert resolve in out and models in out and "; no host was touched" in out, out[-4000:]
    assert "TASK [Boot the canary" not in out and "PLAY [Stage the vLLM runtime" not in out, out[-4000:]
    assert not (fleet.store / ".leases" / f"{CLASS}.json").exists(), "the class lease is released"
    runs = [p for p in run_dirs(fleet.reports, "rollout") if p not in before]
    assert len(runs) == 1, out[-4000:]
    report = json.loads((runs[0] / "report.json").read_text(encoding="utf-8"))
    failed = {h["host"]: h for h in report["hosts"] if h["outcome"] == "failed"}
    assert sorted(failed) == HOSTS and all(resolve in (h["error"] or "") and models in (h["error"] or "") for h in failed.values()), \
        report["hosts"]
    for host in HOSTS:
        assert not fleet.exists(host, "/etc/systemd/system/vllm-main.service"), host
        assert not fleet.exists(host, "/etc/gpufleet/main.plan.json"), host
