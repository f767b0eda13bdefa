#!/usr/bin/env python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Probe over SSH against ping: ``gpufleet.vllm.gpu_memory_info`` vs ``ansible.builtin.ping``.

Boots test hosts (systemd-nspawn guests reached over SSH, ``tests/hosts/testhosts.py``),
gives each a fake NVML state with 8 H200-sized GPUs and three processes per GPU,
then runs ad-hoc ``ansible <hosts> -m gpufleet.vllm.gpu_memory_info`` and
``ansible <hosts> -m ansible.builtin.ping`` alternately ``--runs`` times with the
same forks, connection settings and inventory, timing each command's wall clock.
One untimed warm-up of each comes first. Reports the medians and the ratio
module / ping (goal: within 1.3x). The hosts are always torn down (try/finally).

Run as root (the harness needs it). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("GPUFLEET_CACHE") or REPO / ".cache")
sys.path.insert(0, str(REPO / "tests" / "hosts"))
sys.path.insert(0, str(REPO / "tests" / "fake_nvml"))

import nvml_state  # noqa: E402  pylint: disable=wrong-import-position,import-error
import testhosts  # noqa: E402  pylint: disable=wrong-import-position,import-error

GOAL_RATIO = 1.3
H200_TOTAL = 150754820096
H200_RESERVED = 566231040


def gpu_state(gpus: int) -> dict[str, Any]:
    """8 busy GPUs: a vLLM-sized worker, a small compute process and a graphics client on each."""
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(i, H200_TOTAL, reserved=H200_RESERVED, name="NVIDIA H200") for i in range(gpus)]
    for i in range(gpus):
        # made-up pids: processes of another pid namespace (the fake NVML drops a dead local pid)
        nvml_state.add_process(state, gpu=i, pid=4000 + i, used=(100 + i) << 30, name="python3", pidns="other")
        nvml_state.add_process(state, gpu=i, pid=1, used=256 << 20, name="systemd")
        nvml_state.add_process(state, gpu=i, pid=5000 + i, used=64 << 20, kind="graphics", name="Xorg", pidns="other")
    return state


def ansible_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "ANSIBLE_COLLECTIONS_PATH": str(CACHE / "collections"),
        "ANSIBLE_HOST_KEY_CHECKING": "False",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_PIPELINING": "1",
        "ANSIBLE_LOAD_CALLBACK_PLUGINS": "0",
        "ANSIBLE_TIMEOUT": "20",
    })
    return env


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, cwd=str(REPO))
    return time.perf_counter() - start, proc


def check_probe_output(proc: subprocess.CompletedProcess[str], hosts: list[str], gpus: int) -> None:
    """The module answered on every host with every GPU (one-line output)."""
    if proc.returncode != 0:
        raise RuntimeError(f"gpu_memory_info failed (rc {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    for host in hosts:
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(f"{host} | SUCCESS")), None)
        if line is None:
            raise RuntimeError(f"gpu_memory_info: no success line for {host}: {proc.stdout[-2000:]}")
        result = json.loads(line.split("=>", 1)[1])
        if len(result.get("gpus", [])) != gpus:
            raise RuntimeError(f"gpu_memory_info on {host}: {len(result.get('gpus', []))} GPUs, expected {gpus}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--prefix", default="bench-pp")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print(json.dumps({"error": "run as root: test hosts use systemd-nspawn and network namespaces"}))
        return 2
    ansible = shutil.which("ansible", path=str(CACHE / "venv" / "bin") + os.pathsep + os.environ.get("PATH", ""))
    if ansible is None:
        print(json.dumps({"error": "no `ansible` command (make venv)"}))
        return 2
    names = [f"{args.prefix}-{i}" for i in range(1, args.hosts + 1)]
    harness = testhosts.Harness()
    env = ansible_env()
    out: dict[str, Any] = {"benchmark": "probe_vs_ping", "hosts": names, "gpus_per_host": args.gpus,
                           "processes_per_gpu": 3, "runs": args.runs, "forks": args.hosts, "goal_ratio": GOAL_RATIO}
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        try:
            start = time.perf_counter()
            harness.up(names, timeout=180)
            out["boot_seconds"] = round(time.perf_counter() - start, 2)
            for name in names:
                state_file = Path(harness.get(name).fake_nvml_dir) / "state"
                with nvml_state.locked(str(state_file)):
                    nvml_state.save(str(state_file), gpu_state(args.gpus))
            inventory = harness.inventory(Path(tmp) / "inventory.yml", names=names)
            common = [ansible, "-i", str(inventory), "all", "-f", str(args.hosts), "-o"]
            probe = common + ["-m", "gpufleet.vllm.gpu_memory_info"]
            ping = common + ["-m", "ansible.builtin.ping"]
            out["commands"] = {"module": " ".join(["ansible", "-i", "INVENTORY"] + probe[3:]),
                               "ping": " ".join(["ansible", "-i", "INVENTORY"] + ping[3:])}
            # warm-up: SSH control sockets, byte-compiled Ansible on the controller
            for argv in (ping, probe):
                _unused, proc = timed(argv, env)
            check_probe_output(proc, names, args.gpus)
            module_s: list[float] = []
            ping_s: list[float] = []
            for _run in range(args.runs):
                seconds, proc = timed(probe, env)
                check_probe_output(proc, names, args.gpus)
                module_s.append(seconds)
                seconds, proc = timed(ping, env)
                if proc.returncode != 0:
                    raise RuntimeError(f"ping failed (rc {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
                ping_s.append(seconds)
            med_m, med_p = statistics.median(module_s), statistics.median(ping_s)
            out.update({
                "module_seconds": [round(s, 3) for s in module_s],
                "ping_seconds": [round(s, 3) for s in ping_s],
                "module_median_s": round(med_m, 3),
                "ping_median_s": round(med_p, 3),
                "ratio": round(med_m / med_p, 3),
                "within_goal": med_m / med_p <= GOAL_RATIO,
                "load_average_1m": round(os.getloadavg()[0], 2),
            })
        except (testhosts.HarnessError, RuntimeError, OSError, ValueError) as exc:
            out["error"] = str(exc)
        finally:
            try:
                harness.down(names)
                leftovers = [str(x) for x in harness.leftovers() if x.owner in names]
                out["teardown"] = "clean" if not leftovers else "leftovers: " + "; ".join(leftovers)
            except testhosts.HarnessError as exc:
                out["teardown"] = f"failed: {exc}"
    print(json.dumps(out, indent=2))
    return 0 if "error" not in out and out.get("teardown") == "clean" else 1


if __name__ == "__main__":
    sys.exit(main())
