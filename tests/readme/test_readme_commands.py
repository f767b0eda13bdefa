# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The README's main job and its first dry run, as a new user runs them (the ``readme`` stage).

1. ``make demo``, exactly as the README says (a shell's environment, from the checkout): it
   boots the built-in simulated fleet and runs ``playbooks/rollout.yml`` on the shipped
   ``inventories/sim``. It must exit 0, every host of ``inventories/sim`` must run every
   instance its class names, each under a unit with its class's budget, every class must
   have ramped over its own hosts batch by batch, and the run report (JSON, Markdown, HTML)
   must be written under ``reports/sim``. The demo's hosts are stopped again afterwards.
2. ``ansible-playbook -i inventories/example playbooks/plan.yml --check --diff``, the README's
   "first dry run", on the shipped example inventory: hosts shaped as it describes (8x H100
   and 2x L40S, a monitoring agent on one L40S) stand in for its hosts. Only what a user's
   own site gives is substituted, in a second inventory source: how to reach each host, the
   address the one host binds vLLM to, the vault's token and the controller's store and report
   directories. It must exit 0, change nothing on any host, plan both classes and say what
   a first rollout would do (canaries, every unit, batch by batch).

A change that breaks either cannot land: these run in ``make test`` before the other fleet stages.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sim"))
sys.path.insert(0, str(REPO / "tests" / "hosts"))
sys.path.insert(0, str(REPO / "tests" / "integration"))

import fleetctl  # noqa: E402  pylint: disable=wrong-import-position,import-error
import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error
from simfleet import recap  # noqa: E402  pylint: disable=wrong-import-position,import-error

SIM_INVENTORY = REPO / "inventories" / "sim"
EXAMPLE_INVENTORY = REPO / "inventories" / "example"
DEMO_REPORTS = REPO / "reports" / "sim"
# What the Makefile exports for its own recipes: a user's shell has none of it.
MAKE_ENV = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKE_TERMOUT", "MAKE_TERMERR", "ANSIBLE_COLLECTIONS_PATH",
            "PYTHONPATH", "GPUFLEET_CACHE", "MOLECULE_GLOB", "VIRTUAL_ENV")


def shell_env() -> dict[str, str]:
    """The environment of a root shell on the machine: no make or venv variables, the venv off PATH."""
    env = {k: v for k, v in os.environ.items() if k not in MAKE_ENV}
    venv_bin = str(REPO / ".cache" / "venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


def group_vars(inventory: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: yaml.safe_load(p.read_text(encoding="utf-8")) for p in (inventory / "group_vars").glob("*.yml")}


def classes_of(inventory: Path) -> dict[str, list[str]]:
    """Inventory group -> its hosts, for the class groups under ``gpufleet``."""
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text(encoding="utf-8"))
    groups = hosts["all"]["children"]["gpufleet"]["children"]
    return {name: list(spec["hosts"]) for name, spec in groups.items()}


def newest_run(reports: Path, kind: str, since: float) -> Path:
    runs = [p for p in reports.glob(f"{kind}-*") if p.is_dir() and p.stat().st_mtime >= since]
    assert runs, f"no {kind} run report under {reports} since the run started"
    return max(runs, key=lambda p: p.stat().st_mtime)


# ---------------------------------------------------------------------------- make demo
@pytest.fixture(scope="module")
def demo() -> Any:
    """``make demo`` as the README says; the demo's hosts are stopped again afterwards."""
    started = time.time() - 1
    try:
        done = procgroup.run(["make", "demo"], timeout=1500, env=shell_env(), cwd=REPO)
        (REPO / ".cache" / "readme-make-demo.log").write_text(done.stdout, encoding="utf-8")
        yield done, started
    finally:
        # the demo's hosts only (`make demo-clean` stops every simulated host ever created)
        fleetctl.Fleet().destroy()


def test_make_demo_runs_the_main_job_and_writes_its_report(demo) -> None:
    done, started = demo
    assert done.returncode == 0, done.stdout[-6000:]
    assert "==== demo: playbooks/rollout.yml exited 0 after" in done.stdout, done.stdout[-3000:]
    counters = recap(done.stdout)
    every_host = [h for hosts in classes_of(SIM_INVENTORY).values() for h in hosts]
    for host in every_host:
        assert counters.get(host, {}).get("failed") == 0 and counters[host]["unreachable"] == 0, (host, counters.get(host))
    run = newest_run(DEMO_REPORTS, "rollout", started)
    for name in ("report.json", "report.md", "report.html"):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, run / name
    report = json.loads((run / "report.json").read_text(encoding="utf-8"))
    assert report["kind"] == "rollout" and report["summary"]["ok"] is True, report["summary"]
    assert report["summary"]["outcomes"] == {"deployed": len(every_host)}, report["summary"]
    assert f"report: {run.relative_to(REPO)}/report.json" in done.stdout


def test_make_demo_ramps_every_class_over_its_own_hosts(demo) -> None:
    done, started = demo
    assert done.returncode == 0, done.stdout[-3000:]
    report = json.loads((newest_run(DEMO_REPORTS, "rollout", started) / "report.json").read_text(encoding="utf-8"))
    serial = group_vars(SIM_INVENTORY)["gpufleet"]["gpufleet_rollout_serial"]
    assert serial[0] == 1, "the demo's first batch of a class is its canary host alone"
    for group, hosts in classes_of(SIM_INVENTORY).items():
        host_class = group_vars(SIM_INVENTORY)[group]["gpufleet_host_class"]
        batches = [b for b in report["batches"] if b["class"] == host_class]
        assert batches, (host_class, report["batches"])
        assert [b["class_index"] for b in batches] == list(range(1, len(batches) + 1))
        assert {b["class_total"] for b in batches} == {len(batches)}
        ramp = [[h["host"] for h in b["hosts"]] for b in batches]
        assert len(ramp[0]) == 1 and sorted(h for batch in ramp for h in batch) == sorted(hosts), ramp
        assert all(b["outcome"] == "ok" for b in batches), batches
        assert f"  {host_class:<12} 1/{len(batches)}: {ramp[0][0]} (ok)" in done.stdout


def test_make_demo_leaves_every_instance_running_its_class_budget(demo) -> None:
    done, started = demo
    assert done.returncode == 0, done.stdout[-3000:]
    report = json.loads((newest_run(DEMO_REPORTS, "rollout", started) / "report.json").read_text(encoding="utf-8"))
    budgets = {c["name"]: c["plan"]["kv_cache_memory_bytes"] for c in report["classes"]}
    fleet = fleetctl.Fleet()
    for group, hosts in classes_of(SIM_INVENTORY).items():
        gv = group_vars(SIM_INVENTORY)[group]
        budget = budgets[gv["gpufleet_host_class"]]
        assert isinstance(budget, int) and budget > 0, budgets
        for host in hosts:
            for instance in gv["gpufleet_instances"]:
                unit = f"vllm-{instance['name']}.service"
                state = fleet.h.exec(host, ["systemctl", "is-active", unit]).stdout.strip()
                assert state == "active", (host, unit, state)
                # the unit's lines as systemd reads them, continuations joined
                text = re.sub(r"[ \t]*\\\n[ \t]*", " ", fleet.h.exec(host, ["cat", f"/etc/systemd/system/{unit}"]).stdout)
                assert f"--kv-cache-memory-bytes {budget}" in text, (host, unit)
                assert f"--port {instance['port']}" in text, (host, unit)


# ---------------------------------------------------------------------------- plan.yml on the example
# Hosts shaped as inventories/example describes them (its group_vars' comments): 8x H100 80GB per
# host for h100_llama70b, 2x L40S per host for l40s_llama8b, a monitoring agent on gpu-l40s-03's GPU 0.
# The H100 figures are NVIDIA's 80 GiB part with an assumed driver reserve; the L40S ones sim/fleet.yml's.
EXAMPLE_FLEET: dict[str, Any] = {
    "engine": {"boot_delay_s": 2, "token_delay_s": 0.004},
    "system": {"driver": "550.127.05", "cuda": 12040, "nvml": "12.550.127.05"},
    "gpu_models": {
        "h100": {"name": "NVIDIA H100 80GB HBM3", "total": 85520809984, "reserved": 566231040, "cc": "9.0"},
        "l40s": {"name": "NVIDIA L40S", "total": 48305799168, "reserved": 462422016, "cc": "8.9"},
    },
    "classes": {
        "h100-llama70b": {"gpu_model": "h100", "gpus": 8, "model": "llama-3.1-70b-instruct"},
        "l40s-llama8b": {"gpu_model": "l40s", "gpus": 2, "model": "llama-3.1-8b-instruct"},
    },
    "hosts": {
        **{f"sim-ex-h100-{i}": {"class": "h100-llama70b", "base_used": [0] * 8} for i in range(1, 5)},
        **{f"sim-ex-l40s-{i}": {"class": "l40s-llama8b", "base_used": [0, 0]} for i in range(1, 4)},
    },
}
EXAMPLE_FLEET["hosts"]["sim-ex-l40s-3"]["cotenants"] = [{"gpu": 0, "bytes": "527MiB", "name": "dcgm-exporter"}]
# The example's host names -> the test hosts that stand in for them.
STAND_INS = {**{f"gpu-h100-0{i}.example.net": f"sim-ex-h100-{i}" for i in range(1, 5)},
             **{f"gpu-l40s-0{i}.example.net": f"sim-ex-l40s-{i}" for i in range(1, 4)}}
# What a host of the dry run may not change: units, the collection's state, its own venvs.
WATCHED = ("/etc/systemd/system", "/etc/gpufleet", "/opt/gpufleet", "/opt/vllm", "/var/lib/vllm")


def host_files(fleet: fleetctl.Fleet, host: str) -> str:
    """Every file under WATCHED with its size, mode and modification time, and the units systemd knows."""
    files = fleet.h.exec(host, ["find", *WATCHED, "-printf", r"%p %s %m %T@\n"]).stdout
    units = fleet.h.exec(host, ["systemctl", "list-units", "--all", "--no-legend", "vllm-*"]).stdout
    return files + units


@pytest.fixture(scope="module")
def example_fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = tmp_path_factory.mktemp("example")
    fleet_file = work / "fleet.yml"
    fleet_file.write_text(yaml.safe_dump(EXAMPLE_FLEET), encoding="utf-8")
    fleet = fleetctl.Fleet(fleet_file)
    try:
        fleet.create(reset_state=True)
        yield fleet, work
    finally:
        fleet.destroy()


def site_inventory(fleet: fleetctl.Fleet, work: Path) -> tuple[Path, Path]:
    """The example inventory with the fleet's own addresses written in (its host_vars name one), and
    what a site adds beside it: how to reach the hosts, the vault's secret and the controller's paths.
    Every other file of the example is used as shipped."""
    assert set(STAND_INS) == {h for hosts in classes_of(EXAMPLE_INVENTORY).values() for h in hosts}, \
        "the example inventory's hosts changed: update STAND_INS"
    reach = fleet.h.inventory_data(names=list(STAND_INS.values()))["all"]["hosts"]
    site: dict[str, Any] = {name: dict(reach[stand_in]) for name, stand_in in STAND_INS.items()}
    example = work / "example"
    if not example.exists():
        shutil.copytree(EXAMPLE_INVENTORY, example)
    bound = example / "host_vars" / "gpu-l40s-03.example.net.yml"
    listen = yaml.safe_load(bound.read_text(encoding="utf-8"))["vllm_service_listen_host"]
    bound.write_text(bound.read_text(encoding="utf-8").replace(listen, fleet.info(STAND_INS["gpu-l40s-03.example.net"]).address),
                     encoding="utf-8")
    # the controller's copy of each model's config.json, a controller path like the store below
    for group, hosts in classes_of(EXAMPLE_INVENTORY).items():
        model = EXAMPLE_FLEET["classes"][group_vars(EXAMPLE_INVENTORY)[group]["gpufleet_host_class"]]["model"]
        for host in hosts:
            site[host]["gpufleet_model_config"] = str(REPO / "sim" / "models" / model / "config.json")
            # a stand-in's own: its fake NVML state, which the simulated engine writes from inside the unit's sandbox
            site[host]["vllm_service_read_write_paths"] = ["/etc/fake-nvml"]
            # the stand-ins share a two-core test machine with the other stages of a test run: the latency of two
            # canaries a minute apart there says nothing about the hosts' (a canary once failed at 3x the
            # reference's TTFT under that load), as in the fleet tests
            site[host]["gpufleet_canary_tolerances"] = {"latency_ratio": 20.0}
    site_vars = {"vault_hf_token": "hf_not_a_real_token", "gpufleet_profile_store": str(work / "profiles"),
                 "gpufleet_report_dir": str(work / "reports")}
    path = work / "site.yml"
    path.write_text(yaml.safe_dump({"all": {"hosts": site, "vars": site_vars}}), encoding="utf-8")
    return example, path


def test_the_first_dry_run_on_the_example_inventory_changes_nothing(example_fleet) -> None:
    fleet, work = example_fleet
    example, site = site_inventory(fleet, work)
    reports = work / "reports"
    before = {host: host_files(fleet, host) for host in STAND_INS.values()}
    started = time.time() - 1
    env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_NOCOLOR="1")
    done = procgroup.run(["ansible-playbook", "-i", str(example), "-i", str(site),
                          str(REPO / "playbooks" / "plan.yml"), "--check", "--diff"], timeout=900, env=env, cwd=REPO)
    (work / "plan.log").write_text(done.stdout, encoding="utf-8")
    assert done.returncode == 0, done.stdout[-6000:]
    counters = recap(done.stdout)
    for name in STAND_INS:
        assert counters[name]["failed"] == 0 and counters[name]["unreachable"] == 0, (name, counters[name])
        assert counters[name]["changed"] == 0, (name, counters[name])
    assert {host: host_files(fleet, host) for host in STAND_INS.values()} == before, "the dry run changed a host"
    report = json.loads((newest_run(reports, "plan", started) / "report.json").read_text(encoding="utf-8"))
    assert report["kind"] == "plan" and report["check_mode"] is True
    planned = {c["name"]: c for c in report["classes"]}
    for group, hosts in classes_of(EXAMPLE_INVENTORY).items():
        gv = group_vars(EXAMPLE_INVENTORY)[group]
        first_run = planned[gv["gpufleet_host_class"]]["first_run"]
        assert first_run["profiled_canary"] is True and first_run["canary_host"] == sorted(hosts)[0], first_run
        units = {(u["host"], u["unit"]) for u in first_run["units"]}
        assert units == {(h, f"vllm-{i['name']}.service") for h in hosts for i in gv["gpufleet_instances"]}, units
        assert all(u["action"] == "create" for u in first_run["units"])
        assert min(u["batch"] for u in first_run["units"] if u["host"] == first_run["canary_host"]) == 1
    assert "check mode: nothing was changed on the hosts" in done.stdout


def test_the_example_inventory_rolls_out_as_written(example_fleet) -> None:
    """rollout.yml on the example inventory as shipped (only how to reach the hosts and their own
    addresses substituted): both classes are profiled and deployed, and gpu-l40s-03, whose instance
    listens on the host's own address only, passes its canary waits and boot check there."""
    fleet, work = example_fleet
    example, site = site_inventory(fleet, work)
    # The models as a Hugging Face download leaves them (the hosts reach no hub here, as in an
    # air-gapped zone with a pre-seeded cache): the service's HF_HOME, the pinned revision.
    for group, hosts in classes_of(EXAMPLE_INVENTORY).items():
        gv = group_vars(EXAMPLE_INVENTORY)[group]
        config = REPO / "sim" / "models" / EXAMPLE_FLEET["classes"][gv["gpufleet_host_class"]]["model"] / "config.json"
        repo = f"var/lib/vllm/huggingface/hub/models--{gv['gpufleet_model'].replace('/', '--')}"
        for host in hosts:
            snapshot = Path(fleet.info(STAND_INS[host]).root) / repo / "snapshots" / gv["gpufleet_serve_args"]["revision"]
            snapshot.mkdir(parents=True, exist_ok=True)
            (snapshot / "config.json").write_text(config.read_text(encoding="utf-8"), encoding="utf-8")
    started = time.time() - 1
    env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_NOCOLOR="1")
    done = procgroup.run(["ansible-playbook", "-i", str(example), "-i", str(site),
                          str(REPO / "playbooks" / "rollout.yml")], timeout=1800, env=env, cwd=REPO)
    (work / "rollout.log").write_text(done.stdout, encoding="utf-8")
    assert done.returncode == 0, done.stdout[-8000:]
    report = json.loads((newest_run(work / "reports", "rollout", started) / "report.json").read_text(encoding="utf-8"))
    assert {h["host"]: h["outcome"] for h in report["hosts"]} == {name: "deployed" for name in STAND_INS}, report["hosts"]
    bound_host = STAND_INS["gpu-l40s-03.example.net"]
    address = fleet.info(bound_host).address
    for group, hosts in classes_of(EXAMPLE_INVENTORY).items():
        for host in hosts:
            for inst in group_vars(EXAMPLE_INVENTORY)[group]["gpufleet_instances"]:
                unit = f"vllm-{inst['name']}.service"
                state = fleet.h.exec(STAND_INS[host], ["systemctl", "is-active", unit]).stdout.strip()
                assert state == "active", (host, unit, state)
    unit = fleet.h.exec(bound_host, ["systemctl", "cat", "vllm-main.service"]).stdout
    assert f"--host {address} " in unit, unit
    # the instance answers on its address only: the checks that passed asked it there
    ask = ("import sys, urllib.request\ntry:\n    print(urllib.request.urlopen(sys.argv[1], timeout=5).status)\n"
           "except OSError as exc:\n    print(type(exc).__name__)")
    assert fleet.h.exec(bound_host, ["python3", "-c", ask, f"http://{address}:8000/health"]).stdout.strip() == "200"
    assert fleet.h.exec(bound_host, ["python3", "-c", ask, "http://127.0.0.1:8000/health"]).stdout.strip() == "URLError", \
        "nothing answers on 127.0.0.1: a boot check there could not have passed"
