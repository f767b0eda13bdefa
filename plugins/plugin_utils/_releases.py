# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The engine releases a host keeps (roles/vllm_runtime, tasks/switch.yml).

Plain Python, no Ansible import; behind the ``release_history`` filter. The history lists the
release directories the venv link was switched to, oldest first; after a switch the current
release and the ``keep_previous`` releases switched to before it are kept, every older one is
removed. A release that was only installed (staged for a later batch) is not in the history
and is never removed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ReleaseError(ValueError):
    """Bad input, naming the field."""


def _path(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\n" in value:
        raise ReleaseError(f"{field} must be an absolute path, got {value!r}")
    return value.rstrip("/") or "/"


def release_history(history: Any, previous: Any, current: Any, keep_previous: Any) -> dict[str, list[str]]:
    """``{'keep': [...], 'remove': [...]}``: the new history (oldest first, ``current`` last) and the
    releases to delete. ``previous`` is where the link pointed before the switch ('' for none)."""
    if isinstance(keep_previous, str) and keep_previous.strip().isdigit():
        keep_previous = int(keep_previous)  # an extra var given on the command line
    if isinstance(keep_previous, bool) or not isinstance(keep_previous, int) or keep_previous < 0:
        raise ReleaseError(f"vllm_runtime_keep_previous must be a whole number >= 0, got {keep_previous!r}")
    if not isinstance(history, Sequence) or isinstance(history, (str, bytes)):
        raise ReleaseError(f"the release history must be a list of paths, got {history!r}")
    now = _path(current, "the current release")
    seen = [_path(p, "a release in the history") for p in history]
    if previous not in (None, ""):
        before = _path(previous, "the previous release")
        if before != now and (not seen or seen[-1] != before):
            seen = [p for p in seen if p != before] + [before]
    ordered: list[str] = []
    for path in [p for p in seen if p != now] + [now]:
        if path not in ordered:
            ordered.append(path)
    keep = ordered[-(keep_previous + 1):]
    remove = [p for p in ordered if p not in keep]
    return {"keep": keep, "remove": remove}
