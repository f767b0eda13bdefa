# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""_service_account: the group, user and home vLLM runs as in one call, and the model check as that user.

The account database is a dict here (the commands a fake runner receives change it, as
groupadd, useradd and usermod would); the home is a real directory. useradd itself runs on
real hosts in the integration and molecule stages (a first deploy creates the account).
"""

from __future__ import annotations

import os
import pwd
import stat
import typing as t

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._units import _service_account as sa

UID, GID = os.getuid(), os.getgid()


class Accounts:
    """Users and groups, and a runner that changes them as the real commands would."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, unreadable: str = "", find_rc: int = 0) -> None:
        self.users: dict[str, pwd.struct_passwd] = {}
        self.groups: dict[str, int] = {}
        self.calls: list[list[str]] = []
        self.unreadable, self.find_rc, self.find_err = unreadable, find_rc, ""
        monkeypatch.setattr(sa, "_user", self.users.get)
        monkeypatch.setattr(sa, "_gid", self.groups.get)

    def add_user(self, name: str, group: str, home: str, shell: str = sa.SHELL) -> None:
        self.users[name] = pwd.struct_passwd((name, "x", UID, self.groups[group], "", home, shell))

    def __call__(self, argv: list[str], cwd: str | None = None) -> tuple[int, str, str]:
        assert cwd == "/", "every command runs from / (a service user cannot read root's working directory)"
        self.calls.append(argv)
        opts = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i] in ("--gid", "--shell", "--home-dir", "--home")}
        if argv[0] == "groupadd":
            self.groups[argv[-1]] = GID
        elif argv[0] == "useradd":
            self.add_user(argv[-1], opts["--gid"], opts["--home-dir"], opts["--shell"])
        elif argv[0] == "usermod":
            self.add_user(argv[-1], opts["--gid"], opts["--home"], opts["--shell"])
        elif argv[0] == "runuser":
            return self.find_rc, self.unreadable, self.find_err
        return 0, "", ""


def params(home: str, **extra: t.Any) -> dict[str, t.Any]:
    return {"user": "vllm", "group": "vllm", "home": home, "create": True, "model": None} | extra


def test_a_first_call_creates_group_user_and_home_and_a_second_changes_nothing(tmp_path, monkeypatch):
    accounts, home = Accounts(monkeypatch), tmp_path / "var" / "vllm"
    result = sa.apply(params(str(home)), accounts, check=False)
    assert result == {"changed": True, "account_changed": ["group", "user", "home"], "ready": True, "model_checked": False}
    assert accounts.calls == [
        ["groupadd", "--system", "vllm"],
        ["useradd", "--system", "--gid", "vllm", "--shell", "/usr/sbin/nologin", "--home-dir", str(home), "--no-create-home", "vllm"],
    ]
    st = os.stat(home)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UID, GID, 0o750)
    assert stat.S_IMODE(os.stat(home.parent).st_mode) == 0o755, "a missing parent is created 0755"
    assert stat.S_IMODE(os.stat(tmp_path / "var").st_mode) == 0o755
    accounts.calls.clear()
    again = sa.apply(params(str(home)), accounts, check=False)
    assert again == {"changed": False, "account_changed": [], "ready": True, "model_checked": False} and accounts.calls == []


def test_missing_parents_are_0755_whatever_the_umask(tmp_path, monkeypatch):
    accounts, home = Accounts(monkeypatch), tmp_path / "srv" / "engine" / "vllm"
    old = os.umask(0o077)
    try:
        assert sa.apply(params(str(home)), accounts, check=False)["account_changed"] == ["group", "user", "home"]
    finally:
        os.umask(old)
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in (home.parent.parent, home.parent, home)] == [0o755, 0o755, 0o750]


def test_an_account_the_name_service_does_not_see_after_useradd_is_an_error(tmp_path, monkeypatch):
    accounts = Accounts(monkeypatch)
    accounts.groups["vllm"] = GID

    def useradd_unseen(argv: list[str], cwd: str | None = None) -> tuple[int, str, str]:
        accounts.calls.append(argv)
        return 0, "", ""

    with pytest.raises(sa.AccountError, match=r"^the service user vllm was created but is not found by name: the home is not made$"):
        sa.apply(params(str(tmp_path / "vllm")), useradd_unseen, check=False)
    assert not (tmp_path / "vllm").exists()


def test_check_mode_says_what_would_change_and_does_nothing(tmp_path, monkeypatch):
    accounts, home = Accounts(monkeypatch), tmp_path / "vllm"
    result = sa.apply(params(str(home), model=str(tmp_path)), accounts, check=True)
    # the model is left for the call that creates the user
    assert result == {"changed": True, "account_changed": ["group", "user", "home"], "ready": False, "model_checked": False}
    assert accounts.calls == [] and not home.exists()


def test_a_home_with_another_mode_is_fixed_and_a_user_with_another_home_is_changed(tmp_path, monkeypatch):
    accounts, home = Accounts(monkeypatch), tmp_path / "vllm"
    home.mkdir(mode=0o777)
    accounts.groups["vllm"] = GID
    accounts.add_user("vllm", "vllm", "/home/vllm", "/bin/bash")
    assert sa.apply(params(str(home)), accounts, check=False)["account_changed"] == ["user", "home"]
    assert accounts.calls == [["usermod", "--gid", "vllm", "--shell", "/usr/sbin/nologin", "--home", str(home), "vllm"]]
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o750


def test_a_login_account_keeps_its_shell_group_and_home(tmp_path, monkeypatch):
    accounts, home = Accounts(monkeypatch), tmp_path / "vllm"
    monkeypatch.setattr(sa, "_first_login_uid", lambda: 1000)
    accounts.groups.update(vllm=GID, ubuntu=GID)
    accounts.users["ubuntu"] = pwd.struct_passwd(("ubuntu", "x", 1000, GID, "", "/home/ubuntu", "/bin/bash"))
    with pytest.raises(sa.AccountError, match=r"^the service user ubuntu exists as a login account \(uid 1000, shell /bin/bash\): its "
                                              r"shell, group and home are left as they are"):
        sa.apply(params(str(home), user="ubuntu"), accounts, check=False)
    assert accounts.calls == [] and not home.exists()
    # the same account managed elsewhere (create: false) only gets the home
    assert sa.apply(params(str(home), user="ubuntu", create=False), accounts, check=False)["account_changed"] == ["home"]
    assert accounts.calls == []
    # an account nobody logs in with (another distribution's nologin, false) is a service's: made the service user
    for shell in ("/sbin/nologin", "/bin/false"):
        accounts.users["svc"] = pwd.struct_passwd(("svc", "x", 1001, GID, "", "/home/svc", shell))
        accounts.calls.clear()
        assert sa.apply(params(str(home), user="svc"), accounts, check=False)["account_changed"][0] == "user"
        assert accounts.calls[0][0] == "usermod", accounts.calls


def test_the_first_login_uid_is_read_from_login_defs(tmp_path):
    defs = tmp_path / "login.defs"
    defs.write_text("# UID_MIN 5\nUID_MIN\t\t 2000\nUID_MAX 60000\n", encoding="utf-8")
    assert sa._first_login_uid(str(defs)) == 2000  # pylint: disable=protected-access
    assert sa._first_login_uid(str(tmp_path / "missing")) == 1000  # pylint: disable=protected-access


def test_without_create_the_account_must_exist_and_only_the_home_is_made(tmp_path, monkeypatch):
    accounts, home = Accounts(monkeypatch), tmp_path / "vllm"
    with pytest.raises(sa.AccountError, match=r"^the service group vllm does not exist, and creating it is off \(create: false\)$"):
        sa.apply(params(str(home), create=False), accounts, check=False)
    accounts.groups["vllm"] = GID
    with pytest.raises(sa.AccountError, match=r"^the service user vllm does not exist, and creating it is off"):
        sa.apply(params(str(home), create=False), accounts, check=False)
    # an account managed elsewhere keeps its shell and home directory entry
    accounts.add_user("vllm", "vllm", "/srv/elsewhere", "/bin/sh")
    assert sa.apply(params(str(home), create=False), accounts, check=False)["account_changed"] == ["home"]
    assert accounts.calls == [] and not home.is_symlink() and home.is_dir()


@pytest.mark.parametrize(("extra", "message"), [
    ({"user": "Vllm!"}, r"^user: 'Vllm!' is not a valid name: use lower-case ASCII"),
    ({"user": "root"}, r"^user: must not be root; vLLM runs as an unprivileged system user"),
    ({"group": "vllm\n"}, r"^group: "),
    ({"home": "var/lib/vllm"}, r"^home: must be an absolute path"),
    ({"model": "models/x"}, r"^model: must be an absolute path"),
])
def test_bad_input_is_refused_by_field_before_any_command(tmp_path, monkeypatch, extra, message):
    accounts = Accounts(monkeypatch)
    with pytest.raises(sa.AccountError, match=message):
        sa.apply(params(str(tmp_path / "vllm")) | extra, accounts, check=False)
    assert accounts.calls == []


def test_a_home_that_is_a_file_and_a_failing_command_are_errors_that_say_so(tmp_path, monkeypatch):
    accounts = Accounts(monkeypatch)
    accounts.groups["vllm"] = GID
    accounts.add_user("vllm", "vllm", str(tmp_path / "file"))
    (tmp_path / "file").write_text("")
    with pytest.raises(sa.AccountError, match=r"^home: .*/file: exists and is not a directory$"):
        sa.apply(params(str(tmp_path / "file")), accounts, check=False)

    def failing(argv: list[str], cwd: str | None = None) -> tuple[int, str, str]:
        return 9, "", "groupadd: cannot lock /etc/group; try again later.\n"

    monkeypatch.setattr(sa, "_gid", {}.get)
    with pytest.raises(sa.AccountError, match=r"^groupadd --system vllm failed \(exit status 9\): groupadd: cannot lock /etc/group"):
        sa.apply(params(str(tmp_path / "vllm")), failing, check=False)


def test_the_model_is_checked_as_the_user_and_unreadable_files_are_named(tmp_path, monkeypatch):
    files = "".join(f"/srv/m/shard-{i}.safetensors\n" for i in range(7))
    accounts, home = Accounts(monkeypatch, unreadable=files), str(tmp_path / "vllm")
    with pytest.raises(sa.AccountError) as exc:
        sa.apply(params(home, model="/srv/m"), accounts, check=False)
    assert str(exc.value) == (
        "the service user vllm cannot read the model /srv/m: " + "; ".join(f"/srv/m/shard-{i}.safetensors" for i in range(5))
        + " (give the files to that user or make them readable; the engine would fail with FileNotFoundError)")
    assert accounts.calls[-1] == ["runuser", "-u", "vllm", "--", "find", "-L", "/srv/m", "!", "-readable", "-print"]
    accounts.unreadable = ""
    assert sa.apply(params(home, model="/srv/m"), accounts, check=False)["model_checked"] is True
    # a warning on stderr with exit status 0 (PAM, runuser) is no finding
    accounts.find_err = "runuser: warning: cannot open session\n"
    assert sa.apply(params(home, model="/srv/m"), accounts, check=False)["model_checked"] is True
    accounts.find_err = ""
    # find failing without output (a model path that does not exist says so on stderr in real life)
    accounts.find_rc = 1
    with pytest.raises(sa.AccountError, match=r"cannot read the model /srv/m: find exited with status 1"):
        sa.apply(params(home, model="/srv/m"), accounts, check=False)


def test_a_read_only_check_creates_nothing_and_may_leave_a_missing_user_to_the_deploy(tmp_path, monkeypatch):
    accounts, home = Accounts(monkeypatch), str(tmp_path / "vllm")
    result = sa.apply(params(home, model="/srv/m", user_optional=True), accounts, check=False, read_only=True)
    assert result == {"changed": False, "account_changed": [], "ready": False, "model_checked": False}
    assert accounts.calls == [] and not os.path.exists(home)
    with pytest.raises(sa.AccountError, match=r"^the service user vllm cannot read the model /srv/m: the user does not exist$"):
        sa.apply(params(home, model="/srv/m"), accounts, check=False, read_only=True)
