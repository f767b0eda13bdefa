# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The first play of rollout.yml, plan.yml and profile.yml (plays/validate.yml) names a bad host setting, with the
host and the variable, before any host is probed: a real ansible-playbook run against hosts that cannot be reached
(TEST-NET addresses), which would fail differently, and later, had the check let the value through."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import typing as t

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _run(tmp_path: pathlib.Path, playbook: str, hosts: dict[str, dict[str, t.Any]], *extra: str) -> str:
    sys.path.insert(0, str(ROOT / "tests" / "examples"))
    import doc_examples  # pylint: disable=import-outside-toplevel,import-error

    common = {"gpufleet_host_class": "l40s", "gpufleet_model": "/srv/models/m", "gpufleet_profile_store": str(tmp_path / "store")}
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {name: {"ansible_host": f"192.0.2.{i}", **common, **own}
                                                           for i, (name, own) in enumerate(sorted(hosts.items()), start=1)}}}),
                         encoding="utf-8")
    env = doc_examples.ansible_env(doc_examples.make_collections_tree(tmp_path / "collections"))
    argv = [doc_examples._tool("ansible-playbook"), "-i", str(inventory), str(ROOT / "playbooks" / playbook), *extra]  # pylint: disable=protected-access
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    # nothing got past the first play: no host was probed
    assert "PLAY [Probe every target host]" not in out and "UNREACHABLE" not in out, out
    return out


@pytest.mark.parametrize("playbook", ["rollout.yml", "plan.yml"])
def test_a_size_with_a_wrong_unit_is_named_with_its_host(tmp_path: pathlib.Path, playbook: str) -> None:
    out = _run(tmp_path, playbook, {"gpu-1": {}, "gpu-2": {"gpufleet_guard": "0.5GiBs"}})
    assert "to_bytes: gpu-2: gpufleet_guard: invalid size '0.5GiBs': unknown unit 'GiBs'" in out, out
    assert "gpu-1: gpufleet_guard" not in out, out


def test_a_model_config_the_profiled_canary_could_not_read_stops_the_run_before_any_host(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "models" / "config.json"
    out = _run(tmp_path, "rollout.yml", {"gpu-1": {}, "gpu-2": {"gpufleet_model_config": str(missing)}})
    assert (f"class l40s: gpufleet_model_config: cannot read {missing}: No such file or directory (on gpu-2); "
            "no host was probed or touched") in out, out


@pytest.mark.parametrize("playbook", ["plan.yml", "profile.yml"])
def test_a_secret_in_the_serve_args_stops_the_run_before_any_canary_or_diff_holds_it(tmp_path: pathlib.Path, playbook: str) -> None:
    hosts = {"gpu-1": {"gpufleet_serve_args": {"hf_token": "hf-should-not-leak"}}}
    out = _run(tmp_path, playbook, hosts, "-e", "gpufleet_class=l40s")
    assert "class l40s: gpufleet_serve_args hf_token would put a secret on the unit's command line" in out, out
    assert "hf-should-not-leak" not in out, out
