# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A simulated fleet for the rollout tests: fleet file, inventory, ansible-playbook runs, host state.

:class:`SimFleet` writes a fleet file (``sim/fleetctl.py`` format), boots and provisions
its hosts through ``fleetctl.Fleet``, writes Ansible inventories that put hosts in host
classes, runs ``playbooks/rollout.yml`` and reads back what each host runs (unit file,
kept previous unit, plan file, service state) and the run reports.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import plan_file_figures

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sim"))
sys.path.insert(0, str(REPO / "tests" / "hosts"))

import fleetctl  # noqa: E402  pylint: disable=wrong-import-position,import-error
import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error

ROLLOUT = REPO / "playbooks" / "rollout.yml"
PLAN = REPO / "playbooks" / "plan.yml"
UNIT_DIR = "/etc/systemd/system"
STATE_DIR = "/etc/gpufleet"

# What every fleet test of the simulated engine gives its hosts beside its own settings
SIM_TEST_VARS: dict[str, Any] = {
    # latency on a shared two-core test machine is noise, not a property of the budget
    "gpufleet_canary_tolerances": {"latency_ratio": 20.0},
    # the simulated engine records its GPU processes in the fake NVML state
    "vllm_service_read_write_paths": ["/etc/fake-nvml"],
    "vllm_service_boot_timeout": 120,
    # 3 probe samples 0.2 s apart instead of 9 at 0.5 s: nothing here moves free memory between samples
    # (test_rollout_faults.py keeps the defaults for the faults that do)
    "gpufleet_probe_samples": 3,
    "gpufleet_probe_interval": 0.2,
}
L40S = {"name": "NVIDIA L40S", "total": 48305799168, "reserved": 462422016, "cc": "8.9"}
BATCH_RE = re.compile(r"TASK \[(?:gpufleet\.vllm\.vllm_service : )?Report what changes on this host\][^\n]*\nok: \[(\S+)\]")


def plan_view(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A host's plan file (format 3, launch schema 1) as the collection reads it flat
    (``_launch.plan_file_figures``), so a test reads ``plan["kv_cache_memory_bytes"]``."""
    assert doc.get("format") == 3 and doc["launch"]["schema"] == 1, doc
    return plan_file_figures(doc)


class SimFleet:
    """Simulated hosts of one fleet file, with one vLLM instance per host.

    ``group_vars`` are the inventory variables every host gets; the fleet adds
    ``gpufleet_host_class``, ``gpufleet_profile_store`` and ``gpufleet_report_dir``.
    """

    def __init__(self, workdir: Path, harness: Any, fleet: Mapping[str, Any], group_vars: Mapping[str, Any],
                 instance: str = "main") -> None:
        self.workdir = workdir
        self.harness = harness
        self.spec = dict(fleet)
        self.hosts = list(fleet["hosts"])
        fleet_file = workdir / "fleet.yml"
        fleet_file.write_text(yaml.safe_dump(self.spec), encoding="utf-8")
        self.sim = fleetctl.Fleet(fleet_file)
        self.store = workdir / "profiles"
        self.report_dir = workdir / "reports"
        self.inventory = workdir / "inventory.yml"
        self.group_vars = dict(group_vars, gpufleet_profile_store=str(self.store),
                               gpufleet_report_dir=str(self.report_dir))
        self.instance = instance
        self.unit_path = f"{UNIT_DIR}/vllm-{instance}.service"
        self.snapshot_path = f"{STATE_DIR}/units/vllm-{instance}.snapshot.json"
        self.plan_path = f"{STATE_DIR}/{instance}.plan.json"
        self.runs = 0

    def create(self, classes: Mapping[str, Sequence[str]] | None = None) -> None:
        """Boot and provision every host (fresh NVML state), then write the inventory."""
        self.sim.create(reset_state=True)
        if classes is None:
            classes = {}
            for host, spec in self.spec["hosts"].items():
                classes.setdefault(spec["class"], []).append(host)  # type: ignore[attr-defined]
        self.write_inventory(classes)

    def write_inventory(self, classes: Mapping[str, Sequence[str]], path: Path | None = None) -> Path:
        """An inventory with one group per class (``gpufleet_host_class`` set); default path: ``self.inventory``."""
        data = self.harness.inventory_data()
        children = {}
        for cls, names in classes.items():
            children[re.sub(r"[^A-Za-z0-9_]", "_", cls)] = {
                "hosts": {name: data["all"]["hosts"][name] for name in names},
                "vars": dict(self.group_vars, gpufleet_host_class=cls),
            }
        path = path or self.inventory
        path.write_text(yaml.safe_dump({"all": {"children": children}}), encoding="utf-8")
        return path

    # ------------------------------------------------------------ running
    def rollout(self, extra_vars: Mapping[str, Any] | None = None,
                on_line: Callable[[str], None] | None = None, timeout: float = 600,
                inventory: Path | None = None,
                on_start: Callable[[subprocess.Popen[str]], None] | None = None,
                playbook: Path = ROLLOUT, args: Sequence[str] = ()) -> tuple[int, str]:
        """Run rollout.yml (or ``playbook`` with ``args``); returns (exit status, output).

        The run is the leader of its own process group (``os.killpg`` stops it with its
        workers and SSH clients, as a lost controller would); ``on_start`` gets the
        process as soon as it runs, ``on_line`` every output line.
        """
        # A host whose link goes down keeps a stale SSH control master; keep-alives make
        # sessions multiplexed over it fail instead of waiting for ever.
        env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_PIPELINING="1", ANSIBLE_HOST_KEY_CHECKING="False",
                   ANSIBLE_TIMEOUT="10",
                   ANSIBLE_SSH_ARGS="-C -o ControlMaster=auto -o ControlPersist=60s "
                                    "-o ServerAliveInterval=5 -o ServerAliveCountMax=2")
        argv = ["ansible-playbook", "-i", str(inventory or self.inventory), str(playbook), *args]
        if extra_vars:
            argv += ["--extra-vars", json.dumps(dict(extra_vars))]
        # no terminal: a run never waits for an answer (a pause between classes takes its unattended policy);
        # the whole run is killed at the timeout or when a callback raises, never left behind
        try:
            done = procgroup.run(argv, timeout=timeout, env=env, cwd=REPO, on_start=on_start, on_line=on_line)
            rc, output = done.returncode, done.stdout
        except subprocess.TimeoutExpired as exc:
            rc, output = -9, str(exc.output or "") + f"\n(killed after {timeout:.0f} s)\n"
        # every run's whole output stays next to the fleet file, for a failed assertion's context
        self.runs += 1
        (self.workdir / f"rollout-{self.runs}.log").write_text(output, encoding="utf-8")
        return rc, output

    # ------------------------------------------------------------ reading
    def read(self, host: str, path: str) -> str | None:
        proc = self.harness.exec(host, ["cat", path])
        return proc.stdout if proc.returncode == 0 else None

    def forget_probe_history(self, host: str) -> None:
        """Delete ``host``'s probe history in the profile store, as an operator does once a
        co-tenant that made its ranks unstable is gone for good."""
        (self.store / ".probe-history" / f"{host}.json").unlink(missing_ok=True)

    def guest_path(self, host: str, path: str) -> Path:
        """``path`` of the guest as the controller sees it (the host's root mount): cheap to poll."""
        return Path(self.sim.info(host).root) / path.lstrip("/")

    def active(self, host: str) -> str:
        return self.harness.exec(host, ["systemctl", "is-active", f"vllm-{self.instance}.service"]).stdout.strip()

    def unit(self, host: str) -> str | None:
        return self.read(host, self.unit_path)

    def units(self, hosts: Sequence[str] | None = None) -> dict[str, str | None]:
        return {h: self.unit(h) for h in (hosts or self.hosts)}

    def snapshot(self, host: str) -> dict[str, Any] | None:
        """The host's last snapshot document of the instance (what a rollback restores), or None."""
        text = self.read(host, self.snapshot_path)
        return json.loads(text) if text else None

    def previous(self, host: str) -> str | None:
        """The unit the last snapshot keeps (None: no snapshot, or no unit before the change it belongs to)."""
        doc = self.snapshot(host)
        kept = (doc or {}).get("files", {}).get("unit")
        return base64.b64decode(kept["data"]).decode("utf-8") if kept else None

    def plan(self, host: str) -> dict[str, Any]:
        """The host's plan file, its launch record's figures beside the instance's fields (:func:`plan_view`)."""
        text = self.read(host, self.plan_path)
        return plan_view(json.loads(text)) if text else {}

    def profiles(self, host_class: str = "*") -> list[Path]:
        return sorted(self.store.glob(f"{host_class}/*.yml"))

    def reports(self) -> list[Path]:
        return sorted(self.report_dir.glob("*/report.json"), key=lambda p: p.stat().st_mtime)

    def last_report(self, since: int = 0) -> dict[str, Any] | None:
        """The newest report.json if more than ``since`` reports exist now, else None."""
        found = self.reports()
        return json.loads(found[-1].read_text(encoding="utf-8")) if len(found) > since else None


def l40s_fleet(boot_delay_s: float) -> dict[str, Any]:
    """The part of a fleet file every fleet test shares: the simulated engine's costs, the driver
    and the L40S GPU model; a test adds its own ``classes`` and ``hosts``."""
    return {
        "engine": {
            "boot_delay_s": boot_delay_s,
            "token_delay_s": 0.002,
            "costs": {
                "cuda_context_bytes": "500MiB",
                "peak_activation_bytes": "1.25GiB",
                "non_torch_bytes": "600MiB",
                "cuda_graph_bytes": "0.75GiB",
            },
        },
        "system": {"driver": "550.127.05", "cuda": 12040, "nvml": "12.550.127.05"},
        "gpu_models": {"l40s": dict(L40S)},
    }


def class_unit(unit_text: str | None) -> str | None:
    """A unit as every host of its class runs it: each host's own cards (CUDA_VISIBLE_DEVICES, their
    UUIDs) left out, so that two hosts of one plan compare equal."""
    return re.sub(r"(?m)^Environment=CUDA_VISIBLE_DEVICES=\S+$", "Environment=CUDA_VISIBLE_DEVICES=<the host's cards>",
                  unit_text) if unit_text is not None else None


def budget(unit_text: str | None) -> int | None:
    match = re.search(r"--kv-cache-memory-bytes (\d+)", unit_text or "")
    return int(match.group(1)) if match else None


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP counters per host."""
    out: dict[str, dict[str, int]] = {}
    for host, counters in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", output, flags=re.M):
        out[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counters)}
    return out


def reached(output: str) -> list[str]:
    """Hosts that reached the serial batches, in order."""
    return BATCH_RE.findall(output)
