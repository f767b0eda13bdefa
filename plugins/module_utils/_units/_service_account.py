# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The unprivileged account vLLM runs as: group, user and home in one call, and the model check.

vLLM and its canaries run as a system user with a home of its own (mode 0750) where the
engine keeps its caches. Three tasks (group, user, home) cost three round trips on every
host's first deploy, inside its serial batch; here they are one, and the check that this
user can read every file of the model (a file it cannot read fails only in a worker, with
a misleading FileNotFoundError) goes with them, once the user exists.

Plain Python with no Ansible import; ``groupadd``, ``useradd``, ``usermod`` and ``runuser``
run through the caller's runner (the module's ``run_command``). ``apply`` is the whole job,
for gpufleet.vllm.vllm_account and for gpufleet.vllm.vllm_unit's ``account`` option, which
creates the account in the same round trip as the units that run as it.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import typing as t

from .. import _validate as v
from ._unit_files import UnitFilesError, ensure_dir

__all__ = ["ARGUMENT_SPEC", "HOME_MODE", "SHELL", "AccountError", "apply", "check_model", "ensure", "ready", "unreadable"]

# The suboptions of vllm_unit's account, and the options of vllm_account (which adds state and user_optional).
ARGUMENT_SPEC: dict[str, t.Any] = {
    "user": {"type": "str", "required": True},
    "group": {"type": "str", "required": True},
    "home": {"type": "path", "required": True},
    "create": {"type": "bool", "default": True},
    "model": {"type": "path"},
}

HOME_MODE = 0o750
# a system account nobody logs in as
SHELL = "/usr/sbin/nologin"
# shells nobody logs in with: an account with one of them is a service's, whatever its uid
NO_LOGIN_SHELLS = frozenset((SHELL, "/sbin/nologin", "/bin/false", "/usr/bin/false", ""))
# how many unreadable paths a failure names
SHOWN_PATHS = 5

Runner = t.Callable[..., t.Tuple[int, str, str]]


class AccountError(ValueError):
    """Bad input, a command that failed or a model the user cannot read; the message says which."""


def _names(params: t.Mapping[str, t.Any]) -> tuple[str, str, str]:
    try:
        user = v.service_account_name(params["user"], "user")
        return user, v.account_name(params["group"], "group"), v.abs_path(params["home"], "home")
    except v.ValidationError as exc:
        raise AccountError(str(exc)) from None


def _first_login_uid(login_defs: str = "/etc/login.defs") -> int:
    """The first uid of the accounts people log in with (``UID_MIN``, 1000 unless login.defs says otherwise)."""
    try:
        with open(login_defs, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                words = line.split()
                if len(words) >= 2 and words[0] == "UID_MIN" and words[1].isdigit():
                    return int(words[1])
    except OSError:
        pass
    return 1000


def _run(runner: Runner, argv: list[str]) -> None:
    rc, out, err = runner(argv, cwd="/")
    if rc != 0:
        raise AccountError(f"{' '.join(argv)} failed (exit status {rc}): {(err or out).strip() or 'no message'}")


def _create(what: str, name: str, create: bool, changed: list[str], check: bool, runner: Runner, argv: list[str]) -> None:
    """A missing group or user: created (``argv``) unless ``check``; an error when creating it is off."""
    if not create:
        raise AccountError(f"the service {what} {name} does not exist, and creating it is off (create: false)")
    changed.append(what)
    if not check:
        _run(runner, argv)


def _user(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def _gid(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def ready(user: str, group: str, home: str, home_mode: int = HOME_MODE) -> bool:
    """The user and group exist and own the home directory with this mode (what ``ensure`` sets up)."""
    entry, gid = _user(user), _gid(group)
    if entry is None or gid is None:
        return False
    try:
        st = os.stat(home)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (entry.pw_uid, gid, home_mode)


def ensure(runner: Runner, user: str, group: str, home: str, *, create: bool, check: bool) -> list[str]:
    """Make the account what the units expect; the parts that changed (would, in ``check``): group, user, home.

    ``create`` false: the group and the user must exist already (an account managed elsewhere,
    a directory service); only the home is made theirs.
    """
    changed: list[str] = []
    gid = _gid(group)
    if gid is None:
        _create("group", group, create, changed, check, runner, ["groupadd", "--system", group])
        gid = _gid(group)
    entry = _user(user)
    if entry is None:
        _create("user", user, create, changed, check, runner,
                ["useradd", "--system", "--gid", group, "--shell", SHELL, "--home-dir", home, "--no-create-home", user])
        entry = _user(user)
    elif create and (entry.pw_gid != gid or entry.pw_dir != home or entry.pw_shell != SHELL):
        # a person's account (a typo of the user, or a login account named on purpose): usermod would take its
        # shell, group and home away
        if entry.pw_uid >= _first_login_uid() and entry.pw_shell not in NO_LOGIN_SHELLS:
            raise AccountError(f"the service user {user} exists as a login account (uid {entry.pw_uid}, shell {entry.pw_shell}): "
                               "its shell, group and home are left as they are; name a system account of its own for vLLM, "
                               "or manage this one elsewhere (create: false)")
        changed.append("user")
        if not check:
            _run(runner, ["usermod", "--gid", group, "--shell", SHELL, "--home", home, user])
            entry = _user(user)
    if entry is None or gid is None:
        if not check:
            # a name service that does not see a local account yet (nscd, sssd caching)
            raise AccountError(f"the service {'group ' + group if gid is None else 'user ' + user} was created "
                               "but is not found by name: the home is not made")
        # check mode: the account would be created first, and its home with it
        return [*changed, "home"]
    try:
        made_parents = _make_parents(home, check)
        if ensure_dir(home, entry.pw_uid, gid, HOME_MODE, check) or made_parents:
            changed.append("home")
    except (UnitFilesError, OSError) as exc:
        raise AccountError(f"home: {exc}") from None
    return changed


def _make_parents(path: str, check: bool) -> bool:
    """Create the missing parent directories of ``path`` (root, 0755 whatever the umask); True if one was missing."""
    missing = []
    parent = os.path.dirname(path.rstrip("/"))
    while parent not in ("", "/") and not os.path.isdir(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    if not check:
        for directory in reversed(missing):
            os.mkdir(directory, 0o755)
            os.chmod(directory, 0o755)  # mkdir's mode goes through the umask
    return bool(missing)


def unreadable(runner: Runner, user: str, model: str) -> list[str]:
    """What ``user`` cannot read under ``model`` (following links), or find's own errors; [] when all is readable."""
    rc, out, err = runner(["runuser", "-u", user, "--", "find", "-L", model, "!", "-readable", "-print"], cwd="/")
    if rc == 0:
        # what find printed; a warning on stderr (PAM, runuser) with exit status 0 is no finding
        return out.splitlines()
    return out.splitlines() + err.splitlines() or [f"find exited with status {rc}"]


def apply(params: t.Mapping[str, t.Any], runner: Runner, check: bool, *, read_only: bool = False) -> dict[str, t.Any]:
    """The account (``ensure``, unless ``read_only``) and then the model check (gpufleet.vllm.vllm_account's result).

    The model is checked once the user exists; it is left unchecked (``model_checked`` false) in
    check mode on a host that would only now get the user, and with ``user_optional`` where the
    user does not exist (a check ahead of the deploy that creates it).
    """
    user, group, home = _names(params)
    model = params.get("model")
    if model is not None:
        # any absolute path vllm serve takes (the role's own rule for a model), not only a normalised one
        try:
            model = v.text(model, "model")
        except v.ValidationError as exc:
            raise AccountError(str(exc)) from None
        if not model.startswith("/"):
            raise AccountError(f"model: must be an absolute path (a local model), got {model!r}")
    changed = [] if read_only else ensure(runner, user, group, home, create=params["create"], check=check)
    checked = False if check and "user" in changed and _user(user) is None else \
        check_model(runner, user, model, user_optional=params.get("user_optional", False))
    return {"changed": bool(changed), "account_changed": changed, "ready": ready(user, group, home),
            "model_checked": checked}


def check_model(runner: Runner, user: str, model: str | None, user_optional: bool = False) -> bool:
    """Raise when ``user`` cannot read ``model``; False when it was not checked (no model, or no user yet)."""
    if model is None:
        return False
    if _user(user) is None:
        if user_optional:
            return False
        raise AccountError(f"the service user {user} cannot read the model {model}: the user does not exist")
    problems = unreadable(runner, user, model)
    if problems:
        raise AccountError(f"the service user {user} cannot read the model {model}: {'; '.join(problems[:SHOWN_PATHS])} "
                           "(give the files to that user or make them readable; the engine would fail with FileNotFoundError)")
    return True
