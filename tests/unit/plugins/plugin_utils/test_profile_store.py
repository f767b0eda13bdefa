# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

import datetime
import os
import stat

import pytest
import yaml

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._compat import compat_key
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._profile_store import ProfileStore, ProfileStoreError

KEY = {"model": "tiny-llama", "vllm_version": "0.32.0", "gpu_name": "NVIDIA H200", "total_bytes": 150754820096}
DATA = {"ranks": [{"rank": 0, "free_bytes": 45097156608, "kv_bytes": 32212254720}], "vllm_free_bytes": {0: 44560285696}, "total_bytes": 150754820096}


class Clock:
    def __init__(self):
        self.now = datetime.datetime(2026, 11, 29, 21, 0, 0, tzinfo=datetime.timezone.utc)

    def __call__(self):
        self.now += datetime.timedelta(seconds=1)
        return self.now


@pytest.fixture
def store(tmp_path):
    return ProfileStore(str(tmp_path / "profiles"), clock=Clock())


def test_record_and_query_found(store):
    rec = store.record({"host_class": "h200", "compat": KEY, "profile": DATA})
    assert os.path.isfile(rec["path"])
    name = os.path.basename(rec["path"])
    assert name.startswith(f"h200--{compat_key(KEY).hash}--20261129T210001")
    assert name.endswith(".yml")
    assert stat.S_IMODE(os.stat(rec["path"]).st_mode) == 0o644
    on_disk = yaml.safe_load(open(rec["path"]))
    assert on_disk["profile"]["ranks"][0]["kv_bytes"] == 32212254720
    assert on_disk["key_hash"] == compat_key(KEY).hash
    answer = store.query("h200", KEY)
    assert answer["status"] == "found"
    assert answer["profile"]["path"] == rec["path"]
    assert answer["profile"]["profile"] == DATA
    assert answer["corrupt"] == []
    # no temporary files left behind
    assert [n for n in os.listdir(os.path.dirname(rec["path"])) if n.startswith(".tmp")] == []


def test_never_overwrites_and_keeps_history(store):
    first = store.record({"host_class": "h200", "compat": KEY, "profile": DATA})
    second = store.record({"host_class": "h200", "compat": KEY, "profile": dict(DATA, note="second")})
    assert first["path"] != second["path"]
    assert yaml.safe_load(open(first["path"]))["profile"] == DATA
    history = store.history("h200")
    assert [r["path"] for r in history] == [second["path"], first["path"]]
    assert store.query("h200", KEY)["profile"]["path"] == second["path"]


def test_same_timestamp_records_get_distinct_files(tmp_path):
    fixed = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    store = ProfileStore(str(tmp_path), clock=lambda: fixed)
    paths = {store.record({"host_class": "c", "compat": KEY, "profile": DATA})["path"] for _i in range(5)}
    assert len(paths) == 5


def test_mismatch_names_changed_fields(store):
    store.record({"host_class": "h200", "compat": KEY, "profile": DATA})
    newer = dict(KEY, vllm_version="0.33.0")
    store.record({"host_class": "h200", "compat": newer, "profile": DATA})
    asked = dict(KEY, vllm_version="0.34.0", kv_cache_dtype="fp8")
    answer = store.query("h200", asked)
    assert answer["status"] == "mismatch"
    assert answer["profile"]["compat"]["vllm_version"] == "0.33.0"
    assert answer["differences"] == [
        {"field": "kv_cache_dtype", "reference": None, "current": "fp8"},
        {"field": "vllm_version", "reference": "0.33.0", "current": "0.34.0"},
    ]
    # the older key is still found
    assert store.query("h200", KEY)["status"] == "found"


def test_missing_class(store):
    answer = store.query("nothing-here", KEY)
    assert answer == {"status": "missing", "profile": None, "differences": [], "key_hash": compat_key(KEY).hash, "corrupt": [], "count": 0}


def test_corrupt_file_is_reported_not_hiding_valid_ones(store):
    good = store.record({"host_class": "h200", "compat": KEY, "profile": DATA})
    directory = os.path.dirname(good["path"])
    bad = os.path.join(directory, f"h200--{compat_key(KEY).hash}--20991231T000000000000Z--deadbeef.yml")
    with open(bad, "w") as handle:
        handle.write("format: 1\nprofile: [unclosed\n")
    answer = store.query("h200", KEY)
    assert answer["status"] == "found"
    assert answer["profile"]["path"] == good["path"]
    assert len(answer["corrupt"]) == 1
    assert answer["corrupt"][0]["path"] == bad
    assert bad in answer["corrupt"][0]["error"] and "not valid YAML" in answer["corrupt"][0]["error"]
    # still there, untouched, and a new record does not replace it
    store.record({"host_class": "h200", "compat": KEY, "profile": DATA})
    assert open(bad).read() == "format: 1\nprofile: [unclosed\n"


@pytest.mark.parametrize(
    "mutate, why",
    [
        (lambda d: d.update(key_hash="0" * 16), "does not match its compat"),
        (lambda d: d.update(host_class="other"), "records host_class"),
        (lambda d: d.update(format=7), "unsupported format"),
        (lambda d: d.pop("profile"), "missing profile"),
    ],
)
def test_edited_files_are_not_trusted(store, mutate, why):
    rec = store.record({"host_class": "h200", "compat": KEY, "profile": DATA})
    body = yaml.safe_load(open(rec["path"]))
    mutate(body)
    with open(rec["path"], "w") as handle:
        yaml.safe_dump(body, handle)
    answer = store.query("h200", KEY)
    assert answer["status"] == "missing"
    assert why in answer["corrupt"][0]["error"]


def test_scalar_yaml_is_corrupt(store):
    rec = store.record({"host_class": "h200", "compat": KEY, "profile": DATA})
    with open(rec["path"], "w") as handle:
        handle.write("just a string\n")
    records, corrupt = store.scan("h200")
    assert records == []
    assert "expected a mapping" in corrupt[0]["error"]


@pytest.mark.parametrize(
    "profile, why",
    [
        ({"host_class": "../etc", "compat": KEY, "profile": DATA}, "host_class"),
        ({"host_class": "", "compat": KEY, "profile": DATA}, "host_class"),
        ({"host_class": "a", "profile": DATA}, "needs compat"),
        ({"host_class": "a", "compat": {}, "profile": DATA}, "compat is empty"),
        ({"host_class": "a", "compat": KEY, "profile": {}}, "non-empty"),
        ({"host_class": "a", "compat": {"total_bytes": "lots"}, "profile": DATA}, "total_bytes"),
    ],
)
def test_record_rejects_bad_input(store, profile, why):
    with pytest.raises(ProfileStoreError, match=why):
        store.record(profile)
    assert not os.path.exists(os.path.join(store.path, "a"))


def test_build_record_writes_nothing(store):
    rec = store.build_record({"host_class": "h200", "compat": KEY, "profile": DATA})
    assert rec["key_hash"] == compat_key(KEY).hash
    assert "path" not in rec
    assert not os.path.exists(store.path)
    assert "key_hash: " + rec["key_hash"] in store.dump(rec)


def test_lock_file_and_unwritable_store(tmp_path):
    store = ProfileStore(str(tmp_path / "s"))
    store.record({"host_class": "h200", "compat": KEY, "profile": DATA})
    assert os.path.isfile(os.path.join(store.path, ".lock"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ProfileStoreError, match="cannot create"):
        ProfileStore(str(blocker / "sub")).record({"host_class": "h200", "compat": KEY, "profile": DATA})
    with pytest.raises(ProfileStoreError):
        ProfileStore("")


def test_size_strings_are_stored_as_integers(store):
    data = {
        "ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "-1GiB", "name": "GPU-1"}],
        "vllm_free_bytes": {0: "41.5GiB"},
        "total_bytes": "141GiB",
        "block_size": 16,
    }
    rec = store.record({"host_class": "h200", "compat": KEY, "profile": data})
    stored = yaml.safe_load(open(rec["path"]))["profile"]
    assert stored["ranks"][0] == {"rank": 0, "free_bytes": 42 * 1024**3, "kv_bytes": -(1024**3), "name": "GPU-1"}
    assert stored["vllm_free_bytes"] == {0: int(41.5 * 1024**3)}
    assert stored["total_bytes"] == 141 * 1024**3
    with pytest.raises(ProfileStoreError, match=r"profile.ranks\[0\].free_bytes"):
        store.record({"host_class": "h200", "compat": KEY, "profile": {"ranks": [{"rank": 0, "free_bytes": "lots"}]}})


def test_cpu_build_profile_without_a_suggestion_is_recorded(store):
    """The CPU build logs no fit suggestion: the reference holds the KV bytes the engine allocated,
    which kv_plan starts from; a rank with neither is still refused."""
    cpu = {"ranks": [{"rank": 0, "free_bytes": 4831838208, "kv_bytes": None, "kv_bytes_in_use": 1106127360}],
           "vllm_free_bytes": {}, "total_bytes": 51539607552, "engine_kv_bytes": 1106127360}
    rec = store.record({"host_class": "cpu", "compat": KEY, "profile": cpu})
    assert store.query("cpu", KEY)["profile"]["path"] == rec["path"]
    bare = {"ranks": [{"rank": 0, "free_bytes": 4831838208, "kv_bytes": None}], "total_bytes": 51539607552}
    with pytest.raises(ProfileStoreError, match=r"profile.ranks: .*kv_bytes_in_use in place of kv_bytes"):
        store.record({"host_class": "cpu", "compat": KEY, "profile": bare})
