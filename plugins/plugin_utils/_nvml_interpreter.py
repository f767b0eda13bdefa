# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Which Python interpreter on a host runs the NVML probe: the candidates in order, and the one search.

The gpu_probe role's ``interpreter`` entry point and the probe play's fast path both go through
``candidates`` and ``SEARCH`` (gpufleet.vllm.nvml_interpreter), so the order and the reasons a
candidate was passed over have one home.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

# Prints the first argument that imports pynvml (a bare name is resolved on the PATH) and exits 0;
# the reason each other one was passed over goes to stderr, one line each; exit 1 when none does.
SEARCH = (
    'for p in "$@"; do '
    'q=$(command -v "$p" 2>/dev/null) && [ -x "$q" ] || { echo "$p: not found" >&2; continue; }; '
    "if err=$(\"$q\" -c 'import pynvml' 2>&1); then echo \"$q\"; exit 0; fi; "
    'echo "$q: $(printf \'%s\\n\' "$err" | tail -n 1)" >&2; '
    "done; exit 1"
)


def host_python(python_executable: str | None, configured: str | None) -> str:
    """The interpreter Ansible runs modules with where it is known (gathered, or an absolute setting), else python3."""
    if python_executable:
        return python_executable
    if configured and configured.startswith("/"):
        return configured
    return "python3"


def candidates(*, python: str, vllm_python: str, binding_venv: str, binding_venv_only: bool, host: str) -> list[str]:
    """The interpreters to try, in order (the gpu_probe role's rule).

    ``binding_venv_only`` (gpu_probe_install_binding): only the small venv's. ``python`` set: only
    that one. Else the vLLM venv's python (it ships nvidia-ml-py), the host's, the small venv's.
    """
    venv_python = binding_venv.rstrip("/") + "/bin/python"
    if binding_venv_only:
        return [venv_python]
    if python:
        return [python]
    return ([vllm_python] if vllm_python else []) + [host, venv_python]


def search_command(tried: Sequence[str]) -> str:
    """The shell command line that runs SEARCH over ``tried``."""
    return " ".join(shlex.quote(word) for word in ["sh", "-c", SEARCH, "sh", *tried])


def outcome(rc: int, stdout: str, stderr: str) -> tuple[str, list[str]]:
    """The interpreter found ('' when none) and the reasons the others were passed over, from SEARCH's output."""
    found = stdout.strip().splitlines()[-1].strip() if rc == 0 and stdout.strip() else ""
    return found, [line for line in stderr.splitlines() if line.strip()]
