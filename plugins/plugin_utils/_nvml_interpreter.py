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

# Tries each argument in order. Every line goes to stdout, tagged: ``skip<TAB>why`` for one passed over,
# ``found<TAB>path`` for the first that imports pynvml (a bare name is resolved on the PATH), then exit 0;
# exit 1 when none does. Nothing on stderr is read: over ssh with a terminal (``ssh -tt``, the ssh
# connection's default for a command with become) stderr arrives inside stdout.
SEARCH = (
    'for p in "$@"; do '
    'q=$(command -v "$p" 2>/dev/null) && [ -x "$q" ] || { printf \'skip\\t%s: not found\\n\' "$p"; continue; }; '
    "if err=$(\"$q\" -c 'import pynvml' 2>&1); then printf 'found\\t%s\\n' \"$q\"; exit 0; fi; "
    'printf \'skip\\t%s: %s\\n\' "$q" "$(printf \'%s\\n\' "$err" | tail -n 1)"; '
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


def outcome(rc: int, stdout: str) -> tuple[str, list[str]]:
    """The interpreter found ('' when none) and why the others were passed over, from SEARCH's tagged output.

    Untagged lines (a login banner, a warning of ssh's) are ignored; a terminal's carriage returns are stripped.
    """
    found, passed_over = "", []
    for line in stdout.splitlines():
        fields = line.rstrip("\r").split("\t", 1)
        tag, text = (fields[0], fields[1]) if len(fields) == 2 else (fields[0], "")
        if tag == "skip" and text:
            passed_over.append(text)
        elif tag == "found" and text and rc == 0:
            found = text
    return found, passed_over
