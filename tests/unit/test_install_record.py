# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The host tools' install record: vllm_service installs the boot gate and exporter only when it says stale."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils import _install_record as rec

MODULE_UTILS = Path(rec.__file__).resolve().parent


@pytest.fixture(name="installed")
def fixture_installed(tmp_path: Path) -> tuple[Path, list[str]]:
    files = []
    for name, text in (("gate", "#!/usr/bin/python3\nprint('gate')\n"), ("lib.py", "X = 1\n")):
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        files.append(str(path))
    record = tmp_path / "install-record.json"
    rec.write_record(str(record), "inputs-1", files)
    return record, files


def test_a_fresh_record_is_current(installed: tuple[Path, list[str]]) -> None:
    record, files = installed
    doc = json.loads(record.read_text(encoding="utf-8"))
    assert doc["inputs"] == "inputs-1" and sorted(doc["files"]) == sorted(files)
    assert rec.stale_reason(str(record), "inputs-1") is None


def test_other_inputs_are_stale(installed: tuple[Path, list[str]]) -> None:
    record, _files = installed
    assert "changed (collection, templates" in (rec.stale_reason(str(record), "inputs-2") or "")


def test_an_edited_file_is_named(installed: tuple[Path, list[str]]) -> None:
    record, files = installed
    Path(files[1]).write_text("X = 2\n", encoding="utf-8")
    assert rec.stale_reason(str(record), "inputs-1") == f"{files[1]} changed since it was installed"


def test_a_removed_file_is_named(installed: tuple[Path, list[str]]) -> None:
    record, files = installed
    Path(files[0]).unlink()
    assert (rec.stale_reason(str(record), "inputs-1") or "").startswith(f"{files[0]}: ")


def test_no_record_or_a_broken_one_is_stale(tmp_path: Path) -> None:
    assert "no install record" in (rec.stale_reason(str(tmp_path / "none.json"), "x") or "")
    broken = tmp_path / "broken.json"
    broken.write_text("{", encoding="utf-8")
    assert "unreadable" in (rec.stale_reason(str(broken), "x") or "")
    broken.write_text('{"format": 99, "files": {}}', encoding="utf-8")
    assert "another format" in (rec.stale_reason(str(broken), "x") or "")


def test_a_unit_not_enabled_and_active_is_stale(installed: tuple[Path, list[str]]) -> None:
    record, _files = installed
    states = {("is-enabled", "t.timer"): "enabled", ("is-active", "t.timer"): "inactive"}
    reason = rec.stale_reason(str(record), "inputs-1", ["t.timer"], systemctl=lambda verb, unit: states[(verb, unit)])
    assert reason == "t.timer is inactive, not active"
    states[("is-active", "t.timer")] = "active"
    assert rec.stale_reason(str(record), "inputs-1", ["t.timer"], systemctl=lambda verb, unit: states[(verb, unit)]) is None


def test_the_command_line_as_the_role_runs_it(tmp_path: Path, installed: tuple[Path, list[str]]) -> None:
    """``python -m <package>._install_record`` from a copy of the library, as installed on a host."""
    record, files = installed
    package = tmp_path / "lib" / "gpufleet_vllm_host"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    for name in ("_install_record.py", "_boot_gate.py", "_kv_capacity.py"):
        (package / name).write_bytes((MODULE_UTILS / name).read_bytes())
    env = {"PYTHONPATH": str(tmp_path / "lib"), "PATH": "/usr/bin:/bin"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpufleet_vllm_host._install_record", *args],
                              capture_output=True, text=True, env=env, check=False, timeout=60)

    assert (cli("check", str(record), "inputs-1").returncode, cli("check", str(record), "inputs-1").stdout) == (0, "current\n")
    stale = cli("check", str(record), "inputs-2")
    assert stale.returncode == 1 and stale.stdout.startswith("stale: the tools to install changed")
    other = tmp_path / "other.json"
    assert cli("write", str(other), "inputs-3", *files).returncode == 0
    assert cli("check", str(other), "inputs-3").returncode == 0
    assert cli("bogus").returncode == 2
