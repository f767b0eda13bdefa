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
per server ({server, status, sessions, seconds, previous}); exits 1 naming the server when
the wait runs out. A drain (``maint``) that runs out first gives every server it put in MAINT
its previous state back (ready, or drain), so that a host that fails its drain keeps serving
as it did; the JSON line says ``restored``.
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


def previous_state(row: dict[str, str]) -> str:
    """The ``set server ... state`` that gives a server back its state (``show stat`` status)."""
    status = row.get("status", "")
    if status.startswith("MAINT"):
        return "maint"
    if status.startswith("DRAIN"):
        return "drain"
    return "ready"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--state", choices=["maint", "ready"], required=True)
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for idle (maint) or UP (ready)")
    parser.add_argument("servers", nargs="+", help="backend/server")
    args = parser.parse_args()
    failed = []
    changed: list[tuple[str, str]] = []  # (server, its previous state) of every server this run put in MAINT
    for name in args.servers:
        backend, _sep, server = name.partition("/")
        before = previous_state(stat(args.socket, backend, server))
        answer = api(args.socket, f"set server {backend}/{server} state {args.state}").strip()
        if answer:
            restore(args.socket, changed)
            raise SystemExit(f"{name}: haproxy refused 'set server ... state {args.state}': {answer}")
        if args.state == "maint":
            changed.append((name, before))
        start = time.monotonic()
        while True:
            row = stat(args.socket, backend, server)
            done = (row["status"].startswith("MAINT") and int(row["scur"] or 0) == 0) if args.state == "maint" \
                else row["status"].startswith("UP")
            if done or time.monotonic() - start > args.wait:
                break
            time.sleep(0.2)
        print(json.dumps({"server": name, "status": row["status"], "sessions": int(row["scur"] or 0),
                          "seconds": round(time.monotonic() - start, 2), "previous": before}))
        if not done:
            failed.append(f"{name}: still {row['status']} with {row['scur']} session(s) after {args.wait:g} s")
            if args.state == "maint":
                break  # the host stays as it was: no later server of it is drained
    if failed:
        if args.state == "maint":
            restored = restore(args.socket, changed)
            failed.append("restored " + ", ".join(f"{n} to {s}" for n, s in restored))
        print("; ".join(failed), file=sys.stderr)
        return 1
    return 0


def restore(path: str, changed: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Give every server of ``changed`` its previous state back (a drain that did not finish)."""
    done = []
    for name, state in changed:
        backend, _sep, server = name.partition("/")
        answer = api(path, f"set server {backend}/{server} state {state}").strip()
        print(json.dumps({"server": name, "restored": state, "answer": answer or None}))
        done.append((name, state if not answer else f"{state} (refused: {answer})"))
    return done


if __name__ == "__main__":
    sys.exit(main())
