# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Set HAProxy servers to maint (after their connections end) or ready (until HAProxy says UP), or set their weight.

Runs on the load-balancer host (ansible.builtin.script, python3, standard library only) and
talks to HAProxy's runtime API over its admin socket (``stats socket ... level admin``):

    haproxy_server_state.py --socket /run/haproxy/admin.sock --state maint --wait 60 vllm-main/host-a
    haproxy_server_state.py --socket /run/haproxy/admin.sock --state ready --wait 120 vllm-main/host-a
    haproxy_server_state.py --socket /run/haproxy/admin.sock --weight 25% vllm-main/host-a

``maint`` stops new requests to the server and waits until its current sessions are 0;
``ready`` puts it back and waits until its health check says UP. Every server is set first,
then one wait of ``--wait`` seconds covers them all. Prints one JSON line per server
({server, status, sessions, seconds, previous}); exits 1 naming the server when the wait runs
out. A drain (``maint``) that does not finish - the wait runs out, HAProxy refuses a server or
does not know it, the admin socket fails, the script is stopped (SIGTERM, SIGHUP) - gives every
server it put in MAINT its previous state back (ready, or drain), so that a host that fails its
drain keeps serving as it did; the JSON lines say ``restored``.

``ready`` with ``--previous`` (the JSON lines the drain printed, as one JSON list of those lines) gives
each server the state the drain found it in: an operator's MAINT stays, a DRAIN goes back to drain
(and is waited for until its health check passes), the others become ready. A server the drain found
in MAINT is never made ready by the rollout.

``--weight`` sets each server's weight (``set weight``): a number (0-256), or a share of the
weight its configuration gives it (``25%``; ``100%`` gives that weight back); a bake's canary
takes less of the traffic this way. Prints one JSON line per server ({server, weight, previous}).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import signal
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
    """The ``set server ... state`` that gives a server back its state (``show stat`` status): an
    operator's MAINT or DRAIN on the server itself stays; MAINT through a tracked server or DNS
    (``MAINT (via ...)``) is not the server's own: it goes back to ready."""
    status = row.get("status", "").strip()
    if status == "MAINT":
        return "maint"
    if status.startswith("DRAIN"):
        return "drain"
    return "ready"


def set_weights(path: str, names: list[tuple[str, str, str]], weight: str) -> int:
    if not re.fullmatch(r"(?:[0-9]{1,3}|(?:100|[0-9]{1,2})%)", weight) or (not weight.endswith("%") and int(weight) > 256):
        raise SystemExit(f"--weight: expected 0 to 256, or 0% to 100% of the configured weight, got {weight!r}")
    for name, backend, server in names:
        before = stat(path, backend, server).get("weight")
        answer = api(path, f"set weight {backend}/{server} {weight}").strip()
        if answer:
            raise SystemExit(f"{name}: haproxy refused 'set weight ... {weight}': {answer}")
        print(json.dumps({"server": name, "weight": stat(path, backend, server).get("weight"), "previous": before}))
    return 0


def _stop(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--state", choices=["maint", "ready"])
    action.add_argument("--weight", help="0-256, or a share of the configured weight such as 25%%")
    parser.add_argument("--previous", default="[]",
                        help="with --state ready: the drain's JSON lines (a JSON list of them): each server goes back to the state the drain found")
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for idle (maint) or UP (ready), all servers together")
    parser.add_argument("servers", nargs="+", help="backend/server")
    args = parser.parse_args()
    # a drain killed by its task's timeout (SIGTERM) restores what it changed, as one that runs out does
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    names = [(name, *name.partition("/")[::2]) for name in args.servers]
    if args.weight is not None:
        return set_weights(args.socket, names, args.weight)
    found = drained_states(args.previous) if args.state == "ready" else {}
    # an operator's MAINT stays as the drain found it: the rollout never puts such a server back
    for name in [n for n, _b, _s in names if found.get(n) == "maint"]:
        print(json.dumps({"server": name, "status": "MAINT", "kept": "maint"}))
    names = [entry for entry in names if found.get(entry[0]) != "maint"]
    target = {name: found.get(name) if found.get(name) == "drain" else args.state for name, _b, _s in names}
    changed: list[tuple[str, str]] = []  # (server, its previous state) of every server this run put in MAINT
    finished = False
    try:
        # every server first, then one wait for all of them: two instances take one wait, not two
        for name, backend, server in names:
            before = previous_state(stat(args.socket, backend, server))
            answer = api(args.socket, f"set server {backend}/{server} state {target[name]}").strip()
            if answer:
                raise SystemExit(f"{name}: haproxy refused 'set server ... state {target[name]}': {answer}")
            if args.state == "maint":
                changed.append((name, before))
        start = time.monotonic()
        rows: dict[str, dict[str, str]] = {}
        pending = list(names)
        while pending:
            for entry in list(pending):
                name, backend, server = entry
                row = rows[name] = stat(args.socket, backend, server)
                wanted = target[name]
                done = (row["status"].startswith("MAINT") and int(row["scur"] or 0) == 0) if wanted == "maint" \
                    else row["status"].startswith("DRAIN" if wanted == "drain" else "UP")
                if done:
                    pending.remove(entry)
            if not pending or time.monotonic() - start > args.wait:
                break
            time.sleep(0.2)
        for name, _backend, _server in names:
            row = rows[name]
            print(json.dumps({"server": name, "status": row["status"], "sessions": int(row["scur"] or 0),
                              "seconds": round(time.monotonic() - start, 2), "previous": dict(changed).get(name)}))
        failed = [f"{name}: still {rows[name]['status']} with {rows[name]['scur']} session(s) after {args.wait:g} s"
                  for name, _backend, _server in pending]
        if failed:
            print("; ".join(failed), file=sys.stderr)
            return 1
        finished = True
        return 0
    finally:
        if changed and not finished:
            restored = restore(args.socket, changed)
            print("restored " + ", ".join(f"{n} to {st}" for n, st in restored), file=sys.stderr)


def drained_states(text: str) -> dict[str, str]:
    """server -> the state the drain found it in, from the drain's JSON lines (``previous``)."""
    try:
        lines = json.loads(text or "[]")
    except ValueError as exc:
        raise SystemExit(f"--previous: expected a JSON list of the drain's JSON lines: {exc}") from None
    found = {}
    for line in lines if isinstance(lines, list) else []:
        try:
            entry = json.loads(line) if isinstance(line, str) else line
        except ValueError:
            continue  # a line of the drain that is not one of its server lines
        if isinstance(entry, dict) and entry.get("server") and entry.get("previous") in ("maint", "drain", "ready"):
            found[str(entry["server"])] = str(entry["previous"])
    return found


def restore(path: str, changed: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Give every server of ``changed`` its previous state back (a drain that did not finish)."""
    done = []
    for name, state in changed:
        backend, _sep, server = name.partition("/")
        try:
            answer = api(path, f"set server {backend}/{server} state {state}").strip()
        except OSError as exc:
            answer = f"the admin socket failed: {exc}"
        print(json.dumps({"server": name, "restored": state, "answer": answer or None}))
        done.append((name, state if not answer else f"{state} (not done: {answer})"))
    return done


if __name__ == "__main__":
    sys.exit(main())
