# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The example alert rules for the gpufleet_vllm_* metrics: promtool checks them and runs their
unit tests, and every metric they use is one the exporter writes."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from ansible_collections.gpufleet.vllm.plugins.module_utils import _audit

ROOT = Path(__file__).resolve().parents[1].parent
RULES = ROOT / "docs" / "prometheus" / "gpufleet-vllm-alerts.yml"
TESTS = ROOT / "docs" / "prometheus" / "gpufleet-vllm-alerts.test.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool not found: install the Debian package prometheus (make apt-deps)"
    return found


def test_promtool_check_rules():
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 10 rules found" in done.stdout


def test_promtool_test_rules():
    done = subprocess.run([promtool(), "test", "rules", TESTS.name], capture_output=True, text=True, timeout=120,
                          check=False, cwd=TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_rules_use_only_metrics_the_exporter_writes():
    """Render an exporter registry and compare its metric names with those in the rules."""
    import prometheus_client  # pylint: disable=import-outside-toplevel

    last_start = {"action": "shrink", "degraded": {"x": 1}, "kv_cache_memory_bytes": 1, "kv_cache_tokens": 16}
    instance = {"instance": "main", "host_class": "c", "verdict": "ok", "kv_cache_memory_bytes": 1, "kv_cache_tokens": 16,
                "plan_timestamp": 0.0, "last_start": last_start,
                "ranks": [{"rank": 0, "gpu": 0, "floor_bytes": 2, "free_bytes": 1, "margin_bytes": -1, "uuid": "GPU-1",
                           "health": {"remapped_rows": {"pending": True, "failure": False}, "errors": {}}}],
                "gang": {"gang": "10.0.0.1:29501", "leader": True}}
    report = {"checked_at": 1.0, "errors": [], "instances": [instance]}
    text = prometheus_client.generate_latest(_audit.registry(report, prometheus_client)).decode()
    written = set(re.findall(r"^(gpufleet_vllm_\w+)\{", text, flags=re.M))
    used = set()
    for group in yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]:
        for rule in group["rules"]:
            used |= set(re.findall(r"gpufleet_vllm_\w+", rule["expr"]))
    assert used and used <= written, used - written
