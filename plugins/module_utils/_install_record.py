# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The install record of the host tools (boot gate, its library, the metrics exporter).

Plain Python with no Ansible import, run on the host from the boot gate's library
(``python -m gpufleet_vllm_host._install_record``). ``vllm_service`` installs the tools with
about a dozen file tasks; every budget change of a host would repeat them all only to find
nothing to do. Instead the role asks this module once whether the tools on disk are still
the ones it would install:

* ``write RECORD INPUTS FILE...`` (after an install): records ``INPUTS`` (the controller's
  digest of what it installs: the library sources, the templates and the variables they
  use) and the SHA-256 of every installed file, atomically.
* ``check RECORD INPUTS [--unit NAME]...``: exit 0 and print ``current`` when the record has
  the same inputs, every recorded file still has its recorded checksum and every named
  systemd unit is enabled and active; otherwise exit 1 and print ``stale: <why>`` (a file
  edited, removed or never installed, other inputs, a stopped timer), and the role installs
  again. Any other failure (no record, an unreadable file) also reads as stale.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import typing as t

from ._boot_gate import write_json_atomic

RECORD_FORMAT = 1


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 16), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_record(record: str, inputs: str, files: t.Sequence[str]) -> dict[str, t.Any]:
    doc = {"format": RECORD_FORMAT, "inputs": inputs, "files": {path: file_sha256(path) for path in files}}
    write_json_atomic(record, doc)
    return doc


def _systemctl(verb: str, unit: str) -> str:
    proc = subprocess.run(["systemctl", verb, unit], capture_output=True, text=True, check=False)
    return proc.stdout.strip()


def stale_reason(record: str, inputs: str, units: t.Sequence[str] = (),
                 systemctl: t.Callable[[str, str], str] = _systemctl) -> str | None:
    """Why the installed tools are not the ones ``inputs`` describes, or None when they are."""
    try:
        with open(record, encoding="utf-8") as handle:
            doc = json.load(handle)
    except FileNotFoundError:
        return f"no install record {record}"
    except (OSError, ValueError) as exc:
        return f"install record {record} unreadable: {exc}"
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT or not isinstance(doc.get("files"), dict):
        return f"install record {record} has another format"
    if doc.get("inputs") != inputs:
        return "the tools to install changed (collection, templates or their variables)"
    for path, expected in sorted(doc["files"].items()):
        try:
            actual = file_sha256(path)
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
        if actual != expected:
            return f"{path} changed since it was installed"
    for unit in units:
        for verb, wanted in (("is-enabled", "enabled"), ("is-active", "active")):
            state = systemctl(verb, unit)
            if state != wanted:
                return f"{unit} is {state or 'unknown'}, not {wanted}"
    return None


def main(argv: t.Sequence[str]) -> int:
    args = list(argv)
    if len(args) >= 3 and args[0] == "write":
        write_record(args[1], args[2], args[3:])
        sys.stdout.write("recorded\n")
        return 0
    if len(args) >= 3 and args[0] == "check":
        units = []
        rest = args[3:]
        while rest:
            if rest[0] != "--unit" or len(rest) < 2:
                break
            units.append(rest[1])
            rest = rest[2:]
        else:
            reason = stale_reason(args[1], args[2], units)
            sys.stdout.write("current\n" if reason is None else f"stale: {reason}\n")
            return 0 if reason is None else 1
    sys.stderr.write("usage: _install_record write RECORD INPUTS FILE... | check RECORD INPUTS [--unit NAME]...\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
