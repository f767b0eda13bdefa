# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""plugin_utils/_nvml_interpreter: the candidates' order, and the search run by a real sh over real interpreters."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

from ansible_collections.gpufleet.vllm.plugins.plugin_utils._nvml_interpreter import candidates, host_python, outcome, search_command

VENV = "/opt/gpufleet/nvml-venv"


def test_the_candidates_follow_the_roles_rule():
    common = {"vllm_python": "/opt/vllm/venv/bin/python3", "binding_venv": VENV, "host": "/usr/bin/python3"}
    assert candidates(python="", binding_venv_only=False, **common) == [
        "/opt/vllm/venv/bin/python3", "/usr/bin/python3", f"{VENV}/bin/python"]
    # gpu_probe_python set: only that one; gpu_probe_install_binding: only the small venv's
    assert candidates(python="/usr/local/bin/python3.12", binding_venv_only=False, **common) == ["/usr/local/bin/python3.12"]
    assert candidates(python="/usr/local/bin/python3.12", binding_venv_only=True, **common) == [f"{VENV}/bin/python"]
    no_vllm = {"vllm_python": "", "binding_venv": VENV + "/", "host": "/usr/bin/python3"}
    assert candidates(python="", binding_venv_only=False, **no_vllm) == ["/usr/bin/python3", f"{VENV}/bin/python"]


def test_the_host_python_is_the_gathered_one_else_an_absolute_setting_else_python3():
    assert host_python("/usr/bin/python3.11", "/usr/bin/python3") == "/usr/bin/python3.11"
    assert host_python(None, "/usr/bin/python3") == "/usr/bin/python3"
    assert host_python(None, "auto_silent") == "python3"
    assert host_python(None, None) == "python3"


def test_the_search_keeps_the_first_that_imports_pynvml_and_says_why_the_others_were_passed_over(tmp_path):
    missing = tmp_path / "missing" / "python"
    broken = tmp_path / "broken-python"
    # an interpreter without the binding: the import fails as Python reports it
    broken.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import no_such_module_here' \n", encoding="utf-8")
    broken.chmod(0o755)
    # the test interpreter has nvidia-ml-py (requirements-dev.txt)
    good = tmp_path / "good-python"
    good.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n", encoding="utf-8")
    good.chmod(0o755)
    tried = [str(missing), str(broken), str(good), "/never/reached/python"]
    proc = subprocess.run(search_command(tried), shell=True, capture_output=True, text=True, check=False)
    found, passed_over = outcome(proc.returncode, proc.stdout)
    assert proc.stderr == ""
    assert found == str(good)
    assert passed_over[0] == f"{missing}: not found"
    assert passed_over[1] == f"{broken}: ModuleNotFoundError: No module named 'no_such_module_here'"
    assert len(passed_over) == 2

    proc = subprocess.run(search_command([str(missing), str(broken)]), shell=True, capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    reasons = [f"{missing}: not found", f"{broken}: ModuleNotFoundError: No module named 'no_such_module_here'"]
    assert outcome(proc.returncode, proc.stdout) == ("", reasons)


def test_a_bare_name_is_resolved_on_the_path(tmp_path):
    good = tmp_path / "python-with-nvml"
    good.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n", encoding="utf-8")
    good.chmod(0o755)
    proc = subprocess.run(search_command(["python-with-nvml"]), shell=True, capture_output=True, text=True, check=False,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert outcome(proc.returncode, proc.stdout) == (str(good), [])


def test_the_reasons_survive_a_terminal_and_noise_is_ignored(tmp_path):
    """Over ``ssh -tt`` stderr arrives in stdout and lines end in CR LF: only the tagged lines count."""
    good = tmp_path / "good-python"
    good.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n", encoding="utf-8")
    good.chmod(0o755)
    # the search with stdout and stderr on one pseudo-terminal, as ssh -tt returns them
    main, side = pty.openpty()
    proc = subprocess.Popen(search_command(["/no/such/python", str(good)]), shell=True, stdout=side, stderr=side)
    os.close(side)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # EIO: the terminal closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(main)
    text = seen.decode()
    assert "\r\n" in text, repr(text)
    assert outcome(proc.wait(), "Welcome to the GPU host\r\n" + text) == (str(good), ["/no/such/python: not found"])
    # a failed search never yields an interpreter, whatever its output says
    assert outcome(1, "found\t/usr/bin/python3\n") == ("", [])
