# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The benchmark runner's report: ratios against the same run's baseline, skipped parts carry no figure."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import run as bench_run  # noqa: E402  pylint: disable=wrong-import-position,import-error

INFO = {"nproc": 2, "cpu_model": "CPU", "memory_gib": 1.0, "os": "Debian", "kernel": "k", "python": "3.11", "ansible": "ansible [core 2.19]"}


def planner_entry(seconds: list[float]) -> dict:
    runs = [{"hosts": h, "ranks": h * 8, "best_seconds": s, "best_cpu_seconds": s, "peak_traced_mib": 1.0, "decision": "deploy"}
            for h, s in zip((100, 1000, 10000), seconds)]
    return {"planner": {"command": "python bench/planner.py", "rc": 0, "seconds": 1.0, "result": {"runs": runs}}}


def test_parse_json_takes_the_object_after_other_output() -> None:
    assert bench_run.parse_json('fleet up: 3 hosts\n{"a": 1,\n "b": [2]}\n') == {"a": 1, "b": [2]}
    assert bench_run.parse_json("no json here") is None


def test_planner_ratios_and_goals() -> None:
    lines, goals = bench_run.render_planner(planner_entry([0.01, 0.1, 0.5]))
    text = "\n".join(lines)
    assert "| 10,000 | 80,000 | 0.5 | 0.5 | 50.00x | 5x |" in text
    assert ("planner: 10,000 hosts x 8 GPUs < 1 s", "0.5 s wall, 0.5 s CPU", "**met**") in goals
    _lines, goals = bench_run.render_planner(planner_entry([0.01, 0.2, 3.0]))
    assert ("planner: 10,000 hosts x 8 GPUs < 1 s", "3.0 s wall, 3.0 s CPU", "**not met**") in goals
    assert ("planner: linear (growth per 10x hosts <= 12x)", "worst 20.0x", "**not met**") in goals


def test_gang_planning_compares_with_the_same_hosts_as_one_host_instances() -> None:
    entry = planner_entry([0.01, 0.1, 0.5])
    gang = [{"gangs": g, "hosts": g * 16, "ranks": g * 128, "batches": 4, "gang_cpu_seconds": c, "one_host_cpu_seconds": round(c / 3, 4),
             "added_cpu_ms_per_host": 0.08, "decision": "deploy"} for g, c in ((1, 0.002), (10, 0.02), (100, 0.3))]
    entry["planner"]["result"].update(gang_runs=gang, gang_hosts=16, gpus_per_host=8)
    lines, goals = bench_run.render_planner(entry)
    assert "| 100 | 1,600 | 12,800 | 4 | 0.3 | 0.1 | 3.00x | 0.08 | 15x |" in "\n".join(lines)
    goal = "planner: gangs of 16 hosts x 8 GPUs add linear cost (growth per 10x gangs <= 12x)"
    assert (goal, "worst 15.0x; 0.08 ms added per host at 100 gangs", "**not met**") in goals
    gang[2]["gang_cpu_seconds"] = 0.2
    assert (goal, "worst 10.0x; 0.08 ms added per host at 100 gangs", "**met**") in bench_run.render_planner(entry)[1]
    # a run that measured no gangs says so, and claims nothing
    del entry["planner"]["result"]["gang_runs"]
    assert (goal, "no figures", "n/a") in bench_run.render_planner(entry)[1]


def test_skipped_and_failed_parts_report_no_figures() -> None:
    results = {
        "probe": {"probe_inprocess": {"command": "python bench/probe_inprocess.py", "rc": 2, "seconds": 0.1,
                                      "result": {"error": "fake NVML library not built"}, "error": "fake NVML library not built"},
                  "probe_vs_ping": bench_run.skipped("needs root (systemd-nspawn test hosts)")},
        "rollout": {"rollout": bench_run.skipped("no test host rootfs (run `make rootfs`)")},
    }
    text = bench_run.render(results, INFO, ["python", "bench/run.py"], "2026-01-01 00:00:00", 1.0, (0.1, 0.2))
    assert "Skipped: needs root (systemd-nspawn test hosts). No figures from this part in this run." in text
    assert "**Failed**: fake NVML library not built" in text
    assert "| probe over SSH within 1.3x of ping | no figures | n/a |" in text
    assert "| rollout: < 5 s per host beyond boot-to-healthy | no figures | n/a |" in text
    assert "Not selected in this run (`--only`)." in text  # planner, canary, drift
    assert "**met**" not in text


def rollout_run(hosts: int, batches: float, **extra: object) -> dict:
    return {"hosts": hosts, "rc": 0, "batches_seconds": batches, "overhead_per_host_s": 1.0, "within_goal": True,
            "boot_to_healthy_median_s": 2.0, "batches": [], **extra}


def test_add_rollout_replaces_the_failed_size_and_says_when_it_was_measured() -> None:
    results = {"rollout": {"rollout": {"command": "python bench/rollout_overhead.py --sizes 8,32", "rc": 1, "seconds": 9.0,
                                       "error": "exit status 1",
                                       "result": {"runs": [rollout_run(8, 80.0), {"hosts": 32, "error": "boot timed out"}]}}}}
    bench_run.add_rollout_runs(results, {"runs": [rollout_run(32, 320.0, measured_at="2026-01-01 01:00:00")]})
    entry = results["rollout"]["rollout"]
    assert "error" not in entry
    assert [r["hosts"] for r in entry["result"]["runs"]] == [8, 32]
    assert entry["result"]["marginal_seconds_per_host"] == 10.0
    text = bench_run.render(results, INFO, ["python", "bench/run.py"], "2026-01-01 00:00:00", 1.0, (0.1, 0.2))
    assert "measured by a separate `python bench/rollout_overhead.py --sizes 32` at 2026-01-01 01:00:00 UTC" in text


def test_render_shows_checkout_paths_relative() -> None:
    results = {"rollout": {"rollout": bench_run.skipped(f"no rootfs at {bench_run.REPO}/.cache/rootfs")}}
    text = bench_run.render(results, INFO, ["python", "bench/run.py"], "2026-01-01 00:00:00", 1.0, (0.1, 0.2))
    assert str(bench_run.REPO) not in text
    assert "no rootfs at .cache/rootfs" in text


def test_recorded_gpu_section_only_from_recorded_files(tmp_path):
    assert not bench_run.render_recorded_gpu(tmp_path)
    (tmp_path / "gpu-2026-01-01-nvml_real.json").write_text(
        '{"probe_timing": {"median_ms": 10.0, "runs": 20}, "nvidia_smi_timing": {"median_ms": 40.0, "runs": 5},'
        ' "probe_single": {"gpus": [{"name": "NVIDIA H200"}, {"name": "NVIDIA H200"}]}}', encoding="utf-8")
    (tmp_path / "broken-nvml_real.json").write_text('{"probe_timing": {}}', encoding="utf-8")
    lines = bench_run.render_recorded_gpu(tmp_path)
    assert lines[0] == "## Real GPU (recorded, not measured by this run)"
    rows = [line for line in lines if line.startswith("| gpu-")]
    assert rows == ["| gpu-2026-01-01-nvml_real.json | NVIDIA H200 x2 | 10.0 (20 runs) | 40.0 (5 runs) | 0.25x |"]
    assert not [line for line in lines if "broken" in line]


def test_add_rollout_that_replaces_every_run_shows_its_own_command() -> None:
    results = {"rollout": {"rollout": {"command": "python bench/rollout_overhead.py --sizes 8,32", "rc": 1, "seconds": 9.0,
                                       "result": {"runs": [rollout_run(8, 80.0)]}}}}
    extra = {"command": "python bench/rollout_overhead.py --sizes 8", "seconds": 70.5,
             "runs": [rollout_run(8, 40.0, kind="install", measured_at="2026-01-01 01:00:00"),
                      rollout_run(8, 30.0, kind="update", measured_at="2026-01-01 01:01:00")]}
    bench_run.add_rollout_runs(results, extra)
    entry = results["rollout"]["rollout"]
    assert [(r["hosts"], r["kind"]) for r in entry["result"]["runs"]] == [(8, "install"), (8, "update")]
    assert (entry["command"], entry["seconds"], entry["rc"]) == ("python bench/rollout_overhead.py --sizes 8", 70.5, 0)
    text = bench_run.render(results, INFO, ["python", "bench/run.py"], "2026-01-01 00:00:00", 1.0, (0.1, 0.2))
    assert "Took 70.5 s, exit status 0." in text
    assert "Measured by the command above from 2026-01-01 01:00:00 UTC" in text
    assert "| rollout (8 hosts, update): < 5 s per host beyond boot-to-healthy | 1.0 s | **met** |" in text


def runtime_entry(pip_cpu: float, role_cpu: float, same: bool = True) -> dict:
    compiled = {"vllm": [2642, 2642], "torch": [2285, 2284], "transformers": [2719, 2719]}
    runs = {"pip": [{"wall_seconds": 100.0, "cpu_seconds": pip_cpu, "compiled": compiled}],
            "role": [{"wall_seconds": 40.0, "cpu_seconds": role_cpu,
                      "compiled": compiled if same else dict(compiled, vllm=[2642, 0])}]}
    result = {"requirement": "vllm==0.32.0+cpu", "wheelhouse_wheels": 152, "removed": ["triton"], "nproc": 2, "runs": runs,
              "median": {way: {"wall_seconds": r[0]["wall_seconds"], "cpu_seconds": r[0]["cpu_seconds"]} for way, r in runs.items()},
              "cpu_ratio_role_vs_pip": round(role_cpu / pip_cpu, 2), "wall_ratio_role_vs_pip": 0.4, "same_compiled_release": same}
    return {"runtime": {"command": "python bench/runtime_install.py", "rc": 0, "seconds": 140.0, "result": result}}


def test_runtime_install_ratios_and_goal_need_the_same_compiled_files() -> None:
    lines, goals = bench_run.render_runtime(runtime_entry(100.0, 45.0))
    text = "\n".join(lines)
    assert "| role | 40.0 | 45.0 | 0.45x | 0.40x |" in text
    assert "vllm 2,642 / 2,642" in text and "the same for both" in text
    assert goals[0][1:] == ("0.4x wall, 0.45x CPU", "**met**")
    _lines, goals = bench_run.render_runtime(runtime_entry(100.0, 45.0, same=False))
    assert goals[0][2] == "**not met**"
    _lines, goals = bench_run.render_runtime({"runtime": bench_run.skipped("no wheelhouse (run `make wheelhouse`)")})
    assert goals[0][1:] == ("no figures", "n/a")


def test_remote_call_line_splits_the_module_loader_off_only_when_the_interpreter_start_was_measured() -> None:
    calls = {"hosts": 32, "forks": 16,
             "module": {"rc": 0, "machine_cpu_s_per_host": 0.25, "controller_cpu_s_per_host": 0.06, "hosts_cpu_s_per_host": 0.19},
             "raw": {"rc": 0, "machine_cpu_s_per_host": 0.05, "controller_cpu_s_per_host": 0.04, "hosts_cpu_s_per_host": 0.01},
             "module_over_raw_cpu_s_per_host": 0.2}
    with_start = dict(calls, interpreter={"rc": 0, "machine_cpu_s_per_host": 0.07, "controller_cpu_s_per_host": 0.04,
                                          "hosts_cpu_s_per_host": 0.03}, module_loader_cpu_s_per_host=0.16)
    for entry, loader in ((calls, False), (with_start, True)):
        results = {"rollout": {"rollout": {"command": "python bench/rollout_overhead.py --sizes 32", "rc": 0, "seconds": 9.0,
                                           "result": {"runs": [rollout_run(32, 40.0, kind="update", remote_call_cpu=entry)]}}}}
        text = bench_run.render(results, INFO, ["python", "bench/run.py"], "2026-01-01 00:00:00", 1.0, (0.1, 0.2))
        line = next(ln for ln in text.splitlines() if ln.startswith("- One remote call on each of the 32 hosts"))
        assert "a module costs 0.2 s more per host and call" in line
        assert ("starting the host's Python alone (a raw `python -c pass`) costs the host 0.03 s, so Ansible's module loader"
                in line) is loader
        assert ("costs the host about 0.16 s of every call." in line) is loader
        assert line.endswith(".")
