# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The canary engine runs as the service's account (ids, groups, home), not as root."""

from __future__ import annotations

import os
import pwd
import time

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _engine_process, _serve_argv


def test_unknown_account_is_an_error_naming_it():
    with pytest.raises(_serve_argv.EngineSpecError, match=r"user: no account 'no-such-user-x' on this host"):
        _engine_process.Account.lookup("no-such-user-x")
    with pytest.raises(_serve_argv.EngineSpecError, match=r"group: no group 'no-such-group-x'"):
        _engine_process.Account.lookup("root", "no-such-group-x")


def test_account_lookup_gives_ids_groups_and_home():
    me = pwd.getpwuid(os.getuid())
    account = _engine_process.Account.lookup(me.pw_name)
    assert (account.uid, account.gid, account.home) == (me.pw_uid, me.pw_gid, me.pw_dir)
    assert me.pw_gid in account.groups


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
                    reason="changing to another account needs root (the canary module runs as root)")
def test_engine_process_runs_as_the_account(tmp_path):
    nobody = _engine_process.Account.lookup("nobody")
    out = tmp_path / "log"
    script = "import os; print(os.getuid(), os.getgid(), os.getcwd(), os.environ.get('HF_HOME'), flush=True)"
    proc = _engine_process.EngineProcess(["/usr/bin/python3", "-c", script], {"HF_HOME": "/srv/cache/hf", "PATH": os.environ.get("PATH", "")},
                                         str(out), nobody)
    proc.start()
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() == 0, out.read_text(encoding="utf-8")
    uid, gid, cwd, hf_home = out.read_text(encoding="utf-8").split()
    assert (int(uid), int(gid)) == (nobody.uid, nobody.gid) != (0, 0)
    assert cwd == (nobody.home if os.path.isdir(nobody.home) else "/")
    assert hf_home == "/srv/cache/hf"
