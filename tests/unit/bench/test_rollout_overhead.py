# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""bench/rollout_overhead.py's count of remote calls: the ssh wrapper logs every call, the
count keeps the calls to each host inside the batches' time windows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import rollout_overhead  # noqa: E402  pylint: disable=wrong-import-position,import-error


def test_calls_are_counted_per_host_inside_the_batches_only(tmp_path):
    log = tmp_path / "ssh-calls.log"
    log.write_text(
        "100.0 -o ControlMaster=auto -o User=root 10.0.0.1 /bin/sh -c 'python3'\n"
        "101.5 -C root@10.0.0.2 /bin/sh\n"
        "102.0 -o User=root 10.0.0.1 /bin/sh\n"
        "150.0 -o User=root 10.0.0.1 /bin/sh\n"  # after the batches
        "not-a-time 10.0.0.1\n",
        encoding="utf-8")
    counts = rollout_overhead.remote_calls(log, {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}, [(99.0, 103.0)])
    assert counts == {"a": 2, "b": 1, "c": 0}
    assert rollout_overhead.remote_calls(tmp_path / "none.log", {"a": "10.0.0.1"}, [(0, 1)]) == {"a": 0}


def test_the_wrapper_logs_its_arguments_and_runs_ssh(tmp_path):
    wrapper, log = rollout_overhead.ssh_logger(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_ssh = bin_dir / "ssh"
    fake_ssh.write_text("#!/bin/sh\necho \"ssh $*\"\n", encoding="utf-8")
    fake_ssh.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", GPUFLEET_BENCH_SSH_LOG=str(log))
    out = subprocess.run([str(wrapper), "-o", "User=root", "10.0.0.1", "true"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout == "ssh -o User=root 10.0.0.1 true\n"
    stamp, _sep, args = log.read_text(encoding="utf-8").strip().partition(" ")
    assert float(stamp) > 0 and args == "-o User=root 10.0.0.1 true"


def test_each_task_gets_the_cpu_until_the_next_banner_summed_over_its_batches():
    marks = [
        ("PLAY [Probe every target host] ****", 0.0, 0.0),
        ("TASK [Read the host] ****", 1.0, 0.5),
        ("PLAY [Roll out in serial batches] ****", 4.0, 1.5),
        ("TASK [Take the lease of this host] ****", 4.5, 1.7),
        ("TASK [Write] ****", 5.0, 1.9),
        ("PLAY [Roll out in serial batches] ****", 9.0, 2.9),
        ("TASK [Take the lease of this host] ****", 9.0, 2.9),
        ("TASK [Write] ****", 10.0, 3.2),
        ("PLAY [Report the rollout] ****", 16.0, 4.2),
        ("TASK [Write the run report] ****", 16.0, 4.2),
        ("PLAY RECAP ****", 16.5, 4.6),
    ]
    rows = rollout_overhead.task_cpu(marks)
    assert rows[0] == {"part": "batches", "task": "Write", "runs": 2, "machine_s": 10.0, "controller_s": 2.0, "hosts_s": 8.0}
    assert rows[1] == {"part": "fixed", "task": "Read the host", "runs": 1, "machine_s": 3.0, "controller_s": 1.0, "hosts_s": 2.0}
    lease = next(r for r in rows if r["task"] == "Take the lease of this host")
    assert (lease["runs"], lease["machine_s"], lease["controller_s"]) == (2, 1.5, 0.5)
    report = next(r for r in rows if r["task"] == "Write the run report")
    assert report["part"] == "report" and report["machine_s"] == 0.5
    assert len(rollout_overhead.task_cpu(marks, top=2)) == 2


def test_skips_are_counted_per_host_and_the_tasks_every_host_skipped_get_their_time_and_cpu():
    lines = [
        (0.0, "PLAY [Roll out in serial batches] ****"),
        (1.0, "TASK [Take the lease of this host] ****"),
        (1.1, "ok: [a]"),
        (1.2, "ok: [b]"),
        (2.0, "TASK [Go on with the whole gang (the drain)] ****"),
        (2.1, "skipping: [a]"),
        (2.2, "skipping: [b]"),
        (2.5, "TASK [Drain the host] ****"),
        (2.6, "included: /x/hook.yml for a, b"),
        (2.7, "ok: [a -> localhost]"),
        (3.0, "TASK [Run the drain hook] ****"),
        (3.1, "skipping: [a] => (item=one)"),
        (3.2, "ok: [a] => (item=two)"),
        (3.3, "skipping: [b] => (item=one)"),
        (3.4, "skipping: [b] => (item=two)"),
        (3.5, "skipping: [b]"),
        (4.0, "TASK [Show the batch start] ****"),
        (4.5, "PLAY RECAP ****"),
        (4.6, "a : ok=3 changed=0 unreachable=0 failed=0 skipped=1"),
    ]
    marks = [(line, machine, controller) for (_t, line), machine, controller in zip(
        [ln for ln in lines if ln[1].startswith(rollout_overhead.BANNERS)],
        [0.0, 1.0, 3.0, 3.8, 4.0, 5.0, 5.5], [0.0, 0.5, 1.0, 1.5, 1.6, 2.0, 2.2])]
    out = rollout_overhead.skipped_tasks(lines, marks)
    # the task without result lines (a run_once debug shown as ok would count; none here) is not a task run
    assert (out["task_runs"], out["host_runs"], out["skipped_host_runs"]) == (4, 8, 3)
    # only the gang step was skipped by every host: b skipped every item of the hook, a ran one
    assert out["all_skipped"] == {"task_runs": 1, "host_runs": 2, "seconds": 0.5, "machine_s": 0.8, "controller_s": 0.5,
                                  "tasks": [{"task": "Go on with the whole gang (the drain)", "runs": 1, "host_runs": 2, "seconds": 0.5}]}
    # without the CPU marks (or marks that do not match the banners): the counts and seconds only
    assert "machine_s" not in rollout_overhead.skipped_tasks(lines, marks[:-1])["all_skipped"]
