# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Operators' rollout on a simulated fleet: per-class ramps, hooks, HAProxy, plan -> approve -> apply.

One fleet for the module (systemd-nspawn hosts over SSH, fake NVML, simulated engine):
class ``rp-a`` (two hosts behind a real HAProxy), class ``rp-b`` (one host) and a
load-balancer host ``sim-rp-lb`` running the Debian ``haproxy`` package, configured and
started here. The tests run in file order and build on each other's end state:

1. an AWX job slice is refused before anything runs;
2. first rollout: class rp-a ramps over its own hosts (batch n of m of class C), recorder
   hooks see drain/undrain around every host and around the canaries of every class's
   canary host, batch and class start/end; the unattended pause before rp-b stops (default);
3. rollout.yml through ansible-runner in the runner's own layout (project, inventory, env)
   with a limit to class rp-a: without localhost in the limit it stops before probing,
   naming the fix; with it, rp-a (already on the plan) is left as it is and rp-b untouched;
   plan.yml through ansible-runner (the runner AWX uses) writes the plan file and the
   ``gpufleet_plan`` artifact, read from the runner's artifacts;
4. rollout.yml applies that artifact: class rp-a rolls out behind HAProxy (its runtime API
   shows each server MAINT while its host restarts, UP afterwards; requests sent through
   HAProxy during the rollout all succeed); the unattended pause continues (as configured)
   to rp-b, whose drain hook fails: the host fails as it was, nothing on it kept or stopped;
5. the plan file is refused before any host is touched once a host's free memory fell
   below the planned floor, naming the host, rank and figures;
6. a manual canary that fails on the canary host: the class stops, and the host drained for
   the canaries goes back into HAProxy once its production instance answers again;
7. the example drain with a request in flight longer than its wait fails and gives every
   server its previous state back (the host keeps serving), the request completes;
8. progressive delivery behind HAProxy: class rp-a bakes each batch, judged from a real
   Prometheus server (the Debian package, on the load-balancer host) that scrapes the engines
   and node_exporter's textfile metrics; each canary takes a quarter of its weight during its
   bake; batch 2's new engine serves slowly, fails its bake, and the whole class is rolled
   back, with completions sent through HAProxy the whole time all answered and never more
   than one of the class's servers out of HAProxy at once.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from simfleet import REPO, SimFleet, budget, l40s_fleet  # pylint: disable=import-error

GIB = 1 << 30
A_HOSTS = ["sim-rp-a1", "sim-rp-a2"]
B_HOSTS = ["sim-rp-b1"]
LB = "sim-rp-lb"
TARGET = "rp_a:rp_b"
HAPROXY_DIR = REPO / "playbooks" / "examples" / "haproxy"
FRONT_PORT = 8080

FLEET = {
    **l40s_fleet(1),
    "classes": {
        "rp-a": {"gpu_model": "l40s", "gpus": 1, "model": "llama-3.1-8b-instruct"},
        "rp-b": {"gpu_model": "l40s", "gpus": 1, "model": "llama-3.1-8b-instruct"},
        "rp-lb": {"gpu_model": "l40s", "gpus": 1, "model": "llama-3.1-8b-instruct"},
    },
    "hosts": {
        "sim-rp-a1": {"class": "rp-a", "base_used": [0]},
        "sim-rp-a2": {"class": "rp-a", "base_used": ["64MiB"]},
        "sim-rp-b1": {"class": "rp-b", "base_used": [0]},
        LB: {"class": "rp-lb", "base_used": [0]},
    },
}

GROUP_VARS = {
    "gpufleet_model": "/srv/models/llama-3.1-8b-instruct",
    "gpufleet_model_config": str(REPO / "sim" / "models" / "llama-3.1-8b-instruct" / "config.json"),
    "gpufleet_serve_args": {"max_model_len": 8192, "tensor_parallel_size": 1, "max_num_seqs": 32, "dtype": "bfloat16",
                            "block_size": 16},
    "gpufleet_instances": [{"name": "main", "gpus": [0], "port": 8000}],
    "gpufleet_guard": "0.5GiB",
    "gpufleet_admission": {"concurrency": 2, "tokens_per_request": 8192},
    "gpufleet_canary_load": {"requests": 4, "concurrency": 2, "prompt_tokens": 32, "max_tokens": 8},
    "gpufleet_canary_tolerances": {"latency_ratio": 20.0},
    "vllm_service_read_write_paths": ["/etc/fake-nvml"],
    "vllm_service_boot_timeout": 120,
    # 3 probe samples 0.2 s apart instead of 9 at 0.5 s: nothing here moves free memory between samples
    # (test_rollout_faults.py keeps the defaults for the faults that do)
    "gpufleet_probe_samples": 3,
    "gpufleet_probe_interval": 0.2,
}

HAPROXY_CFG = """\
global
    stats socket /run/haproxy/admin.sock mode 600 level admin
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 60s
frontend vllm
    bind :{port}
    default_backend vllm-main
backend vllm-main
    option httpchk GET /health
    default-server inter 500ms fall 2 rise 1 weight 100
{servers}
"""

RECORDER = """\
- name: Record the hook
  ansible.builtin.shell: >-
    echo '{{{{ gpufleet_hook_event }}}} {{{{ gpufleet_hook_host }}}} {{{{ gpufleet_hook_class }}}}
    {{{{ gpufleet_hook_batch.class_index | default('-') }}}}/{{{{ gpufleet_hook_batch.class_total | default('-') }}}}
    {{{{ gpufleet_hook_instances | map(attribute='name') | join(',') or '-' }}}}' >> {log}
  delegate_to: localhost
  changed_when: false
"""

FAILING_DRAIN = """\
- name: Fail the drain of a host in a batch
  ansible.builtin.fail:
    msg: the load balancer refused to drain {{ gpufleet_hook_host }}
  when: gpufleet_hook_batch is defined
"""


@pytest.fixture(scope="module")
def fleet(harness, tmp_path_factory):  # harness: conftest (root + rootfs)
    # Guests reach each other through the controller: forwarding between the test hosts'
    # own namespaces only, for this module, set back afterwards.
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    before = forward.read_text(encoding="utf-8").strip()
    f = SimFleet(tmp_path_factory.mktemp("ramps"), harness, FLEET, GROUP_VARS)
    try:
        f.create(classes={"rp-a": A_HOSTS, "rp-b": B_HOSTS})
        forward.write_text("1\n", encoding="utf-8")
        yield f
    finally:
        f.sim.destroy()
        forward.write_text(before + "\n", encoding="utf-8")


def inventory(fleet: SimFleet, name: str, hooks: dict[str, dict[str, str]], **extra: Any) -> Path:
    """The fleet's inventory with per-class hooks and the load-balancer host (outside the target)."""
    path = fleet.write_inventory({"rp-a": A_HOSTS, "rp-b": B_HOSTS}, fleet.workdir / f"inventory-{name}.yml")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    for group, group_hooks in hooks.items():
        data["all"]["children"][group]["vars"].update(gpufleet_hooks=group_hooks, gpufleet_haproxy_host=LB, **extra)
    data["all"]["children"]["lb"] = {"hosts": {LB: fleet.harness.inventory_data()["all"]["hosts"][LB]}}
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def recorder(fleet: SimFleet) -> tuple[Path, dict[str, str]]:
    log = fleet.workdir / "hooks.log"
    hook = fleet.workdir / "record-hook.yml"
    hook.write_text(RECORDER.format(log=log), encoding="utf-8")
    return log, {e: str(hook) for e in ("drain", "undrain", "batch_start", "batch_end", "class_start", "class_end")}


def haproxy_hooks() -> dict[str, str]:
    return {"drain": str(HAPROXY_DIR / "drain.yml"), "undrain": str(HAPROXY_DIR / "undrain.yml")}


def progress(out: str) -> list[str]:
    return re.findall(r"batch (\d+ of \d+ of class \S+) \(run batch \d+ of \d+\): ([^(]+) \(", out)


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    return {}


def test_awx_job_slice_is_refused(fleet):
    inv = inventory(fleet, "plain", {})
    rc, out = fleet.rollout({"gpufleet_target": TARGET, "awx_job_id": 12, "awx_workflow_job_id": 11,
                             "awx_workflow_job_name": "vLLM KV rollout", "awx_job_template_name": "vLLM KV rollout"},
                            inventory=inv)
    assert rc != 0
    assert "This job is one slice of the sliced job template 'vLLM KV rollout'" in out, out[-4000:]
    assert "Set job_slice_count to 1" in out
    assert "PLAY [Probe every target host]" not in out, "nothing may run after the refusal"


def test_first_rollout_ramps_every_class_with_hooks(fleet, seen):
    log, hooks = recorder(fleet)
    inv = inventory(fleet, "recorder", {"rp_a": hooks, "rp_b": hooks})
    rc, out = fleet.rollout({"gpufleet_target": TARGET, "gpufleet_classes": ["rp-a", "rp-b"], "gpufleet_class_pause": True},
                            inventory=inv)
    # the pause before rp-b has nobody to answer it: it says so and stops (the default)
    assert rc != 0, out[-6000:]
    assert "no answer (not interactive, or an empty answer): gpufleet_class_pause_unattended is stop; stopping before it" in out
    # class rp-a ramps over its own hosts; rp-b would come after it, in its own batch (the report below)
    assert progress(out) == [("1 of 2 of class rp-a", "sim-rp-a1"), ("2 of 2 of class rp-a", "sim-rp-a2")], progress(out)
    events = [line.split() for line in log.read_text(encoding="utf-8").splitlines()]
    a1 = [e for e in events if e[1] == "sim-rp-a1"]
    # the canary host is drained before the profiled canary and undrained after the canaries,
    # then drained and undrained around its own restart in batch 1, inside the batch and class hooks
    assert [e[0] for e in a1] == ["drain", "undrain", "class_start", "batch_start", "drain", "undrain", "batch_end"], a1
    assert a1[4] == ["drain", "sim-rp-a1", "rp-a", "1/2", "main"]
    by_event = [(e[0], e[1], e[3]) for e in events if e[0] in ("class_start", "class_end", "batch_start", "batch_end")]
    assert by_event == [
        ("class_start", "sim-rp-a1", "1/2"), ("batch_start", "sim-rp-a1", "1/2"), ("batch_end", "sim-rp-a1", "1/2"),
        ("batch_start", "sim-rp-a2", "2/2"), ("batch_end", "sim-rp-a2", "2/2"), ("class_end", "sim-rp-a2", "2/2"),
    ], by_event
    # rp-b's canary host was drained around its canaries, and never touched in a batch
    assert [e[0] for e in events if e[1] == "sim-rp-b1"] == ["drain", "undrain"]
    report = fleet.last_report()
    assert [(b["class"], b["class_index"], b["class_total"], [h["host"] for h in b["hosts"]]) for b in report["batches"]] == [
        ("rp-a", 1, 2, ["sim-rp-a1"]), ("rp-a", 2, 2, ["sim-rp-a2"]), ("rp-b", 1, 1, ["sim-rp-b1"])]
    assert [b["outcome"] for b in report["batches"]] == ["ok", "ok", "stopped"]
    for host in A_HOSTS:
        assert fleet.active(host) == "active", host
    assert fleet.unit("sim-rp-b1") is None, "the stop came before rp-b's first batch"
    seen["units_1"] = fleet.units(A_HOSTS + B_HOSTS)


def runner_layout(fleet: SimFleet, name: str, extravars: dict[str, Any]) -> Path:
    """A private data directory as AWX gives it to ansible-runner: project, inventory, env."""
    private = fleet.workdir / name
    (private / "inventory").mkdir(parents=True)
    (private / "env").mkdir()
    (private / "project").symlink_to(REPO, target_is_directory=True)
    inv = inventory(fleet, name, {})
    (private / "inventory" / "hosts.yml").write_text(inv.read_text(encoding="utf-8"), encoding="utf-8")
    inv.unlink()
    (private / "env" / "extravars").write_text(yaml.safe_dump(extravars), encoding="utf-8")
    envvars = {"ANSIBLE_NOCOLOR": "1", "ANSIBLE_PIPELINING": "1", "ANSIBLE_HOST_KEY_CHECKING": "False", "ANSIBLE_TIMEOUT": "10"}
    (private / "env" / "envvars").write_text(yaml.safe_dump(envvars), encoding="utf-8")
    return private


def test_rollout_through_ansible_runner_with_a_limit(fleet, seen):
    """rollout.yml as an AWX job runs it: ansible-runner's own layout, the class chosen by --limit."""
    ansible_runner = pytest.importorskip("ansible_runner")  # requirements-dev.txt pins it
    # short probes: this test is about the limit and the layout, not the sampling window
    private = runner_layout(fleet, "runner-rollout", {"gpufleet_probe_samples": 2, "gpufleet_probe_interval": 0.2})
    # a limit without localhost skips the controller-side plays: the run stops before any host is probed
    result = ansible_runner.run(private_data_dir=str(private), playbook="playbooks/rollout.yml", limit="rp_a", quiet=True)
    out = result.stdout.read()
    assert result.rc != 0, out[-4000:]
    assert "--limit 'rp_a' leaves out localhost" in out and "--limit 'rp_a,localhost'" in out, out[-4000:]
    assert "PLAY [Probe every target host]" not in out
    # with localhost in the limit, class rp-a is planned and checked from its own hosts only: the
    # load balancer (no class) and class rp-b are outside the run; rp-a already runs the plan
    result = ansible_runner.run(private_data_dir=str(private), playbook="playbooks/rollout.yml", limit="rp_a,localhost",
                                quiet=True)
    out = result.stdout.read()
    assert result.status == "successful" and result.rc == 0, out[-6000:]
    touched = {e["event_data"]["host"] for e in result.events if e.get("event") == "runner_on_ok" and "host" in e.get("event_data", {})}
    assert touched - {"localhost"} == set(A_HOSTS), touched
    assert "every instance already runs the plan, nothing to do" in out
    assert fleet.units(A_HOSTS + B_HOSTS) == seen["units_1"], "the second rollout of rp-a changes nothing; rp-b is untouched"
    report = fleet.last_report()
    assert {h["host"]: h["outcome"] for h in report["hosts"]} == dict.fromkeys(A_HOSTS, "unchanged"), report["hosts"]


def test_plan_through_ansible_runner_writes_the_artifact(fleet, seen):
    ansible_runner = pytest.importorskip("ansible_runner")  # requirements-dev.txt pins it
    plan_file = fleet.workdir / "plan.json"
    # an earlier plan at the same path (one already approved, perhaps) is kept beside the new one, never lost
    plan_file.write_text('{"an": "earlier plan"}\n', encoding="utf-8")
    private = fleet.workdir / "runner"
    private.mkdir()
    inv = inventory(fleet, "plain", {})
    envvars = {"ANSIBLE_NOCOLOR": "1", "ANSIBLE_PIPELINING": "1", "ANSIBLE_HOST_KEY_CHECKING": "False", "ANSIBLE_TIMEOUT": "10"}
    result = ansible_runner.run(private_data_dir=str(private), playbook=str(REPO / "playbooks" / "plan.yml"),
                                inventory=str(inv), envvars=envvars, quiet=True,
                                extravars={"gpufleet_target": TARGET, "gpufleet_guard": "1GiB", "gpufleet_plan_file": str(plan_file)})
    assert result.status == "successful" and result.rc == 0, result.stdout.read()[-6000:]
    # the artifact as AWX passes it to the next workflow node: the set_stats data of the run
    stats = [e for e in result.events if e.get("event") == "playbook_on_stats"]
    artifact = stats[-1]["event_data"]["artifact_data"]["gpufleet_plan"]
    assert artifact == json.loads(plan_file.read_text(encoding="utf-8"))
    (kept,) = [p for p in fleet.workdir.iterdir() if p.name.startswith("plan.json.") and p.name.endswith("~")]
    assert kept.read_text(encoding="utf-8") == '{"an": "earlier plan"}\n'
    assert f"the plan it replaced is kept as {kept}" in result.stdout.read(), "the run says where the earlier plan is"
    assert sorted(artifact["classes"]) == ["rp-a", "rp-b"]
    cls = artifact["classes"]["rp-a"]
    assert cls["deployable"] and cls["decision"] == "deploy" and cls["hosts"] == A_HOSTS
    assert cls["reference_id"].endswith(".yml") and len(cls["key_hash"]) >= 16
    # the larger guard gives a smaller budget than the running one, and every host's new unit checksum
    assert cls["kv_cache_memory_bytes"] < budget(seen["units_1"]["sim-rp-a1"])
    assert all(len(i["unit_checksum"]) == 40 for h in A_HOSTS + B_HOSTS for i in artifact["hosts"][h]["instances"])
    assert fleet.units(A_HOSTS + B_HOSTS) == seen["units_1"], "plan.yml changes nothing"
    assert artifact["hosts"]["sim-rp-b1"]["instances"][0]["unit_checksum"], "rp-b is planned too"
    seen["artifact"] = artifact
    seen["plan_file"] = plan_file


def haproxy_up(fleet: SimFleet) -> None:
    servers = "\n".join(f"    server {h} {fleet.sim.info(h).address}:8000 check" for h in A_HOSTS)
    cfg = HAPROXY_CFG.format(port=FRONT_PORT, servers=servers)
    # the guests have no default route: the load balancer and its backends reach each other
    # through the controller (addresses of these test hosts only)
    lb = fleet.sim.info(LB)
    for host in A_HOSTS:
        info = fleet.sim.info(host)
        subprocess.run(["ip", "-n", lb.netns, "route", "replace", f"{info.address}/32", "via", lb.gateway], check=True)
        subprocess.run(["ip", "-n", info.netns, "route", "replace", f"{lb.address}/32", "via", info.gateway], check=True)
    fleet.harness.exec(LB, ["mkdir", "-p", "/run/haproxy"], check=True)
    fleet.harness.exec(LB, ["sh", "-c", f"cat > /etc/haproxy/haproxy.cfg <<'EOF'\n{cfg}EOF"], check=True)
    fleet.harness.exec(LB, ["systemctl", "restart", "haproxy"], check=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and set(server_states(fleet).values()) != {"UP"}:
        time.sleep(0.3)
    assert set(server_states(fleet).values()) == {"UP"}, server_states(fleet)


def backend_rows(fleet: SimFleet) -> dict[str, list[str]]:
    """HAProxy's ``show stat`` row of each server of the backend (its CSV columns), by server."""
    proc = fleet.harness.exec(LB, ["python3", "-c", (
        "import socket,sys;s=socket.socket(socket.AF_UNIX);s.connect('/run/haproxy/admin.sock');"
        "s.sendall(b'show stat\\n');d=b''\n"
        "while True:\n c=s.recv(65536)\n if not c: break\n d+=c\nsys.stdout.write(d.decode())")])
    rows = {}
    for line in proc.stdout.splitlines():
        cols = line.split(",")
        if len(cols) > 17 and cols[0] == "vllm-main" and cols[1] in A_HOSTS:
            rows[cols[1]] = cols
    return rows


def server_states(fleet: SimFleet) -> dict[str, str]:
    return {server: cols[17].split()[0] for server, cols in backend_rows(fleet).items()}


def answer(request: str | urllib.request.Request, timeout: float) -> str:
    """One request through HAProxy: its HTTP status, ``refused`` when the connection was refused, or the error."""
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return str(resp.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except urllib.error.URLError as exc:
        return "refused" if isinstance(exc.reason, ConnectionRefusedError) else f"error: {exc.reason}"
    except OSError as exc:
        return f"error: {exc}"


def test_apply_the_approved_plan_behind_haproxy(fleet, seen):
    haproxy_up(fleet)
    failing = fleet.workdir / "failing-drain.yml"
    failing.write_text(FAILING_DRAIN, encoding="utf-8")
    inv = inventory(fleet, "haproxy", {"rp_a": haproxy_hooks(), "rp_b": {"drain": str(failing)}})
    url = f"http://{fleet.sim.info(LB).address}:{FRONT_PORT}/v1/models"
    done = threading.Event()
    results: dict[str, int] = {}
    observed: list[tuple[str, str, str]] = []  # (host, unit state, haproxy status)

    def traffic() -> None:
        for _unused in range(6000):  # bounded: at most 6000 requests
            if done.is_set():
                return
            key = answer(url, timeout=10)
            results[key] = results.get(key, 0) + 1
            time.sleep(0.05)

    def watch() -> None:
        while not done.is_set():
            states = server_states(fleet)
            for host in A_HOSTS:
                observed.append((host, fleet.active(host), states.get(host, "?")))
            time.sleep(0.2)

    threads = [threading.Thread(target=traffic, daemon=True), threading.Thread(target=watch, daemon=True)]
    for t in threads:
        t.start()
    try:
        # no guard given: the budget comes from the approved plan (planned with a 1GiB guard), not a new plan
        rc, out = fleet.rollout({"gpufleet_target": TARGET, "gpufleet_plan": seen["artifact"],
                                 "gpufleet_class_pause": True, "gpufleet_class_pause_unattended": "continue"}, inventory=inv)
    finally:
        done.set()
        for t in threads:
            t.join(timeout=30)
    # class rp-a was applied; the unattended pause went on to rp-b as configured, whose drain hook
    # failed: the host failed before anything on it was kept or stopped (a first install: nothing runs)
    assert rc != 0, out[-6000:]
    assert "gpufleet_class_pause_unattended is continue; continuing" in out, out[-6000:]
    assert re.search(r"sim-rp-b1: Fail the drain of a host in a batch failed:\s+the load balancer refused to drain sim-rp-b1", out), \
        out[-6000:]
    assert re.search(r"sim-rp-b1: .*the load balancer refused to drain sim-rp-b1.*; the host was not touched", out), out[-6000:]
    planned = seen["artifact"]["classes"]["rp-a"]["kv_cache_memory_bytes"]
    units = fleet.units(A_HOSTS + B_HOSTS)
    for host in A_HOSTS:
        assert budget(units[host]) == planned, host
        assert fleet.plan(host)["kv_cache_memory_bytes"] == planned
    assert units["sim-rp-b1"] is None and fleet.active("sim-rp-b1") != "active", "sim-rp-b1 is rolled back"
    # HAProxy: every moment a host's engine was not active, its server was in MAINT; all UP at the end
    down = [o for o in observed if o[1] != "active"]
    assert {h for h, _s, _st in down} == set(A_HOSTS), "both hosts restarted while watched"
    assert all(st == "MAINT" for _h, _s, st in down), [o for o in down if o[2] != "MAINT"]
    assert set(server_states(fleet).values()) == {"UP"}
    # traffic through HAProxy during the rollout: no connection refused, no failed request
    assert results.get("200", 0) > 50 and set(results) == {"200"}, results
    seen["units_3"] = units
    seen["requests"] = results


def test_plan_refused_when_free_memory_fell_below_the_floor(fleet, seen):
    before = fleet.units(A_HOSTS + B_HOSTS)
    fleet.sim.inject_cotenant("sim-rp-a2", gpu=0, size=3 * GIB, pid=None, remove=False)
    try:
        rc, out = fleet.rollout({"gpufleet_target": TARGET, "gpufleet_plan_file": str(seen["plan_file"])},
                                inventory=inventory(fleet, "plain", {}))
    finally:
        fleet.sim.inject_cotenant("sim-rp-a2", gpu=0, size=None, pid=None, remove=True)
    assert rc != 0
    assert re.search(r"the approved plan \(\S+\) no longer holds: sim-rp-a2 main rank 0 \(GPU 0\): free memory \S+ \(\d+\) "
                     r"is below the planned floor \S+ \(\d+\); it was \S+ \(\d+\) when planned", out), out[-6000:]
    assert "no host was touched" in out
    assert "Boot the canary engine" not in out and "PLAY [Roll out in serial batches]" not in out
    assert fleet.units(A_HOSTS + B_HOSTS) == before
    for host in A_HOSTS:
        assert fleet.active(host) == "active", host


def test_a_failing_manual_canary_gives_the_canary_host_back_to_haproxy(fleet, seen):
    """The manual canary fails on the canary host (its engine refuses at boot): the class stops before any
    batch, the canaries start the production instance again on its previous unit, and the host that was
    drained for the canaries goes back into HAProxy once that instance answers; the failure says so."""
    canary = A_HOSTS[0]
    haproxy_up(fleet)  # (again: the same configuration, every server UP)
    inv = inventory(fleet, "haproxy-canary", {"rp_a": haproxy_hooks()})
    before = fleet.units(A_HOSTS)
    done = threading.Event()
    observed: list[str] = []

    def watch() -> None:
        while not done.is_set():
            observed.append(server_states(fleet).get(canary, "?"))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    fleet.sim.inject_fail_next_boot(canary, "startup")
    watcher.start()
    try:
        # a larger guard: a new budget, so the manual canary runs (and takes the failing boot)
        rc, out = fleet.rollout({"gpufleet_target": "rp_a", "gpufleet_guard": "2GiB"}, inventory=inv)
    finally:
        done.set()
        watcher.join(timeout=30)
        fleet.sim.inject_fail_next_boot(canary, None)  # taken by the canary's boot; cancelled if it was not
    assert rc != 0, out[-6000:]
    assert f"class rp-a stopped on {canary}: Boot the canary engine (manual): vLLM canary (manual) did not boot" in out, \
        out[-6000:]
    assert f"the canary host {canary} was undrained: its production instance main answers /health again on its previous unit" \
        in out, out[-6000:]
    assert progress(out) == [], "a class whose canary failed reaches no batch"
    assert "MAINT" in observed, "the canary host was drained while the canaries ran"
    assert set(server_states(fleet).values()) == {"UP"}
    assert fleet.units(A_HOSTS) == before
    assert fleet.active(canary) == "active"


def test_a_drain_that_outlasts_its_wait_gives_the_servers_back(fleet):
    """The HAProxy example's drain (playbooks/examples/haproxy/haproxy_server_state.py, as drain.yml runs it) with
    a request in flight that takes longer than the drain's wait: the drain fails and gives every server it put in
    MAINT its previous state back, so the host keeps serving; the request in flight completes."""
    haproxy_up(fleet)
    script = (HAPROXY_DIR / "haproxy_server_state.py").read_text(encoding="utf-8")
    fleet.harness.exec(LB, ["sh", "-c", f"cat > /tmp/haproxy_server_state.py <<'EOF'\n{script}EOF"], check=True)
    url = f"http://{fleet.sim.info(LB).address}:{FRONT_PORT}/v1/completions"
    body = json.dumps({"model": GROUP_VARS["gpufleet_model"], "prompt": "a b c", "max_tokens": 4000}).encode()
    answers: list[int] = []

    def slow() -> None:  # about 8 s of tokens (the simulator's 2 ms a token)
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            answers.append(resp.status)

    client = threading.Thread(target=slow, daemon=True)
    client.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(n > 0 for n in sessions(fleet).values()):
        time.sleep(0.1)
    assert any(n > 0 for n in sessions(fleet).values()), "the slow request is in flight"
    drain = fleet.harness.exec(LB, ["python3", "/tmp/haproxy_server_state.py", "--socket", "/run/haproxy/admin.sock",
                                    "--state", "maint", "--wait", "1", *[f"vllm-main/{h}" for h in A_HOSTS]])
    client.join(timeout=60)
    assert drain.returncode == 1, drain.stdout + drain.stderr
    assert "session(s) after 1 s" in drain.stderr and "restored vllm-main/sim-rp-a1 to ready" in drain.stderr, drain.stderr
    assert set(server_states(fleet).values()) == {"UP"}, "every server is back as it was"
    assert answers == [200], "the request in flight completed"
    # a server HAProxy does not know, after one it put in MAINT: that one is given back too
    unknown = fleet.harness.exec(LB, ["python3", "/tmp/haproxy_server_state.py", "--socket", "/run/haproxy/admin.sock",
                                      "--state", "maint", "--wait", "5", f"vllm-main/{A_HOSTS[0]}", "vllm-main/no-such-host"])
    assert unknown.returncode != 0 and "haproxy has no server vllm-main/no-such-host" in unknown.stderr, unknown.stderr
    assert f"restored vllm-main/{A_HOSTS[0]} to ready" in unknown.stderr, unknown.stderr
    assert set(server_states(fleet).values()) == {"UP"}
    # an operator put one server in MAINT before the run: the drain records it, and the undrain (as undrain.yml
    # runs it, with the drain's lines) leaves it in MAINT and puts the other back
    base = ["python3", "/tmp/haproxy_server_state.py", "--socket", "/run/haproxy/admin.sock"]
    servers = [f"vllm-main/{h}" for h in A_HOSTS]
    fleet.harness.exec(LB, ["python3", "-c", SOCKET_SEND.format(command=f"set server {servers[0]} state maint")], check=True)
    drained = fleet.harness.exec(LB, [*base, "--state", "maint", "--wait", "10", *servers], check=True)
    assert [json.loads(line)["previous"] for line in drained.stdout.splitlines()] == ["maint", "ready"], drained.stdout
    undrained = fleet.harness.exec(LB, [*base, "--state", "ready", "--wait", "30", "--previous",
                                        json.dumps(drained.stdout.splitlines()), *servers], check=True)
    assert json.loads(undrained.stdout.splitlines()[0]) == {"server": servers[0], "status": "MAINT", "kept": "maint"}, undrained.stdout
    assert server_states(fleet) == {A_HOSTS[0]: "MAINT", A_HOSTS[1]: "UP"}
    fleet.harness.exec(LB, [*base, "--state", "ready", "--wait", "30", servers[0]], check=True)  # the operator's turn
    assert set(server_states(fleet).values()) == {"UP"}


# a runtime API command sent to the admin socket (an operator's command)
SOCKET_SEND = ("import socket;s=socket.socket(socket.AF_UNIX);s.connect('/run/haproxy/admin.sock');"
               "s.sendall(b'{command}\\n');print(s.recv(4096).decode())")


def sessions(fleet: SimFleet) -> dict[str, int]:
    """HAProxy's current sessions per server of the backend (show stat's scur)."""
    return {server: int(cols[4] or 0) for server, cols in backend_rows(fleet).items()}


PROMETHEUS_PORT = 9090
PROMETHEUS_CFG = """\
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: vllm
    static_configs:
      - targets: [{engines}]
  - job_name: node
    static_configs:
      - targets: [{nodes}]
"""


def prometheus_up(fleet: SimFleet) -> str:
    """Prometheus (the Debian package) on the load-balancer host, scraping rp-a's engines and node_exporters
    every second; the textfile metrics written once by the metrics exporter (what its timer runs). Returns its URL."""
    engines = ", ".join(f"'{fleet.sim.info(h).address}:8000'" for h in A_HOSTS)
    nodes = ", ".join(f"'{fleet.sim.info(h).address}:9100'" for h in A_HOSTS)
    cfg = PROMETHEUS_CFG.format(engines=engines, nodes=nodes)
    for host in A_HOSTS:
        fleet.harness.exec(host, ["systemctl", "start", "gpufleet-vllm-metrics.service", "prometheus-node-exporter.service"], check=True)
    fleet.harness.exec(LB, ["sh", "-c", f"cat > /etc/prometheus/prometheus.yml <<'EOF'\n{cfg}EOF"], check=True)
    fleet.harness.exec(LB, ["systemctl", "restart", "prometheus"], check=True)
    url = f"http://{fleet.sim.info(LB).address}:{PROMETHEUS_PORT}"
    deadline = time.monotonic() + 120
    up: list[Any] = []
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/api/v1/query?query=up%3D%3D1", timeout=5) as resp:
                up = json.loads(resp.read())["data"]["result"]
            if len(up) == 2 * len(A_HOSTS):
                return url
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"Prometheus did not scrape every engine and node_exporter: {up}")


def test_a_bake_judged_through_prometheus_rolls_the_class_back_behind_haproxy(fleet):
    """Class rp-a bakes each batch 6 s, judged from Prometheus's query API (gpufleet_prometheus_url), with the
    HAProxy example's hooks (drain, undrain, and the canary weight during the bake), a capacity budget of one host
    under a serial of two, and gpufleet_on_failure: rollback_class. Completions go through HAProxy the whole run.
    Batch 1's host passes its bake against the host not yet changed (its GPU memory margin read from the textfile
    metrics); batch 2's new engine serves 0.05 s per output token (the simulator's latency knob), above the class's
    0.03 s limit: it fails its bake, rolls itself back, and the class rollback restores batch 1's host. Every unit
    is as before, every request answered, HAProxy never had more than one server of the class out at once, and each
    canary had a quarter of its weight during its bake and its full weight afterwards."""
    haproxy_up(fleet)
    # Prometheus on the load balancer reaches the engines over the routes haproxy_up set
    prometheus = prometheus_up(fleet)
    hooks = dict(haproxy_hooks(), bake_start=str(HAPROXY_DIR / "bake_start.yml"), bake_end=str(HAPROXY_DIR / "bake_end.yml"))
    inv = inventory(fleet, "bake", {"rp_a": hooks}, gpufleet_bake_seconds=6, gpufleet_prometheus_url=prometheus,
                    # the exporter writes each new unit's margin within the bake (the check reads no export from before it)
                    vllm_service_metrics_interval_sec=2,
                    gpufleet_analysis={"itl_p90": {"max_seconds": 0.03, "min_requests": 5}, "ttft_p90": {"min_requests": 5},
                                       "e2e_p90": False, "success_rate": {"min_requests": 5}, "preemptions": {"min_requests": 5}},
                    gpufleet_on_failure="rollback_class", gpufleet_max_unavailable=1, gpufleet_haproxy_canary_weight="25%")
    before = fleet.units(A_HOSTS)
    since = len(fleet.reports())
    url = f"http://{fleet.sim.info(LB).address}:{FRONT_PORT}/v1/completions"
    body = json.dumps({"prompt": "hello", "max_tokens": 8}).encode()
    done = threading.Event()
    results: dict[str, int] = {}
    observed: list[dict[str, tuple[str, str]]] = []  # per look: server -> (status, weight)

    def client() -> None:
        for _unused in range(20000):  # bounded
            if done.is_set():
                return
            key = answer(urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}), timeout=30)
            results[key] = results.get(key, 0) + 1

    def watch() -> None:
        while not done.is_set():
            rows = backend_rows(fleet)
            observed.append({server: (cols[17].split()[0], cols[18]) for server, cols in rows.items()})
            time.sleep(0.2)

    threads = [threading.Thread(target=client, daemon=True) for _n in range(3)] + [threading.Thread(target=watch, daemon=True)]
    fleet.sim.inject_latency_next_boot("sim-rp-a2", 0.05)
    for t in threads:
        t.start()
    try:
        # a new guard: a new budget for the class (the canary host is drained for its canaries)
        rc, out = fleet.rollout({"gpufleet_target": "rp_a", "gpufleet_guard": "1.25GiB", "gpufleet_rollout_serial": 2}, inventory=inv)
    finally:
        done.set()
        for t in threads:
            t.join(timeout=60)
        fleet.sim.inject_latency_next_boot("sim-rp-a2", None)
    assert rc != 0, out[-6000:]
    report = fleet.last_report(since)
    assert report is not None
    # the budget of one host under a serial of two: one host per batch
    assert [[h["host"] for h in b["hosts"]] for b in report["batches"]] == [["sim-rp-a1"], ["sim-rp-a2"]], report["batches"]
    first, second = (b["analysis"] for b in report["batches"])
    assert first["source"] == second["source"] == f"Prometheus {prometheus}", first
    checks = {c["name"]: c for c in first["checks"]}
    assert first["verdict"] == "pass" and first["baseline_hosts"] == 1, first
    assert checks["itl_p90"]["verdict"] == "pass" and checks["itl_p90"]["samples"]["canary"] >= 5, checks
    assert checks["memory_margin"]["verdict"] == "pass" and checks["memory_margin"]["canary"] > 0, checks["memory_margin"]
    checks = {c["name"]: c for c in second["checks"]}
    assert second["verdict"] == "fail" and checks["itl_p90"]["verdict"] == "fail" and checks["itl_p90"]["canary"] > 0.03, second
    assert "class rp-a: rolled back with sim-rp-a2: sim-rp-a1" in out, out[-6000:]
    assert {h["host"]: h["outcome"] for h in report["hosts"]} == {"sim-rp-a1": "rolled_back", "sim-rp-a2": "rolled_back"}
    assert fleet.units(A_HOSTS) == before, "every host of the class has its previous unit back, byte for byte"
    for host in A_HOSTS:
        assert fleet.active(host) == "active", host
    # through HAProxy the whole run: every request answered, none refused
    assert results.get("200", 0) > 50 and set(results) == {"200"}, results
    # the capacity budget: never more than one server of the class out of HAProxy (MAINT, DRAIN, DOWN) at once
    out_at_once = [sorted(s for s, (status, _w) in look.items() if status != "UP") for look in observed]
    assert max(len(o) for o in out_at_once) == 1, [o for o in out_at_once if len(o) > 1][:5]
    assert {s for o in out_at_once for s in o} == set(A_HOSTS), "both hosts were taken out in turn"
    # each canary took a quarter of its weight during its bake, its full weight otherwise
    for host in A_HOSTS:
        weights = [look[host][1] for look in observed if host in look]
        assert "25" in weights and weights[-1] == "100", (host, sorted(set(weights)))
    assert set(server_states(fleet).values()) == {"UP"}
