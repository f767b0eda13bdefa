# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Set HAProxy servers to maint (after their connections end) or ready (until HAProxy says UP).

Runs on the load-balancer host (ansible.builtin.script, python3, standard library only) and
talks to HAProxy's runtime API over its admin socket (``stats socket ... level admin``):

    haproxy_server_state.py --socket /run/haproxy/admin.sock --state maint --wait 60 vllm-main/host-a
    haproxy_server_state.py --socket /run/haproxy/admin.sock --state ready --wait 120 vllm-main/host-a

``maint`` stops new requests to the server and waits until its current sessions are 0;
``ready`` puts it back and waits until its health check says UP. Prints one JSON line
per server ({server, status, sessions, seconds}); exits 1 naming the server when the wait
runs out.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import socket
import sys
import time


def api(path: str, command: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(command.encode() + b"\n")
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode()


def stat(path: str, backend: str, server: str) -> dict[str, str]:
    text = api(path, "show stat").lstrip("# ")
    for row in csv.DictReader(io.StringIO(text)):
        if row.get("pxname") == backend and row.get("svname") == server:
            return row
    raise SystemExit(f"haproxy has no server {backend}/{server}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--state", choices=["maint", "ready"], required=True)
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for idle (maint) or UP (ready)")
    parser.add_argument("servers", nargs="+", help="backend/server")
    args = parser.parse_args()
    failed = []
    for name in args.servers:
        backend, _sep, server = name.partition("/")
        answer = api(args.socket, f"set server {backend}/{server} state {args.state}").strip()
        if answer:
            raise SystemExit(f"{name}: haproxy refused 'set server ... state {args.state}': {answer}")
        start = time.monotonic()
        while True:
            row = stat(args.socket, backend, server)
            done = (row["status"].startswith("MAINT") and int(row["scur"] or 0) == 0) if args.state == "maint" \
                else row["status"].startswith("UP")
            if done or time.monotonic() - start > args.wait:
                break
            time.sleep(0.2)
        print(json.dumps({"server": name, "status": row["status"], "sessions": int(row["scur"] or 0),
                          "seconds": round(time.monotonic() - start, 2)}))
        if not done:
            failed.append(f"{name}: still {row['status']} with {row['scur']} session(s) after {args.wait:g} s")
    if failed:
        print("; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
