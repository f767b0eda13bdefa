# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Leases that let one run at a time change a host class, and a host (plain Python, no Ansible import).

A class lease is a file ``<store>/.leases/<class>.json`` in the profile store, which every
controller of a fleet shares (a local directory, or an NFS mount of it); a host lease is a
file ``<state_dir>/.leases/host.json`` on a host the run changes, held while the run changes
it (its canaries, its batch), so that runs that do not share a store still never change one
host at once. A lease names its owner (user and host of the controller), the run id, start
time, expiry and the purpose (``rollout``, ``profile``...). It is created with ``link(2)``
of a complete temporary file, so that two runs racing for it see exactly one winner, and
either no lease or a whole one.

* A run that finds a lease held by another run, not expired, is refused with the holder's
  identity (``LeaseHeld``), or waits for it with ``wait`` seconds.
* An expired lease is taken over: renamed aside under a name of its own (only one taker's
  rename succeeds), then replaced; the taker gets the old lease back to put into its
  report. A lease is expired when its time-to-live ran out, at once when it was taken on
  this same machine by a controller (``ansible-playbook``) that no longer runs (killed,
  crashed, or ended by a lost host that stopped its play before it could release it), and
  at once when its run is ``superseded``: a host lease names its run's store (``store_id``),
  and a run of the same store that no longer holds its class lease (it ended while the host
  was unreachable, or it was killed and its class lease taken over) holds no host either.
* The holder renews the lease as it goes (each batch), and releases it at the end; a
  release of a lease someone else holds now changes nothing.

Times are the clock of the machine that holds the file (``time.time()``): a class lease's
expiry is judged by the clock of the controller that reads it, a host lease's by the host's,
and a controller whose clock is far off another's is named by the skew between the lease's
start and the reader's clock when the lease is refused.
"""

from __future__ import annotations

import errno
import getpass
import json
import os
import re
import socket
import tempfile
import time
import typing as t
import uuid

from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default

LEASE_DIR = ".leases"
FORMAT = 1
# a lease is a run's: a few hours at most between renewals (every batch renews it)
MIN_TTL = 60
MAX_TTL = 7 * 24 * 3600
MAX_WAIT = 24 * 3600
# a scope (a host class) or a run id: a file name part, matched whole (``$`` would let a trailing newline through)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# the scope of a host's own lease, in <state_dir>/.leases/ on the host
HOST_SCOPE = "host"
STATES = ("present", "renewed", "absent")

# One argument spec for the action plugin (class leases, on the controller) and the module
# (a host's lease, run on the host by the action when host_dir is given).
ARGUMENT_SPEC: dict[str, t.Any] = {
    "state": {"type": "str", "default": "present", "choices": list(STATES)},
    "store": {"type": "path"},
    "classes": {"type": "list", "elements": "str"},
    "host_dir": {"type": "path"},
    "run_id": {"type": "str", "required": True},
    "ttl": {"type": "int", "default": default("lease_ttl")},
    "wait": {"type": "int", "default": default("lease_wait")},
    "purpose": {"type": "str", "default": "rollout"},
    "details": {"type": "dict", "default": {}},
    "superseded": {"type": "list", "elements": "str", "default": []},
    "owner": {"type": "str"},
    "controller": {"type": "dict"},
}
ARGUMENT_RULES: dict[str, t.Any] = {
    "required_one_of": [["classes", "host_dir"]],
    "mutually_exclusive": [["classes", "host_dir"]],
    "required_by": {"classes": ["store"]},
}
STORE_ID = "store-id"


class LeaseError(Exception):
    """A lease cannot be read, written or given the inputs; the message names the file or the field."""


class LeaseHeld(LeaseError):
    """Another run holds the lease; ``holder`` is its document."""

    def __init__(self, message: str, holder: t.Mapping[str, t.Any]) -> None:
        super().__init__(message)
        self.holder = dict(holder)


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def default_owner() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # pragma: no cover - a user without a passwd entry
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc), None when it does not run."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return fields[19]  # field 22 of stat(5): starttime; the split starts at field 3
    except (OSError, IndexError):
        return None


def controller_process() -> dict[str, t.Any]:
    """This run's controller: the ``ansible-playbook`` process that forked the worker calling us."""
    pid = os.getppid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _process_start(pid)}


def holder_gone(doc: t.Mapping[str, t.Any]) -> bool:
    """The lease was taken on this machine by a controller that no longer runs (a pid reused since does not count)."""
    pid = doc.get("pid")
    if doc.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    started = _process_start(pid)
    return started is None or (doc.get("pid_start") is not None and started != doc.get("pid_start"))


def lease_path(store: str, scope: str) -> str:
    if not isinstance(scope, str) or not _NAME.fullmatch(scope):
        raise LeaseError(f"lease scope {scope!r}: expected a host class name (letters, digits, '.', '_', '-')")
    return os.path.join(store, LEASE_DIR, f"{scope}.json")


def store_id(store: str) -> str:
    """The identity of a profile store (``<store>/.leases/store-id``, made once by the first run).

    A host lease names the store of its run: a run that finds a host held by a run of its own
    store can ask that store whether the holder still runs (it holds its class lease).
    """
    path = os.path.join(store, LEASE_DIR, STORE_ID)
    for _attempt in range(3):
        try:
            with open(path, encoding="ascii") as fh:
                found = fh.read().strip()
            if re.match(r"^[0-9a-f]{32}$", found):
                return found
            raise LeaseError(f"{path}: not a store id ({found[:40]!r}); remove it once no controller runs")
        except FileNotFoundError:
            pass
        except (OSError, UnicodeDecodeError) as exc:
            raise LeaseError(f"{path}: cannot read the store id: {getattr(exc, 'strerror', None) or exc}") from None
        tmp = _temporary(path, uuid.uuid4().hex)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another controller made it first: read theirs
        except OSError as exc:
            raise LeaseError(f"{path}: cannot write the store id: {exc.strerror or exc}") from None
        finally:
            os.unlink(tmp)
    raise LeaseError(f"{path}: cannot read the store id")


def run_ended(store: str, holder: t.Mapping[str, t.Any], own_store_id: str) -> bool:
    """The run that holds a host lease was one of this store's and no longer holds its class lease.

    A run holds its class lease from its start to its report; a run of this store whose class
    lease is gone (released at its end, or taken over), expired, or left by a controller that no
    longer runs on this machine changes no host any more, even when it could not release the
    host's lease (the host was unreachable at its end, or the controller was killed).
    """
    scope = holder.get("host_class")
    if holder.get("store_id") != own_store_id or not isinstance(scope, str) or not _NAME.fullmatch(scope):
        return False
    held = read(lease_path(store, scope))
    # its class lease gone, another run's, expired, or left by a controller that no longer runs here
    return (held is None or held.get("run_id") != holder.get("run_id") or float(held["expires"]) <= time.time()
            or holder_gone(held))


def _when(stamp: t.Any) -> str:
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(stamp)))
    except (TypeError, ValueError, OverflowError):
        return "an unknown time"


def describe(doc: t.Mapping[str, t.Any]) -> str:
    """The holder in words: who, which run, since when, until when."""
    extra = [f"{k} {doc[k]}" for k in ("awx_job_id", "limit") if doc.get(k)]
    return (f"{doc.get('purpose', 'a run')} run {doc.get('run_id', '?')} of {doc.get('owner', 'an unknown owner')}, "
            f"started {_when(doc.get('started'))}, expires {_when(doc.get('expires'))}"
            + (f" ({', '.join(extra)})" if extra else ""))


def read(path: str) -> dict[str, t.Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LeaseError(f"{path}: cannot read the lease: {exc.strerror or exc}") from None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not a lease document")
        float(doc["expires"])
        str(doc["run_id"])
    except (ValueError, KeyError, TypeError) as exc:
        # never taken over silently: a person looks at it (or deletes it)
        raise LeaseError(f"{path}: the lease cannot be read ({exc}); remove it once no controller runs on this class") from None
    return doc


def _temporary(path: str, doc: t.Mapping[str, t.Any] | str) -> str:
    """``doc`` (a lease, as JSON; or a line of text) written whole and synced to a temporary file beside ``path``; its name."""
    directory = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".lease.", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if isinstance(doc, str):
                fh.write(doc)
            else:
                json.dump(dict(doc), fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        # a full disk leaves no half-written lease behind
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise LeaseError(f"{path}: cannot write the lease: {exc.strerror or exc}") from None
    return tmp


def _write_new(path: str, doc: t.Mapping[str, t.Any]) -> bool:
    """Create ``path`` with ``doc`` if it does not exist (atomically, whole); False if it exists."""
    tmp = _temporary(path, doc)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        raise LeaseError(f"{path}: cannot write the lease: {exc.strerror or exc}") from None
    finally:
        os.unlink(tmp)


def _replace(path: str, doc: t.Mapping[str, t.Any]) -> None:
    tmp = _temporary(path, doc)
    try:
        os.replace(tmp, path)
    except OSError as exc:
        os.unlink(tmp)
        raise LeaseError(f"{path}: cannot write the lease: {exc.strerror or exc}") from None


def check_inputs(ttl: t.Any, wait: t.Any) -> tuple[int, int]:
    try:
        ttl_s, wait_s = int(ttl), int(wait)
    except (TypeError, ValueError):
        raise LeaseError(f"gpufleet_lease_ttl and gpufleet_lease_wait must be whole seconds, got {ttl!r} and {wait!r}") from None
    if not MIN_TTL <= ttl_s <= MAX_TTL:
        raise LeaseError(f"gpufleet_lease_ttl: {ttl_s} s is outside {MIN_TTL}..{MAX_TTL} s")
    if not 0 <= wait_s <= MAX_WAIT:
        raise LeaseError(f"gpufleet_lease_wait: {wait_s} s is outside 0..{MAX_WAIT} s")
    return ttl_s, wait_s


def _subject(scope: str) -> str:
    return "this host" if scope == HOST_SCOPE else f"host class {scope}"


def acquire(store: str, scope: str, run_id: str, ttl: int, wait: int = 0, purpose: str = "rollout",
            owner: str | None = None, details: t.Mapping[str, t.Any] | None = None,
            clock: t.Callable[[], float] = time.time, sleep: t.Callable[[float], None] = time.sleep,
            poll: float = 5.0, process: t.Mapping[str, t.Any] | None = None,
            superseded: t.Collection[str] = ()) -> dict[str, t.Any]:
    """Take the lease of ``scope``; the result names it and any expired lease taken over.

    Taking a lease this run holds already renews it. ``process`` is the controller that holds
    the lease (this process's parent when not given: the action plugin runs in a worker of
    ``ansible-playbook``); a lease of a run in ``superseded`` counts as expired.
    """
    path = lease_path(store, scope)
    deadline = clock() + wait
    holder_process = dict(process) if process is not None else controller_process()
    while True:
        now = clock()
        doc = {"format": FORMAT, "scope": scope, "run_id": run_id, "owner": owner or default_owner(), "purpose": purpose,
               "started": now, "renewed": now, "expires": now + ttl, **holder_process, **dict(details or {})}
        if _write_new(path, doc):
            return {"lease": doc, "path": path, "taken_over": None, "renewed": False}
        held = read(path)
        if held is None:
            continue  # released between the link and the read: try again
        if held.get("run_id") == run_id:
            doc["started"] = held.get("started", now)
            _replace(path, doc)
            return {"lease": doc, "path": path, "taken_over": None, "renewed": True}
        if float(held["expires"]) <= now or holder_gone(held) or held.get("run_id") in superseded:
            aside = f"{path}.expired-{run_id}"
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue  # another run took it over first: read it again
            except OSError as exc:
                raise LeaseError(f"{path}: cannot take over the expired lease: {exc.strerror or exc}") from None
            stale = read(aside) or held
            if _write_new(path, doc):
                os.unlink(aside)
                return {"lease": doc, "path": path, "taken_over": stale, "renewed": False}
            os.unlink(aside)
            continue
        if clock() >= deadline:
            skew = now - float(held.get("renewed", held.get("started", now)))
            note = f" (its last renewal is {-skew:.0f} s in this clock's future: compare the clocks)" if skew < -60 else ""
            waited = f" after waiting {wait} s" if wait else ""
            touching = "it" if scope == HOST_SCOPE else "any host"
            raise LeaseHeld(f"{_subject(scope)} is being changed by {describe(held)}{note}; this run stops{waited} "
                            f"before touching {touching} (gpufleet_lease_wait makes it wait; {path} is the lease)", held)
        sleep(min(poll, max(0.0, deadline - clock())))


def renew(store: str, scope: str, run_id: str, ttl: int, clock: t.Callable[[], float] = time.time) -> dict[str, t.Any]:
    """Push the expiry of this run's lease on; a lease this run lost (taken over) is an error."""
    path = lease_path(store, scope)
    held = read(path)
    if held is None or held.get("run_id") != run_id:
        raise LeaseError(f"{_subject(scope)}: this run ({run_id}) no longer holds its lease"
                         + (f"; {describe(held)} does" if held else " (it was removed)")
                         + ": stop, and look at who changes " + ("it" if scope == HOST_SCOPE else "the class"))
    now = clock()
    doc = dict(held, renewed=now, expires=now + ttl)
    _replace(path, doc)
    return {"lease": doc, "path": path, "taken_over": None, "renewed": True}


def release(store: str, scope: str, run_id: str) -> dict[str, t.Any]:
    """Remove this run's lease; one held by another run is left as it is."""
    path = lease_path(store, scope)
    held = read(path)
    if held is None or held.get("run_id") != run_id:
        return {"released": False, "path": path, "holder": held}
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise LeaseError(f"{path}: cannot remove the lease: {exc.strerror or exc}") from None
    return {"released": True, "path": path, "holder": None}


def plain_details(details: t.Mapping[t.Any, t.Any]) -> dict[str, t.Any]:
    """The plain, non-empty values of ``details``: what a lease may name besides its own fields."""
    return {str(k): v for k, v in details.items() if isinstance(v, (str, int, float, bool)) and v != ""}


def apply(directory: str, scopes: t.Sequence[str], args: t.Mapping[str, t.Any], check_mode: bool = False,
          process: t.Mapping[str, t.Any] | None = None) -> dict[str, t.Any]:
    """``args`` (ARGUMENT_SPEC, validated) applied to the leases ``scopes`` under ``directory``.

    Scopes are taken in name order, all or none: two runs that want overlapping scopes never
    hold one each and wait on the other. The result: changed, leases, taken_over (each with
    a sentence for the report), released, and in check mode ``held_by`` (leases of others).
    """
    ttl, wait = check_inputs(args["ttl"], args["wait"])
    scopes = sorted(set(scopes))
    for scope in scopes:
        lease_path(directory, scope)
    run_id = args["run_id"]
    # it names the file an expired lease is moved aside to
    if not isinstance(run_id, str) or not _NAME.fullmatch(run_id):
        raise LeaseError(f"run_id {run_id!r}: expected letters, digits, '.', '_' and '-' (at most 128, starting with a letter "
                         "or digit)")
    if check_mode:
        held_by = []
        for scope in scopes:
            held = read(lease_path(directory, scope))
            if held is not None and held.get("run_id") != run_id:
                held_by.append({"scope": scope, "holder": held, "msg": f"{_subject(scope)} is being changed by {describe(held)}"})
        return {"changed": args["state"] != "absent", "leases": [], "taken_over": [], "released": [], "held_by": held_by,
                "msg": "check mode: no lease taken, renewed or released"}
    if args["state"] == "absent":
        released = [s for s in scopes if release(directory, s, run_id)["released"]]
        return {"changed": bool(released), "released": released, "leases": [], "taken_over": []}
    if args["state"] == "renewed":
        leases = [renew(directory, s, run_id, ttl)["lease"] for s in scopes]
        return {"changed": True, "leases": leases, "taken_over": [], "released": []}
    taken: list[dict[str, t.Any]] = []
    leases = []
    superseded = [str(r) for r in args.get("superseded") or []]
    try:
        for scope in scopes:
            got = acquire(directory, scope, run_id, ttl, wait=wait, purpose=args["purpose"],
                          details=plain_details(args.get("details") or {}), process=process, superseded=superseded,
                          owner=args.get("owner") or None)
            leases.append(got["lease"])
            stale = got["taken_over"]
            if stale is not None:
                why = ("its controller no longer runs on this machine" if holder_gone(stale)
                       else "its run no longer holds its class lease" if stale.get("run_id") in superseded
                       else "expired: its controller stopped without releasing it")
                taken.append({"scope": scope, "holder": stale,
                              "msg": f"{_subject(scope)}: took over the lease of {describe(stale)} ({why})"})
    except LeaseError:
        for lease in leases:  # all or none
            release(directory, lease["scope"], run_id)
        raise
    return {"changed": True, "leases": leases, "taken_over": taken, "released": []}
