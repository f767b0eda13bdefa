#!/usr/bin/env python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Rollout overhead per host on the simulated fleet (8 and 32 hosts by default).

For each fleet size: writes a fleet file (one class, 2 GPUs per host, Llama-3.1-8B
TP=2 on the simulated engine), creates the fleet with ``sim/fleetctl.py``'s
``Fleet``, runs ``ansible-playbook playbooks/rollout.yml`` on it twice - the first
install on fresh hosts, then an update (a larger guard: a new budget on every host,
the rollout operators repeat) - and destroys it again (always, try/finally). Every
output line of the playbook is time-stamped on arrival, so each run splits into

* the fixed part: validation, probe, profiled + manual canary, plan;
* the serial batches of the roll-out play (one ``PLAY [Roll out in serial batches]``
  header per batch), each with its hosts.

The engine's boot-to-healthy time is read per host from the guest's journal
(systemd's ``Started vllm-<instance>.service`` to the engine's ``Application
startup complete.``). Per batch, ``overhead = batch wall - the slowest
boot-to-healthy of its hosts`` (the hosts of a batch boot in parallel); the
per-host overhead is the sum over batches divided by the hosts (goal < 5 s).
The marginal cost of a host, ``(batches wall at 32 - at 8) / 24`` (installs), is
reported too, and so is the fixed part's growth per host between the smallest and the largest
size (updates), with the fixed part that line projects for 1,000 hosts. Per run: the seconds of
each play before the first batch, and the remote calls every host gets before it (the canary
host, first by name, separately: its canaries).

CPU: the machine's and the controller's, read at every task banner, split each run (and its tasks, ``cpu_by_task``)
into the controller's share and the rest (the simulated hosts, which share the controller's cores here); after the
update, one ad-hoc module call and one raw call on every host give what a remote call costs (``remote_call_cpu``).

Remote calls: ``ssh`` runs through a wrapper that logs the host and the time of every
call (pipelining on, so one call is one module run or one raw command on the host); the
calls a host gets inside the roll-out play's batches are its deploy's round trips.

Run as root. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("GPUFLEET_CACHE") or REPO / ".cache")
sys.path.insert(0, str(REPO / "sim"))
sys.path.insert(0, str(REPO / "tests" / "hosts"))

import fleetctl  # noqa: E402  pylint: disable=wrong-import-position,import-error
import testhosts  # noqa: E402  pylint: disable=wrong-import-position,import-error

GOAL_SECONDS = 5.0
PLAYBOOK = REPO / "playbooks" / "rollout.yml"
ROLLOUT_PLAY = "Roll out in serial batches"
CLASS = "bench-l40s"
INSTANCE = "main"
HOST_RE = re.compile(r"^(?:ok|changed|failed|fatal|skipping|unreachable): \[([^\]]+)\]")
TASK_RE = re.compile(r"^TASK \[(.+?)\] \**$")
INCLUDED_RE = re.compile(r"^included: .+ for (.+)$")
# the lines that open a task or a play in ansible-playbook's output (and its recap, which closes the last task)
BANNERS = ("TASK [", "PLAY [", "PLAY RECAP")


def fleet_file(names: list[str], boot_delay: float) -> dict[str, Any]:
    return {
        "engine": {
            "boot_delay_s": boot_delay,
            "token_delay_s": 0.002,
            "costs": {"cuda_context_bytes": "500MiB", "peak_activation_bytes": "1.25GiB",
                      "non_torch_bytes": "600MiB", "cuda_graph_bytes": "0.75GiB"},
        },
        "system": {"driver": "550.127.05", "cuda": 12040, "nvml": "12.550.127.05"},
        "gpu_models": {"l40s": {"name": "NVIDIA L40S", "total": 48305799168, "reserved": 462422016, "cc": "8.9"}},
        "classes": {CLASS: {"gpu_model": "l40s", "gpus": 2, "model": "llama-3.1-8b-instruct"}},
        # small per-host differences, as on a real class
        "hosts": {n: {"class": CLASS, "base_used": [f"{(i * 8) % 96}MiB", f"{(i * 24) % 64}MiB"]} for i, n in enumerate(names)},
    }


NOOP_HOOK = """\
- name: A hook that does nothing but run (the cost of the hook machinery itself)
  ansible.builtin.debug:
    msg: "{{ gpufleet_hook_event }} {{ gpufleet_hook_host }}"
"""
HOOK_EVENTS = ("drain", "undrain", "batch_start", "batch_end", "class_start", "class_end")


def group_vars(workdir: Path, serial: list[Any], hooks: bool = False) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if hooks:
        hook = workdir / "noop-hook.yml"
        hook.write_text(NOOP_HOOK, encoding="utf-8")
        extra["gpufleet_hooks"] = {event: str(hook) for event in HOOK_EVENTS}
    return extra | {
        "gpufleet_host_class": CLASS,
        "gpufleet_model": "/srv/models/llama-3.1-8b-instruct",
        "gpufleet_model_config": str(REPO / "sim" / "models" / "llama-3.1-8b-instruct" / "config.json"),
        "gpufleet_serve_args": {"max_model_len": 8192, "tensor_parallel_size": 2, "max_num_seqs": 32,
                                "dtype": "bfloat16", "block_size": 16},
        "gpufleet_instances": [{"name": INSTANCE, "gpus": [0, 1], "port": 8000}],
        "gpufleet_guard": "0.5GiB",
        "gpufleet_admission": {"concurrency": 4, "tokens_per_request": 8192},
        "gpufleet_profile_store": str(workdir / "profiles"),
        "gpufleet_report_dir": str(workdir / "reports"),
        "gpufleet_rollout_serial": serial,
        "gpufleet_canary_load": {"requests": 8, "concurrency": 4, "prompt_tokens": 32, "max_tokens": 8},
        "gpufleet_canary_tolerances": {"latency_ratio": 20.0},
        "vllm_service_read_write_paths": ["/etc/fake-nvml"],
        "vllm_service_boot_timeout": 120,
    }


SSH_LOGGER = """\
#!/bin/sh
# Logs the time and the arguments of every ssh call the playbook makes, then runs ssh.
printf '%s %s\\n' "$(date +%s.%N)" "$*" >> "$GPUFLEET_BENCH_SSH_LOG"
exec ssh "$@"
"""


def ssh_logger(workdir: Path) -> tuple[Path, Path]:
    """(the ssh wrapper, its log), for ANSIBLE_SSH_EXECUTABLE."""
    wrapper = workdir / "ssh-logged"
    wrapper.write_text(SSH_LOGGER, encoding="utf-8")
    wrapper.chmod(0o755)
    return wrapper, workdir / "ssh-calls.log"


def remote_calls(log: Path, addresses: dict[str, str], windows: list[tuple[float, float]]) -> dict[str, int]:
    """Per host, the ssh calls whose time falls inside one of ``windows`` (epoch seconds)."""
    by_address = {address: host for host, address in addresses.items()}
    counts = dict.fromkeys(addresses, 0)
    if not log.exists():
        return counts
    for line in log.read_text(encoding="utf-8").splitlines():
        stamp, _sep, args = line.partition(" ")
        try:
            when = float(stamp)
        except ValueError:
            continue
        if not any(start <= when <= end for start, end in windows):
            continue
        for word in args.split():
            host = by_address.get(word.rpartition("@")[2])
            if host is not None:
                counts[host] += 1
                break
    return counts


def fixed_plays(lines: list[tuple[float, str]]) -> list[dict[str, Any]]:
    """The plays before the first batch, each with its seconds (header to the next play's header)."""
    heads = [(stamp, line[len("PLAY ["):line.index("]")]) for stamp, line in lines if line.startswith("PLAY [")]
    out = []
    for (stamp, name), (nxt, _next_name) in zip(heads, heads[1:]):
        if name == ROLLOUT_PLAY:
            break
        out.append({"play": name, "seconds": round(nxt - stamp, 2)})
    return out


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def controller_cpu(pid: int) -> tuple[float, float]:
    """(the ansible-playbook process's own CPU seconds, its finished workers') so far, from /proc: the main
    process runs the strategy's loop on one core whatever the forks; the workers run the tasks in parallel."""
    fields = Path(f"/proc/{pid}/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return (utime + stime) / CLOCK_TICKS, (cutime + cstime) / CLOCK_TICKS


def machine_cpu() -> float:
    """CPU seconds every core of the machine spent busy since boot (/proc/stat): the controller and the hosts."""
    values = [int(v) for v in Path("/proc/stat").read_text(encoding="ascii").splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / CLOCK_TICKS


def ansible_env(forks: int) -> dict[str, str]:
    """The environment of every Ansible command the bench runs: pipelining on, the cache's collections, ``forks``."""
    return dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_PIPELINING="1", ANSIBLE_HOST_KEY_CHECKING="False",
                ANSIBLE_TIMEOUT="20", ANSIBLE_COLLECTIONS_PATH=str(CACHE / "collections"), ANSIBLE_FORKS=str(forks))


def venv_command(name: str, env: dict[str, str]) -> str:
    """The path of Ansible's command ``name``, the cache's venv first."""
    found = shutil.which(name, path=str(CACHE / "venv" / "bin") + os.pathsep + env.get("PATH", ""))
    if found is None:
        raise RuntimeError(f"no {name} command (make venv)")
    return found


def run_playbook(inventory: Path, forks: int, timeout: float, extra_vars: dict[str, Any] | None = None,
                 ssh_log: tuple[Path, Path] | None = None,
                 cpu: dict[str, float] | None = None,
                 cpu_by_task: list[dict[str, Any]] | None = None,
                 skips: dict[str, Any] | None = None) -> tuple[int, list[tuple[float, str]], float, float]:
    """ansible-playbook with every line time-stamped (seconds since start); also returns the start's epoch time.
    ``cpu`` gets the CPU seconds of the controller's main process and workers and of the whole machine, before the
    first batch (``*_fixed_s``) and in all, and what the machine spent outside the controller (``hosts_*``);
    ``cpu_by_task`` gets each task's (``task_cpu``), ``skips`` what the tasks every host skipped cost
    (``skipped_tasks``)."""
    cpu_by_task = cpu_by_task if cpu_by_task is not None else []
    env = ansible_env(forks)
    if ssh_log is not None:
        env["ANSIBLE_SSH_EXECUTABLE"] = str(ssh_log[0])
        env["GPUFLEET_BENCH_SSH_LOG"] = str(ssh_log[1])
        ssh_log[1].unlink(missing_ok=True)
    playbook = venv_command("ansible-playbook", env)
    argv = [playbook, "-i", str(inventory), str(PLAYBOOK)]
    if extra_vars:
        argv += ["--extra-vars", json.dumps(extra_vars)]
    epoch = time.time()
    start = time.monotonic()
    machine_start = machine_cpu()
    children_start = os.times()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(REPO))
    lines: list[tuple[float, str]] = []
    marks: list[tuple[str, float, float]] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        if proc.stdout is None:
            raise RuntimeError("ansible-playbook: no output pipe")
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
            if cpu is not None and line.startswith(BANNERS):
                # each banner closes the task before it: the CPU it took, the machine's and the controller's
                with contextlib.suppress(OSError):
                    marks.append((line.rstrip("\n"), machine_cpu(), sum(controller_cpu(proc.pid))))
            if cpu is not None and "main_fixed_s" not in cpu and line.startswith(f"PLAY [{ROLLOUT_PLAY}]"):
                with contextlib.suppress(OSError):
                    cpu["main_fixed_s"], cpu["workers_fixed_s"] = controller_cpu(proc.pid)
                    cpu["machine_fixed_s"] = machine_cpu() - machine_start
        rc = proc.wait()
    finally:
        timer.cancel()
    if cpu is not None:
        children = os.times()
        # the ansible-playbook process and every worker it reaped (its ssh masters outlive it: not counted)
        cpu["controller_s"] = (children.children_user + children.children_system
                               - children_start.children_user - children_start.children_system)
        cpu["machine_s"] = machine_cpu() - machine_start
        # what the machine spent outside the controller: the simulated hosts (the modules each remote call runs,
        # their systemd and engines) and the ssh connections' masters, which the controller does not reap
        cpu["hosts_s"] = cpu["machine_s"] - cpu["controller_s"]
        if "machine_fixed_s" in cpu:
            cpu["hosts_fixed_s"] = cpu["machine_fixed_s"] - cpu["main_fixed_s"] - cpu["workers_fixed_s"]
        for key in list(cpu):
            cpu[key] = round(cpu[key], 2)
        cpu_by_task.extend(task_cpu(marks))
    if skips is not None:
        skips.update(skipped_tasks(lines, marks))
    return rc, lines, time.monotonic() - start, epoch


def task_cpu(marks: list[tuple[str, float, float]], top: int = 12) -> list[dict[str, Any]]:
    """The tasks that cost the machine the most CPU, from the (banner, machine CPU, controller CPU) read at each task
    and play banner: per task name and part of the run (``fixed``: before the first batch; ``batches``; ``report``),
    the CPU seconds of the machine, of the controller (main process and reaped workers) and of the rest (the
    simulated hosts), summed over its runs (each batch runs the batch play's tasks again)."""
    totals: dict[tuple[str, str], dict[str, Any]] = {}
    part = "fixed"
    for (banner, machine, controller), (_next, machine_next, controller_next) in zip(marks, marks[1:]):
        if banner.startswith("PLAY ["):
            part = "batches" if banner.startswith(f"PLAY [{ROLLOUT_PLAY}]") else ("report" if part != "fixed" else part)
            continue
        task = TASK_RE.match(banner)
        if not task:
            continue
        row = totals.setdefault((part, task.group(1)), {"part": part, "task": task.group(1), "runs": 0,
                                                        "machine_s": 0.0, "controller_s": 0.0})
        row["runs"] += 1
        row["machine_s"] += machine_next - machine
        row["controller_s"] += controller_next - controller
    rows = sorted(totals.values(), key=lambda r: -r["machine_s"])[:top]
    for row in rows:
        row["hosts_s"] = round(row["machine_s"] - row["controller_s"], 2)
        row["machine_s"], row["controller_s"] = round(row["machine_s"], 2), round(row["controller_s"], 2)
    return rows


def skipped_tasks(lines: list[tuple[float, str]], marks: list[tuple[str, float, float]], top: int = 12) -> dict[str, Any]:
    """What skipping costs the run: every host a task runs on takes a worker of the controller, skipped or not.

    From the output's result lines under each task banner (``skipping: [host]``, ``ok: [host]``, ``included: ...
    for host, ...``): the task runs and the host runs in all, the host runs that were skips, and the task runs that
    every host skipped with their seconds (banner to the next banner), the ``top`` of them by task, and their CPU,
    the machine's and the controller's (``marks``: ``run_playbook``'s, one per banner of ``lines`` in the same order;
    without them, or when they do not match the banners, no CPU)."""
    segments: list[dict[str, Any]] = []
    for stamp, line in lines:
        if line.startswith(BANNERS):
            task = TASK_RE.match(line)
            segments.append({"stamp": stamp, "task": task.group(1) if task else None, "ran": set(), "skipped": set(), "done": set()})
            continue
        if not segments:
            continue
        included = INCLUDED_RE.match(line)
        hosts = [h.strip() for h in included.group(1).split(",")] if included else []
        match = HOST_RE.match(line)
        if match:
            # a delegated run ("host -> localhost") is the host's
            hosts = [match.group(1).split(" -> ")[0]]
        segments[-1]["ran"].update(hosts)
        segments[-1]["skipped" if line.startswith("skipping: [") else "done"].update(hosts)
    with_cpu = len(marks) == len(segments)
    out: dict[str, Any] = {"task_runs": 0, "host_runs": 0, "skipped_host_runs": 0}
    # per task that every host skipped, summed over its runs (each batch runs the batch play's tasks again)
    by_task: dict[str, dict[str, Any]] = {}
    for i, seg in enumerate(segments[:-1]):
        if not seg["task"] or not seg["ran"]:
            continue
        out["task_runs"] += 1
        out["host_runs"] += len(seg["ran"])
        # a host with some items skipped and some run counts as run
        skipped = seg["skipped"] - seg["done"]
        out["skipped_host_runs"] += len(skipped)
        if seg["done"]:
            continue
        row = by_task.setdefault(seg["task"], {"task": seg["task"], "runs": 0, "host_runs": 0, "seconds": 0.0,
                                               "machine_s": 0.0, "controller_s": 0.0})
        row["runs"] += 1
        row["host_runs"] += len(skipped)
        row["seconds"] += segments[i + 1]["stamp"] - seg["stamp"]
        if with_cpu:
            row["machine_s"] += marks[i + 1][1] - marks[i][1]
            row["controller_s"] += marks[i + 1][2] - marks[i][2]
    rows = list(by_task.values())
    every: dict[str, Any] = {"task_runs": sum(r["runs"] for r in rows), "host_runs": sum(r["host_runs"] for r in rows)}
    for key in ("seconds", "machine_s", "controller_s") if with_cpu else ("seconds",):
        every[key] = round(sum(r[key] for r in rows), 2)
    # the longest of them by task
    every["tasks"] = [{"task": r["task"], "runs": r["runs"], "host_runs": r["host_runs"], "seconds": round(r["seconds"], 2)}
                      for r in sorted(rows, key=lambda r: -r["seconds"])[:top]]
    out["all_skipped"] = every
    return out


def remote_call_cpu(inventory: Path, hosts: int, forks: int) -> dict[str, Any]:
    """The CPU one remote call costs per host, on the fleet as it is: ad-hoc ``ansible.builtin.ping`` (a module: the
    host's Python starts and imports Ansible's module code), ``ansible.builtin.raw`` (a shell command, no module) and
    a raw command that only starts the host's module interpreter (``python -c pass``), each once on every one of the
    inventory's ``hosts``; the machine's CPU and the controller's, divided by the hosts, the module's cost beyond the
    raw command's, and the part of it that is neither the round trip nor the interpreter's start: Ansible's module
    loader, which imports Ansible's own module code from the module's zip on every call (compiled from source each
    time: a zip import keeps no bytecode), whatever the module."""
    env = ansible_env(forks)
    adhoc = venv_command("ansible", env)
    out: dict[str, Any] = {"hosts": hosts, "forks": forks}
    interpreter_start = "{{ ansible_python_interpreter | default('python3') }} -c pass"
    for name, argv in (("module", ["-m", "ansible.builtin.ping"]), ("raw", ["-m", "ansible.builtin.raw", "-a", "true"]),
                       ("interpreter", ["-m", "ansible.builtin.raw", "-a", interpreter_start])):
        machine_start, children_start = machine_cpu(), os.times()
        try:
            done = subprocess.run([adhoc, "-i", str(inventory), "all", *argv], capture_output=True, text=True, env=env,
                                  cwd=str(REPO), timeout=600, check=False)
        except subprocess.SubprocessError as exc:
            out[name] = {"error": str(exc)}
            continue
        machine, children = machine_cpu() - machine_start, os.times()
        controller = children.children_user + children.children_system - children_start.children_user - children_start.children_system
        out[name] = {"rc": done.returncode, "machine_cpu_s_per_host": round(machine / hosts, 3),
                     "controller_cpu_s_per_host": round(controller / hosts, 3),
                     "hosts_cpu_s_per_host": round((machine - controller) / hosts, 3)}
    # both include the ansible command's own start, spread over the hosts: their difference is what a module costs
    # beyond a plain round trip (its Python and Ansible's module code starting on the host, its result on the controller)
    if "machine_cpu_s_per_host" in out["module"] and "machine_cpu_s_per_host" in out["raw"]:
        out["module_over_raw_cpu_s_per_host"] = round(out["module"]["machine_cpu_s_per_host"] - out["raw"]["machine_cpu_s_per_host"], 3)
    if "hosts_cpu_s_per_host" in out["module"] and "hosts_cpu_s_per_host" in out["interpreter"]:
        out["module_loader_cpu_s_per_host"] = round(out["module"]["hosts_cpu_s_per_host"] - out["interpreter"]["hosts_cpu_s_per_host"], 3)
    return out


def batch_task_names() -> set[str]:
    """Names of the tasks that open and close every batch (tasks/batch_start.yml, batch_end.yml)."""
    names: set[str] = set()
    for part in ("batch_start.yml", "batch_end.yml"):
        with open(REPO / "playbooks" / "tasks" / part, encoding="utf-8") as handle:
            names.update(task["name"] for task in yaml.safe_load(handle))
    return names


def split_batches(lines: list[tuple[float, str]], hosts: list[str]) -> tuple[float | None, list[dict[str, Any]]]:
    """(start of the first batch, batches with their start, end, hosts and batch machinery seconds).

    The batch machinery is the time from the header of each task of tasks/batch_start.yml and
    batch_end.yml to the next task's header: what per-class ramps, progress lines, the pause
    and the hooks cost each batch.
    """
    machinery = batch_task_names()
    batches: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    task_started: float | None = None
    for stamp, line in lines:
        if line.startswith(("TASK [", "PLAY [", "PLAY RECAP")) and current is not None and task_started is not None:
            current["machinery_s"] += stamp - task_started
            task_started = None
        task = TASK_RE.match(line)
        if task and current is not None and task.group(1) in machinery:
            task_started = stamp
        if line.startswith("PLAY ["):
            if current is not None:
                current["end"] = stamp
                current = None
            if line.startswith(f"PLAY [{ROLLOUT_PLAY}]"):
                current = {"start": stamp, "end": None, "hosts": [], "machinery_s": 0.0}
                batches.append(current)
            continue
        if current is not None:
            match = HOST_RE.match(line)
            if match and match.group(1) in hosts and match.group(1) not in current["hosts"]:
                current["hosts"].append(match.group(1))
    if current is not None and current["end"] is None:
        current["end"] = lines[-1][0] if lines else current["start"]
    return (batches[0]["start"] if batches else None), batches


def last_start(harness: testhosts.Harness, host: str) -> tuple[float | None, float | None]:
    """The unit's last start on ``host``, from its journal: (when systemd started it, when its engine logged
    ``Application startup complete.``, None when it did not)."""
    proc = harness.exec(host, ["journalctl", "-u", f"vllm-{INSTANCE}.service", "-o", "short-unix", "--no-pager"])
    started = None
    healthy = None
    for line in proc.stdout.splitlines():
        stamp, _sep, text = line.partition(" ")
        try:
            when = float(stamp)
        except ValueError:
            continue
        if f"Started vllm-{INSTANCE}.service" in text:
            started, healthy = when, None
        elif "Application startup complete." in text and started is not None and healthy is None:
            healthy = when
    return started, healthy


def boot_to_healthy(harness: testhosts.Harness, host: str) -> float | None:
    """Seconds from systemd starting the unit to the engine's ``Application startup complete.``, last boot."""
    started, healthy = last_start(harness, host)
    return None if started is None or healthy is None else round(healthy - started, 3)


def inotify_instances() -> int | None:
    try:
        with open("/proc/sys/fs/inotify/max_user_instances", encoding="utf-8") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def measure_rollout(sim: fleetctl.Fleet, inventory: Path, names: list[str], kind: str, forks: int, timeout: float,
                    extra_vars: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``rollout.yml`` run on the fleet, split into its fixed part and its batches."""
    out: dict[str, Any] = {"kind": kind, "extra_vars": extra_vars or {}}
    ssh_log = ssh_logger(inventory.parent)
    cpu: dict[str, float] = {}
    by_task: list[dict[str, Any]] = []
    skips: dict[str, Any] = {}
    rc, lines, wall, epoch = run_playbook(inventory, forks, timeout, extra_vars, ssh_log, cpu, by_task, skips)
    out["cpu_seconds"] = cpu
    out["cpu_by_task"] = by_task
    out["skipped_tasks"] = skips
    # the time-stamped output, kept beside the fleet for a per-task look
    (inventory.parent / f"{kind}.log").write_text("".join(f"{stamp:9.3f} {line}\n" for stamp, line in lines), encoding="utf-8")
    out["rc"] = rc
    out["playbook_seconds"] = round(wall, 2)
    first, batches = split_batches(lines, names)
    recap = [ln for _t, ln in lines if re.match(r"^\S+\s+: ok=", ln)]
    out["recap_failed_hosts"] = [ln.split()[0] for ln in recap if not re.search(r"failed=0\s", ln) or "unreachable=0" not in ln]
    boots = {n: boot_to_healthy(sim.h, n) for n in names}
    out["boot_to_healthy_seconds"] = boots
    known = [b for b in boots.values() if b is not None]
    out["boot_to_healthy_median_s"] = round(sorted(known)[len(known) // 2], 3) if known else None
    out["fixed_seconds"] = round(first, 2) if first is not None else None
    rows = []
    overhead = 0.0
    for b in batches:
        b_boots = [boots[h] for h in b["hosts"] if boots.get(h) is not None]
        slowest = max(b_boots) if b_boots else 0.0
        wall_b = b["end"] - b["start"]
        rows.append({"hosts": len(b["hosts"]), "wall_s": round(wall_b, 2), "slowest_boot_s": slowest,
                     "overhead_s": round(wall_b - slowest, 2), "batch_machinery_s": round(b["machinery_s"], 2)})
        overhead += wall_b - slowest
    out["batches"] = rows
    addresses = {n: str(sim.h.inventory_data(names=names)["all"]["hosts"][n]["ansible_host"]) for n in names}
    calls = remote_calls(ssh_log[1], addresses, [(epoch + b["start"], epoch + b["end"]) for b in batches])
    out["remote_calls_in_batches"] = calls
    # the fixed part: what every host gets before the first batch, and the canary host (first by name) its canaries
    fixed_calls = remote_calls(ssh_log[1], addresses, [(0.0, epoch + first)]) if first is not None else {}
    if fixed_calls:
        others = [n for h, n in fixed_calls.items() if h != names[0]]
        out["remote_calls_before_first_batch"] = {"canary_host": fixed_calls[names[0]],
                                                  "other_hosts": {"min": min(others), "max": max(others)} if others else None}
    out["fixed_plays"] = fixed_plays(lines)
    out["remote_calls_per_host"] = {"min": min(calls.values()), "max": max(calls.values())} if calls else None
    out["batches_seconds"] = round(sum(r["wall_s"] for r in rows), 2)
    out["batch_machinery_seconds"] = round(sum(r["batch_machinery_s"] for r in rows), 2)
    deployed = sum(r["hosts"] for r in rows)
    out["hosts_in_batches"] = deployed
    out["missing_boot_times"] = sorted(n for n, b in boots.items() if b is None)
    size = len(names)
    if rc == 0 and deployed == size and not out["missing_boot_times"]:
        out["overhead_per_host_s"] = round(overhead / size, 3)
        out["batch_machinery_per_host_s"] = round(out["batch_machinery_seconds"] / size, 3)
        out["within_goal"] = overhead / size < GOAL_SECONDS
    else:
        out["error"] = (f"rollout did not complete on every host (rc {rc}, {deployed}/{size} hosts in batches, "
                        f"no boot time for {out['missing_boot_times'] or 'none'})")
        out["output_tail"] = [ln for _t, ln in lines[-40:]]
    return out


def measure(size: int, prefix: str, boot_delay: float, serial: list[Any], forks: int, timeout: float,
            hooks: bool = False) -> list[dict[str, Any]]:
    """Two rollouts on one fresh fleet of ``size`` hosts: the first install, then a budget update.

    The update (a larger guard, so a new budget on every host) is the rollout an operator
    runs again and again: hosts that already run vLLM under this collection.
    """
    names = [f"{prefix}-{i:02d}" for i in range(1, size + 1)]
    workdir = CACHE / "bench" / f"rollout-{size}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    path = workdir / "fleet.yml"
    path.write_text(yaml.safe_dump(fleet_file(names, boot_delay)), encoding="utf-8")
    sim = fleetctl.Fleet(path)
    common: dict[str, Any] = {"hosts": size, "serial": serial, "forks": forks, "engine_boot_delay_s": boot_delay, "hooks": hooks,
                              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                              "inotify_max_user_instances": inotify_instances()}
    runs: list[dict[str, Any]] = []
    try:
        start = time.monotonic()
        with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON result
            # hosts boot one after the other; on a loaded machine 32 take minutes
            sim.create(reset_state=True, timeout=120 + 15 * size)
        common["fleet_create_seconds"] = round(time.monotonic() - start, 2)
        inv = {"all": {"children": {CLASS.replace("-", "_"): {
            "hosts": {n: sim.h.inventory_data(names=names)["all"]["hosts"][n] for n in names},
            "vars": group_vars(workdir, serial, hooks)}}}}
        inventory = workdir / "inventory.yml"
        inventory.write_text(yaml.safe_dump(inv), encoding="utf-8")
        runs.append(dict(common, **measure_rollout(sim, inventory, names, "install", forks, timeout)))
        if "error" not in runs[-1]:
            runs.append(dict(common, **measure_rollout(sim, inventory, names, "update", forks, timeout,
                                                       {"gpufleet_guard": "1GiB"})))
            # what one remote call costs each host here, beside what the rollout's calls cost
            runs[-1]["remote_call_cpu"] = remote_call_cpu(inventory, size, forks)
    except (fleetctl.FleetError, testhosts.HarnessError, RuntimeError, OSError) as exc:
        failed = dict(common, kind="install" if not runs else "update")
        failed["error"] = str(exc)
        limit = inotify_instances()
        if "not ready before the timeout" in failed["error"] and limit is not None and limit < 16 * size:
            failed["error"] = (f"{failed['error'].splitlines()[0]} (fs.inotify.max_user_instances is {limit}: every guest's "
                               f"systemd needs inotify instances of the same user; raise it, e.g. to {max(1024, 16 * size)}, "
                               f"for {size} hosts)")
        runs.append(failed)
    finally:
        try:
            with contextlib.redirect_stdout(sys.stderr):
                sim.destroy()
            leftovers = [str(x) for x in sim.h.leftovers() if x.owner in names]
            teardown = "clean" if not leftovers else "leftovers: " + "; ".join(leftovers)
        except (fleetctl.FleetError, testhosts.HarnessError) as exc:
            teardown = f"failed: {exc}"
        for run in runs:
            run["teardown"] = teardown
    return runs


def fixed_part_slope(runs: list[dict[str, Any]], kind: str = "update", hosts: int = 1000) -> dict[str, Any] | None:
    """The fixed part's growth per host between the smallest and the largest fleet of ``kind`` runs,
    and the fixed part it projects for ``hosts`` (a straight line through the largest size)."""
    done = sorted((r for r in runs if r.get("kind") == kind and r.get("fixed_seconds") is not None), key=lambda r: r["hosts"])
    if len(done) < 2 or done[-1]["hosts"] <= done[0]["hosts"]:
        return None
    small, large = done[0], done[-1]
    slope = (large["fixed_seconds"] - small["fixed_seconds"]) / (large["hosts"] - small["hosts"])
    out = {"kind": kind, "from_hosts": small["hosts"], "to_hosts": large["hosts"], "seconds_per_host": round(slope, 3),
           "projected_hosts": hosts, "projected_fixed_seconds": round(large["fixed_seconds"] + slope * (hosts - large["hosts"]), 1),
           "forks": large.get("forks")}
    # The controller's CPU before the first batch, per host: its main process (the strategy's loop, one core whatever
    # the forks or cores) and its workers (the tasks, as wide as the forks and cores allow). On this machine the hosts
    # share the controller's cores; on a controller of its own only these figures grow with the fleet.
    for part in ("main", "workers"):
        key = f"{part}_fixed_s"
        if all(key in (r.get("cpu_seconds") or {}) for r in (small, large)):
            per_host = (large["cpu_seconds"][key] - small["cpu_seconds"][key]) / (large["hosts"] - small["hosts"])
            out[f"{part}_cpu_seconds_per_host"] = round(per_host, 4)
            out[f"projected_{part}_cpu_seconds"] = round(large["cpu_seconds"][key] + per_host * (hosts - large["hosts"]), 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,32")
    parser.add_argument("--prefix", default="sim-bro")
    parser.add_argument("--boot-delay", type=float, default=2.0, help="simulated engine boot delay (s)")
    parser.add_argument("--serial", default='[1, "10%", "50%"]', help="rollout serial batches (JSON)")
    parser.add_argument("--forks", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=2400, help="limit per playbook run (s)")
    parser.add_argument("--hooks", action="store_true", help="give every hook event (drain, undrain, batch and class "
                        "start/end) a task file that only prints a line: the cost of the hook machinery")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print(json.dumps({"error": "run as root: test hosts use systemd-nspawn and network namespaces"}))
        return 2
    serial = json.loads(args.serial)
    started = time.monotonic()
    runs = [run for size in args.sizes.split(",")
            for run in measure(int(size), args.prefix, args.boot_delay, serial, args.forks, args.timeout, args.hooks)]
    out: dict[str, Any] = {"benchmark": "rollout_overhead", "goal_seconds": GOAL_SECONDS, "runs": runs,
                           "command": "python bench/rollout_overhead.py " + " ".join(sys.argv[1:]),
                           "playbook_command": "ansible-playbook -i INVENTORY playbooks/rollout.yml",
                           "seconds": round(time.monotonic() - started, 1)}
    ok = [r for r in runs if "overhead_per_host_s" in r and r["kind"] == "install"]
    if len(ok) >= 2:
        small, large = ok[0], ok[-1]
        if large["hosts"] > small["hosts"]:
            out["marginal_seconds_per_host"] = round(
                (large["batches_seconds"] - small["batches_seconds"]) / (large["hosts"] - small["hosts"]), 3)
    out["fixed_part_per_host"] = fixed_part_slope(runs)
    print(json.dumps(out, indent=2))
    complete = all("overhead_per_host_s" in r for r in runs) and len(runs) == 2 * len(args.sizes.split(","))
    return 0 if complete and all(r.get("teardown") == "clean" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
