# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vllm_service unit and secret environment file, read by systemd itself.

A unit full of awkward but legal values (spaces, both quotes, ``$``, ``%`` specifiers,
backslashes, shell metacharacters, ``#``, non-ASCII; tests/tools/unit_render.py) is
rendered by ansible-playbook and started by the real systemd of a test host. Its
program is a small script that writes the argv and environment it was started with, so
the test compares what the process received, word by word and variable by variable, with
what the role was given. ``systemctl show`` confirms that systemd loaded exactly one
ExecStart and no ExecStartPre, and ``systemd-analyze verify`` on the host accepts the unit.
One host, booted once for the module.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))

import unit_render  # noqa: E402  pylint: disable=wrong-import-position,import-error

HOST = "it-quoting-a"
GUEST_DIR = "/srv/quoting"
DUMP = """#!/usr/bin/python3
import json, os, sys
with open("/var/lib/vllm/dump.json.tmp", "w", encoding="utf-8") as handle:
    json.dump({"argv": sys.argv, "env": dict(os.environ)}, handle)
os.rename("/var/lib/vllm/dump.json.tmp", "/var/lib/vllm/dump.json")
"""
SETUP = f"""set -e
mkdir -p /var/lib/vllm /etc/gpufleet
rm -f /var/lib/vllm/dump.json
cp {GUEST_DIR}/render/hostile.service /etc/systemd/system/vllm-q.service
install -m 0600 {GUEST_DIR}/render/hostile.env /etc/gpufleet/vllm-q.env
systemctl daemon-reload
systemd-analyze verify /etc/systemd/system/vllm-q.service
systemctl start vllm-q.service
for i in $(seq 1 100); do [ -e /var/lib/vllm/dump.json ] && break; sleep 0.1; done
"""


@pytest.fixture(scope="module")
def started(test_hosts, tmp_path_factory):
    shared = tmp_path_factory.mktemp("quoting")
    (shared / "bin").mkdir()
    program = shared / "bin" / "vllm"
    program.write_text(DUMP)
    program.chmod(0o755)
    case = unit_render.hostile_case(f"{GUEST_DIR}/bin/vllm", user="root", group="root")
    rendered = unit_render.render({"hostile": case}, shared / "render")["hostile"]
    assert "unit" in rendered, rendered
    th = test_hosts([HOST], binds_ro=[f"{shared}:{GUEST_DIR}"])
    setup = th.harness.exec(HOST, ["sh", "-c", SETUP])
    show = th.harness.exec(HOST, ["systemctl", "show", "-p", "ExecStart", "-p", "ExecStartPre", "-p", "Result",
                                  "vllm-q.service"])
    dump = th.harness.exec(HOST, ["cat", "/var/lib/vllm/dump.json"])
    return case, setup, show, dump


def test_systemd_on_the_host_accepts_the_unit(started):
    _case, setup, _show, _dump = started
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert "vllm-q.service" not in setup.stderr, setup.stderr


def test_systemd_loaded_one_exec_start_and_no_exec_start_pre(started):
    _case, _setup, show, _dump = started
    props = dict(line.split("=", 1) for line in show.stdout.splitlines() if "=" in line)
    # systemctl prints an exec property only when the unit has such a command
    assert props.get("ExecStartPre", "") == "", props
    assert props["ExecStart"].count("argv[]=") == 1, props
    assert props["Result"] == "success", props


def test_the_program_gets_exactly_the_words(started):
    case, _setup, _show, dump = started
    assert dump.returncode == 0, dump.stderr
    argv = json.loads(dump.stdout)["argv"]
    assert argv[0] == f"{GUEST_DIR}/bin/vllm"
    assert argv[1:] == unit_render.expected_words(case)


def test_the_program_gets_exactly_the_environment(started):
    case, _setup, _show, dump = started
    env = json.loads(dump.stdout)["env"]
    for name, value in {**case["vllm_service_env"], **case["vllm_service_secret_env"]}.items():
        assert env.get(name) == value, name
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["HOME"] == "/var/lib/vllm"
