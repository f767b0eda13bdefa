# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Per-host history of probes, beside the profile store: instability seen over time.

Plain Python with no Ansible import, used by the ``kv_plan`` action. One probe's samples
span seconds; a co-tenant that comes and goes every few minutes is seen only across
probes. Each planning run appends every GPU's boot-free memory of each host to
``<store>/.probe-history/<host>.json`` (bounded to ``keep`` probes, written atomically under
an exclusive lock), and the planner reads, per rank, how far boot-free memory moved across
the last ``window`` probes (``history_spread_bytes``) and the lowest it was
(``history_min_bytes``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import typing as t

from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default

FORMAT = 1
DIRNAME = ".probe-history"
DEFAULT_KEEP: int = default("probe_history_keep")
DEFAULT_WINDOW: int = default("probe_history_window")


class ProbeHistoryError(Exception):
    """The history cannot be read or written, or an input is wrong; the message names it."""


def _host_file(store: str, host: str) -> str:
    if not host or host in (".", "..") or not all(c.isalnum() or c in "_.-" for c in host):
        raise ProbeHistoryError(f"probe history: host name {host!r} cannot name a file (letters, digits, '_', '.', '-')")
    return os.path.join(store, DIRNAME, f"{host}.json")


@contextlib.contextmanager
def _locked(directory: str) -> t.Iterator[None]:
    with open(os.path.join(directory, ".lock"), "a+", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load(store: str, host: str) -> list[dict[str, t.Any]]:
    """The recorded probes of ``host``, oldest first (none when there is no history)."""
    path = _host_file(store, host)
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise ProbeHistoryError(f"probe history {path}: cannot read it: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("probes"), list):
        raise ProbeHistoryError(f"probe history {path}: not a format {FORMAT} history")
    # the file's own JSON: its probe records, as written by record()
    return t.cast("list[dict[str, t.Any]]", doc["probes"])


def entry(gpus: t.Sequence[t.Mapping[str, t.Any]], at: float) -> dict[str, t.Any]:
    """One probe: ``{at, boot_free: {index: bytes}}`` from ``gpu_memory_info`` GPU entries."""
    boot_free = {}
    for pos, gpu in enumerate(gpus):
        value = gpu.get("boot_free_bytes", gpu.get("free_bytes"))
        if isinstance(value, int) and not isinstance(value, bool):
            boot_free[str(int(gpu.get("index", pos)))] = value
    return {"at": at, "boot_free": boot_free}


def record(store: str, host: str, gpus: t.Sequence[t.Mapping[str, t.Any]], at: float,
           keep: int = DEFAULT_KEEP, check: bool = False) -> list[dict[str, t.Any]]:
    """Append this probe of ``host`` and return the history with it (written unless ``check``)."""
    if keep < 1:
        raise ProbeHistoryError(f"probe history: keep must be >= 1, got {keep}")
    path = _host_file(store, host)
    directory = os.path.dirname(path)
    if check:
        return [*load(store, host), entry(gpus, at)][-keep:]
    try:
        os.makedirs(directory, mode=0o750, exist_ok=True)
    except OSError as exc:
        raise ProbeHistoryError(f"probe history {directory}: cannot create it: {exc.strerror or exc}") from None
    with _locked(directory):
        probes = [*load(store, host), entry(gpus, at)][-keep:]
        fd, tmp = tempfile.mkstemp(prefix=f".{host}.", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump({"format": FORMAT, "host": host, "probes": probes}, handle, indent=1, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise ProbeHistoryError(f"probe history {path}: cannot write it: {exc.strerror or exc}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return probes


def movement(probes: t.Sequence[t.Mapping[str, t.Any]], index: int, window: int = DEFAULT_WINDOW) -> tuple[int, int] | None:
    """(max - min, min) of one GPU's boot-free memory over the last ``window`` probes that saw it;
    None with fewer than two such probes."""
    seen = [p["boot_free"][str(index)] for p in probes if isinstance(p.get("boot_free"), dict) and str(index) in p["boot_free"]]
    seen = seen[-window:]
    if len(seen) < 2:
        return None
    return max(seen) - min(seen), min(seen)
