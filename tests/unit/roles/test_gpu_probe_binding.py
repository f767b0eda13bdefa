# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""roles/gpu_probe, tasks_from interpreter, run for real on localhost: the binding package must be
pinned (or a wheel file), and with gpu_probe_read_only nothing is installed: the small venv is used
as an earlier run left it, and a host without the binding fails naming the playbooks that install it.
"""

from __future__ import annotations

import sys

import yaml
from _role_cases import ROOT, run_role_cases  # pylint: disable=import-error  # beside this file

PINNED = "nvidia-ml-py==13.615.71"


def test_the_default_package_is_the_pinned_test_version():
    defaults = yaml.safe_load((ROOT / "roles" / "gpu_probe" / "defaults" / "main.yml").read_text(encoding="utf-8"))
    assert defaults["gpu_probe_binding_package"] == PINNED
    assert defaults["gpu_probe_read_only"] is False
    # the version the test hosts' system Python and the wheelhouses of the fleet tests carry
    dev = (ROOT / "requirements-dev.txt").read_text(encoding="utf-8").splitlines()
    assert PINNED in [line.split("#", 1)[0].strip() for line in dev]


def test_unpinned_packages_are_refused_and_read_only_installs_nothing(tmp_path):
    missing = tmp_path / "missing-venv"
    found = tmp_path / "found-venv"
    (found / "bin").mkdir(parents=True)
    # an earlier run's venv: its python imports pynvml (the test interpreter has nvidia-ml-py)
    python = found / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n", encoding="utf-8")
    python.chmod(0o755)
    cases = {
        "bare_name": {"gpu_probe_binding_package": "nvidia-ml-py"},
        "range": {"gpu_probe_binding_package": "nvidia-ml-py>=13"},
        "wildcard": {"gpu_probe_binding_package": "nvidia-ml-py==13.*"},
        "relative_wheel": {"gpu_probe_binding_package": "wheels/nvidia_ml_py-13.615.71-py3-none-any.whl"},
        # pinned or a wheel path passes; read-only with the venv missing fails naming the playbooks
        "read_only_missing": {"gpu_probe_binding_package": PINNED, "gpu_probe_read_only": True,
                              "gpu_probe_install_binding": True, "gpu_probe_binding_venv": str(missing)},
        "read_only_wheel_python": {"gpu_probe_binding_package": "/srv/wheelhouse/nvidia_ml_py-13.615.71-py3-none-any.whl",
                                   "gpu_probe_read_only": True, "gpu_probe_python": str(tmp_path / "no-python")},
        # read-only with the venv an earlier run left: used as it is, nothing built or stamped
        "read_only_found": {"gpu_probe_read_only": True, "gpu_probe_install_binding": True,
                            "gpu_probe_binding_venv": str(found)},
    }
    outcome, stdout = run_role_cases(tmp_path, "gpu_probe", "interpreter", cases)
    for case in ("bare_name", "range", "wildcard", "relative_wheel"):
        msg = " ".join(outcome[case].split())
        assert msg.startswith("gpu_probe_binding_package must pin one version of the NVML binding"), (case, msg)
        assert f"got '{cases[case]['gpu_probe_binding_package']}'" in msg, (case, msg)

    msg = " ".join(outcome["read_only_missing"].split())
    assert f"{missing}/bin/python: not found" in msg, msg
    assert "This play only reads and installs nothing: playbooks/runtime.yml installs the binding" in msg, msg
    assert f"else {PINNED} into {missing}), and so does playbooks/rollout.yml" in msg, msg
    assert not missing.exists(), "read-only: no venv created"

    msg = " ".join(outcome["read_only_wheel_python"].split())
    assert "must pin" not in msg and "Install nvidia-ml-py into gpu_probe_python" in msg, msg

    assert outcome["read_only_found"] == "ok", outcome["read_only_found"]
    assert sorted(p.name for p in found.iterdir()) == ["bin"], "read-only: nothing written into the venv"
    assert "Build the binding venv" not in stdout and "Look for a complete binding venv" not in stdout
