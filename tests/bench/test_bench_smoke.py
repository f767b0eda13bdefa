# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Every part of ``bench/`` runs, at its smallest size (the ``bench`` stage of ``make test``).

``make bench`` regenerates ``docs/benchmarks.md`` and takes an hour; nothing ran it between
releases, so a benchmark could break (a synthetic input the planner's validation now refuses)
and nobody would know until the next measurement. Here each part runs once through
``bench/run.py --smoke`` into a scratch report: it must finish, print its JSON, be neither
skipped nor failed, and render. No figure is asserted: timings on a shared two-core machine
say nothing, and the benchmarks' own ratios are measured by ``make bench``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "integration"))

import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error
import run as bench_run  # noqa: E402  pylint: disable=wrong-import-position,import-error


def test_every_script_of_bench_is_a_part_with_a_smoke_size() -> None:
    """A new script under bench/ is run here too: each one is called by a part, with smoke arguments."""
    runner = (REPO / "bench" / "run.py").read_text(encoding="utf-8")
    scripts = {p.name for p in (REPO / "bench").glob("*.py")} - {"run.py"}
    assert scripts and [n for n in sorted(scripts) if f'"{n}"' not in runner] == [], "a script no part runs"
    assert all(set(sizes) == set(bench_run.SIZES) for sizes in bench_run.ARGS.values()), bench_run.ARGS


@pytest.mark.parametrize("part", bench_run.PARTS)
def test_the_part_runs_at_its_smallest_size(part: str, tmp_path: Path) -> None:
    report, results = tmp_path / "benchmarks.md", tmp_path / "results.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = procgroup.run([sys.executable, str(REPO / "bench" / "run.py"), "--smoke", "--only", part,
                          "--out", str(report), "--json", str(results)], timeout=1800, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-6000:]
    entries = json.loads(results.read_text(encoding="utf-8"))["results"][part]
    assert entries, part
    for name, entry in entries.items():
        assert "skipped" not in entry and not entry.get("error"), (name, entry)
        assert entry["rc"] == 0 and isinstance(entry["result"], dict), (name, entry)
    assert report.read_text(encoding="utf-8").startswith("# "), "the report rendered"
