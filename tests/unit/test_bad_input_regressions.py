# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""One regression test per class of bad-input defect: the canary's log file and API key,
the profile store, sizes and numbers, values that used to give a silent wrong result, and
the secret-option rule. (The unit and environment file quoting is tested through systemd in
tests/unit/roles/test_vllm_service_quoting.py and tests/integration/test_unit_quoting.py.)"""

from __future__ import annotations

import datetime
import os
import resource
import time

import pytest
import yaml

from ansible_collections.gpufleet.vllm.plugins.filter.kv import FilterModule as KvFilters
from ansible_collections.gpufleet.vllm.plugins.filter.serve import FilterModule as ServeFilters
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _canary, _serve_argv
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import SizeError, parse_size
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import PlanError, plan_class
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._profile_store import ProfileStore, ProfileStoreError
from ansible_collections.gpufleet.vllm.tests.unit.plugins.module_utils.test_vllm_engine import spec_for, write_fake_vllm

F = {**KvFilters().filters(), **ServeFilters().filters()}
GIB = 1 << 30
KEY = {"model": "m", "vllm_version": "0.32.0"}
PROFILE = {"ranks": [{"rank": 0, "free_bytes": 42 * GIB, "kv_bytes": 30 * GIB}], "total_bytes": 141 * GIB}


@pytest.fixture
def fake_vllm(tmp_path):
    return write_fake_vllm(tmp_path)


# ------------------------------------------------------------------ the canary


def test_canary_log_never_follows_a_planted_link(tmp_path, fake_vllm):
    """A link at log_path, or at the old predictable partial path, must not be written through."""
    logs = tmp_path / "logs"
    logs.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    log_path = logs / "canary.log"
    os.symlink(victim, log_path)
    for pid in range(os.getpid(), os.getpid() + 3):
        os.symlink(victim, f"{log_path}.{pid}.partial")
    result = _canary.run_canary(spec_for(fake_vllm, log_path=str(log_path), env={"FAKE_ENGINE": "serving"}))
    assert result["health"] == "healthy"
    assert victim.read_text() == "precious\n"
    assert log_path.is_file() and not log_path.is_symlink()
    assert "Explicitly set" in log_path.read_text()
    # the old link is kept as .previous (renamed, never followed); no private directory is left
    assert os.path.islink(f"{log_path}.previous")
    assert not [p for p in os.listdir(logs) if p.startswith(".vllm-canary-")]


def test_canary_api_key_goes_in_the_environment_not_argv():
    spec = spec_for("/opt/vllm/bin/vllm", serve_args={"api_key": "k-secret", "max_model_len": 64})
    argv = _canary.canary_argv(spec, 8000)
    assert "k-secret" not in argv and "--api-key" not in argv
    assert "--max-model-len" in argv
    assert _canary.canary_env(spec, base={})["VLLM_API_KEY"] == "k-secret"


# ------------------------------------------------------------------ the profile store


@pytest.fixture
def store(tmp_path):
    return ProfileStore(str(tmp_path / "store"))


def test_store_non_utf8_file_does_not_hide_the_others(store):
    good = store.record({"host_class": "c", "compat": KEY, "profile": PROFILE})
    bad = os.path.join(os.path.dirname(good["path"]), "c--x--20991231T000000000000Z--00000000.yml")
    with open(bad, "wb") as handle:
        handle.write(b"format: 2\nnote: \xff\xfe\n")
    answer = store.query("c", KEY)
    assert answer["status"] == "found" and answer["profile"]["path"] == good["path"]
    assert "not UTF-8" in answer["corrupt"][0]["error"]


@pytest.mark.parametrize("edit", [
    lambda d: d["profile"]["ranks"][0].update(kv_bytes=40 * GIB),
    lambda d: d.update(recorded_at="2026-01-01T00:00:00.000000Z"),
])
def test_store_edited_content_is_not_trusted(store, edit):
    rec = store.record({"host_class": "c", "compat": KEY, "profile": PROFILE})
    body = yaml.safe_load(open(rec["path"], encoding="utf-8"))
    edit(body)
    with open(rec["path"], "w", encoding="utf-8") as handle:
        yaml.safe_dump(body, handle)
    answer = store.query("c", KEY)
    assert answer["status"] == "missing"
    assert "record_hash does not match" in answer["corrupt"][0]["error"]


def test_store_future_record_is_not_trusted(tmp_path):
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=365)
    ProfileStore(str(tmp_path / "s"), clock=lambda: later).record({"host_class": "c", "compat": KEY, "profile": PROFILE})
    answer = ProfileStore(str(tmp_path / "s")).query("c", KEY)
    assert answer["status"] == "missing" and "in the future" in answer["corrupt"][0]["error"]


def test_store_record_without_ranks_is_refused_and_never_hides_a_good_one(store):
    with pytest.raises(ProfileStoreError, match="profile.ranks"):
        store.record({"host_class": "c", "compat": KEY, "profile": {"total_bytes": 1}})
    good = store.record({"host_class": "c", "compat": KEY, "profile": PROFILE})
    # a newer file without ranks, written by hand with a valid hash, is reported, not returned
    body = yaml.safe_load(open(good["path"], encoding="utf-8"))
    body["profile"] = {"total_bytes": 1}
    body["recorded_at"] = "2026-12-01T00:00:00.000000Z"
    from ansible_collections.gpufleet.vllm.plugins.plugin_utils._profile_store import record_hash  # pylint: disable=import-outside-toplevel

    body["record_hash"] = record_hash(body)
    newer = os.path.join(os.path.dirname(good["path"]), "c--n--20261201T000000000000Z--11111111.yml")
    with open(newer, "w", encoding="utf-8") as handle:
        yaml.safe_dump(body, handle)
    answer = store.query("c", KEY)
    assert answer["profile"]["path"] == good["path"]
    assert "has no ranks" in answer["corrupt"][0]["error"]


def test_store_alias_bomb_is_cheap_and_reported(store):
    good = store.record({"host_class": "c", "compat": KEY, "profile": PROFILE})
    bomb = "a: &a [" + ",".join(["x"] * 9) + "]\n"
    for i in range(1, 9):
        bomb += f"{chr(97 + i)}: &{chr(97 + i)} [" + ",".join([f"*{chr(96 + i)}"] * 9) + "]\n"
    path = os.path.join(os.path.dirname(good["path"]), "c--b--20991231T000000000000Z--22222222.yml")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(bomb)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    answer = store.query("c", KEY)
    assert time.process_time() - start < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024  # KiB
    assert answer["status"] == "found" and "aliases are not allowed" in answer["corrupt"][0]["error"]


def test_store_class_name_with_a_trailing_newline_creates_nothing(store):
    with pytest.raises(ProfileStoreError, match="host_class"):
        store.record({"host_class": "c\n", "compat": KEY, "profile": PROFILE})
    assert not os.path.exists(store.path) or all("\n" not in n for n in os.listdir(store.path))


def test_store_symlinks_are_not_followed(store, tmp_path):
    good = store.record({"host_class": "c", "compat": KEY, "profile": PROFILE})
    outside = tmp_path / "outside.yml"
    outside.write_text(open(good["path"], encoding="utf-8").read())
    link = os.path.join(os.path.dirname(good["path"]), "c--l--20991231T000000000000Z--33333333.yml")
    os.symlink(outside, link)
    answer = store.query("c", KEY)
    assert answer["profile"]["path"] == good["path"]
    assert "symlink" in [c for c in answer["corrupt"] if c["path"] == link][0]["error"]
    # a class directory that is a link is refused as a whole
    os.symlink(os.path.dirname(good["path"]), os.path.join(store.path, "d"))
    with pytest.raises(ProfileStoreError, match="symlink"):
        store.query("d", KEY)


def test_store_temporaries_of_interrupted_writes_are_removed(store):
    good = store.record({"host_class": "c", "compat": KEY, "profile": PROFILE})
    stale = os.path.join(os.path.dirname(good["path"]), ".tmp-abandoned.yml")
    with open(stale, "w", encoding="utf-8") as handle:
        handle.write("half")
    store.record({"host_class": "c", "compat": KEY, "profile": PROFILE})
    assert not os.path.exists(stale)


def test_store_format_1_files_are_reported(store):
    good = store.record({"host_class": "c", "compat": KEY, "profile": PROFILE})
    body = yaml.safe_load(open(good["path"], encoding="utf-8"))
    body["format"] = 1
    del body["record_hash"]
    with open(good["path"], "w", encoding="utf-8") as handle:
        yaml.safe_dump(body, handle)
    answer = store.query("c", KEY)
    assert answer["status"] == "missing" and "format 1 has no record_hash" in answer["corrupt"][0]["error"]


# ------------------------------------------------------------------ sizes and numbers


def test_huge_exponents_are_refused_at_once():
    start = time.process_time()
    for text in ("1e999999", "1e400"):
        with pytest.raises(SizeError, match="exponent out of range"):
            parse_size(text, "guard")
    assert time.process_time() - start < 0.5


def plan_spec(**over):
    spec = {"host_class": "h200",
            "reference": {"ranks": [{"rank": 0, "free_bytes": 42 * GIB, "kv_bytes": 30 * GIB}], "total_bytes": 141 * GIB,
                          "bytes_per_block": 2097152},
            "hosts": {"a": [{"rank": 0, "boot_free_bytes": 41 * GIB}]}, "guard_bytes": GIB // 2, "max_model_len": 8192}
    spec.update(over)
    return spec


@pytest.mark.parametrize("key, value", [("fit_headroom", float("inf")), ("unstable_share", float("nan")),
                                        ("max_capacity_loss", "inf")])
def test_non_finite_numbers_are_refused(key, value):
    with pytest.raises(PlanError, match=f"{key}: must be a finite number"):
        plan_class(plan_spec(**{key: value}))


def test_port_70000_is_refused_not_wrapped():
    with pytest.raises(_serve_argv.EngineSpecError, match="port: must be an integer in 1..65535, got 70000"):
        _serve_argv.build_argv("/v", "m", mode="profiled", port=70000)


# ------------------------------------------------------------------ silent wrong results


def test_free_above_total_is_refused():
    ref = dict(plan_spec()["reference"], total_bytes=40 * GIB)
    with pytest.raises(PlanError, match="free memory cannot exceed the GPU's total"):
        plan_class(plan_spec(reference=ref))


def test_block_size_zero_is_refused_not_sixteen():
    ref = dict(plan_spec()["reference"], block_size=0)
    with pytest.raises(PlanError, match="reference.block_size must be positive, got 0"):
        plan_class(plan_spec(reference=ref))


def test_unstable_y_counts_as_unstable_and_maybe_is_an_error():
    hosts = {"a": [{"rank": 0, "boot_free_bytes": 41 * GIB, "unstable": "y"}]}
    assert plan_class(plan_spec(hosts=hosts))["decision"] == "auto_profile"
    hosts["a"][0]["unstable"] = "maybe"
    with pytest.raises(PlanError, match=r"hosts.a\[0\].unstable: expected a boolean"):
        plan_class(plan_spec(hosts=hosts))


def test_free_min_above_free_max_is_refused():
    hosts = {"a": [{"rank": 0, "boot_free_bytes": 41 * GIB, "free_min_bytes": 41 * GIB, "free_max_bytes": 40 * GIB}]}
    with pytest.raises(PlanError, match="free_min_bytes .* is above free_max_bytes"):
        plan_class(plan_spec(hosts=hosts))


def test_instances_sharing_a_gpu_or_names_are_refused():
    base = {"vllm_service_plan": {"decision": "auto_profile"}, "vllm_service_model": "/m",
            "vllm_service_executable": "/v", "vllm_service_home": "/h", "vllm_service_state_dir": "/s",
            "vllm_service_unit_dir": "/u", "vllm_service_user": "vllm", "vllm_service_group": "vllm",
            "vllm_service_listen_host": "0.0.0.0"}
    shared = F["vllm_service_problems"](dict(base, vllm_service_instances=[
        {"name": "a", "gpus": [0, 1], "port": 8000}, {"name": "b", "gpus": [1], "port": 8001}]))
    assert any("GPU 1 is also used by vllm_service_instances[0]" in p for p in shared), shared
    twice = F["vllm_service_problems"](dict(base, vllm_service_instances=[
        {"name": "a", "gpus": [0, 0], "port": 8000}, {"name": "a", "gpus": [2], "port": 8000}]))
    assert any("GPU 0 is listed twice" in p for p in twice)
    assert any("names: a appear(s) more than once" in p for p in twice)
    assert any("ports: 8000 appear(s) more than once" in p for p in twice)


def test_human_bytes_exact_no_is_not_exact():
    assert F["human_bytes"](30333206529, 2, "no") == "28.25GiB"
    assert F["human_bytes"](30333206529, 2, "yes") == "30333206529"
    with pytest.raises(Exception, match="human_bytes exact: expected a boolean"):
        F["human_bytes"](1, 2, "perhaps")


def test_negative_head_dim_is_an_error():
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "head_dim": -8, "torch_dtype": "bfloat16"}
    with pytest.raises(Exception, match="head_dim must be a positive integer, got -8"):
        F["kv_bytes_per_token"](config)


def test_non_ascii_unit_name_is_refused():
    # pylint: disable-next=import-outside-toplevel
    from ansible_collections.gpufleet.vllm.plugins.module_utils._units._unit_files import UnitFilesError, validate_name

    with pytest.raises(UnitFilesError, match="instance name"):
        validate_name("v\u0131llm")


# ------------------------------------------------------------------ secrets


@pytest.mark.parametrize("key", ["apikey", "api_key", "--api-key", "API_KEY", "hf_token", "client_secret"])
def test_one_secret_rule_for_the_filter_and_the_canary(key):
    assert F["vllm_secret_options"]({key: "x", "max_num_batched_tokens": 1}) == [key]
    assert _serve_argv.redact_argv(["vllm", "--" + key.lstrip("-"), "s3cret"])[-1] == "********"


@pytest.mark.parametrize("instances, message", [
    ([{"name": "a", "gpus": [0, 0]}], "GPU 0 is listed twice"),
    ([{"name": "a", "gpus": [0]}, {"name": "a", "gpus": [1]}], "instance a appears twice"),
    ([{"name": "a", "gpus": [0, 1]}, {"name": "b", "gpus": [1]}], "GPU 1 is used by instances a and b"),
    ([{"name": "caf\u00e9", "gpus": [0]}], "gpufleet_instances name"),
])
def test_kv_plan_hosts_from_refuses_duplicates_and_shared_gpus(instances, message):
    from ansible.errors import AnsibleActionFail  # pylint: disable=import-outside-toplevel

    from ansible_collections.gpufleet.vllm.plugins.action.kv_plan import members_from_group  # pylint: disable=import-outside-toplevel

    gpus = [{"index": i, "free_bytes": GIB, "boot_free_bytes": GIB} for i in range(2)]
    task_vars = {"groups": {"c": ["h"]}, "hostvars": {"h": {"gpufleet_gpus": gpus, "gpufleet_instances": instances}}}
    with pytest.raises(AnsibleActionFail, match=message):
        members_from_group("c", task_vars)
