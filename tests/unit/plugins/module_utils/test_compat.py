# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

import hashlib
import json

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._compat import (
    KNOWN_FIELDS,
    SERVE_ARG_FIELDS,
    CompatError,
    CompatKey,
    compat_key,
    diff_keys,
    host_fields,
    key_hash,
)

BASE = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "model_revision": "0e9e39f2",
    "vllm_version": "0.33.0",
    "gpu_name": "NVIDIA H200",
    "total_bytes": 150754820096,
    "compute_capability": "9.0",
    "tensor_parallel_size": 1,
    "max_model_len": 8192,
    "enforce_eager": False,
    "compilation_config": {"level": 3, "cudagraph_capture_sizes": [1, 2, 4]},
}


def test_hash_is_sha256_prefix_of_canonical_json():
    key = compat_key(BASE)
    canon = json.dumps(key.fields, sort_keys=True, separators=(",", ":"))
    assert key.full_hash == hashlib.sha256(canon.encode()).hexdigest()
    assert key.hash == key.full_hash[:16]
    assert len(key.hash) == 16
    assert key.as_dict()["hash"] == key.hash


def test_key_hash_is_the_keys_hash_from_fields_or_a_key():
    key = compat_key(BASE)
    assert key_hash(BASE) == key_hash(key) == key.hash
    assert key_hash({**BASE, "max_model_len": "8192", "unset": None}) == key.hash  # canonical, None left out
    assert key_hash({**BASE, "max_model_len": 4096}) != key.hash
    with pytest.raises(CompatError):
        key_hash(["model"])  # type: ignore[arg-type]


def test_the_profile_store_and_the_planner_carry_the_same_hash(tmp_path):
    """The store's record key_hash is key_hash(compat); kv_plan reads it from a whole record as its reference's."""
    from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan_inputs import parse_reference
    from ansible_collections.gpufleet.vllm.plugins.plugin_utils._profile_store import ProfileStore

    record = ProfileStore(str(tmp_path)).build_record(
        {"host_class": "h200", "compat": BASE, "profile": {"ranks": [{"rank": 0, "free_bytes": 100, "kv_bytes": 10}]}})
    assert record["key_hash"] == key_hash(BASE)
    ref = parse_reference(record)
    assert ref is not None and ref["key_hash"] == key_hash(BASE)


def test_canonicalisation_makes_equivalent_inputs_equal():
    variant = dict(BASE)
    variant.update(
        total_bytes="150754820096",
        tensor_parallel_size="1",
        max_model_len=8192.0,
        enforce_eager="false",
        compute_capability=[9, 0],
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4], "level": 3},
        quantization=None,  # null fields are left out
        model=" meta-llama/Llama-3.1-8B-Instruct ",
    )
    assert compat_key(variant).hash == compat_key(BASE).hash
    assert compat_key(compat_key(BASE)) == compat_key(BASE)


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_revision", "deadbeef"),
        ("vllm_version", "0.33.1"),
        ("total_bytes", 150754820095),
        ("enforce_eager", True),
        ("compilation_config", {"level": 3, "cudagraph_capture_sizes": [1, 2, 8]}),
        ("kv_cache_dtype", "fp8"),
        ("world_size", 2),
    ],
)
def test_any_change_changes_the_hash_and_is_named(field, value):
    changed = dict(BASE, **{field: value})
    assert compat_key(changed).hash != compat_key(BASE).hash
    diff = diff_keys(BASE, changed)
    assert [d["field"] for d in diff] == [field]
    assert diff[0]["current"] == compat_key(changed).fields[field]
    assert diff[0]["reference"] == compat_key(BASE).fields.get(field)


def test_diff_reports_added_and_removed_fields():
    a = dict(BASE, quantization="awq")
    b = {k: v for k, v in BASE.items() if k != "model_revision"}
    diff = {d["field"]: d for d in diff_keys(a, b)}
    assert set(diff) == {"quantization", "model_revision"}
    assert diff["quantization"] == {"field": "quantization", "reference": "awq", "current": None}
    assert diff["model_revision"]["current"] is None
    assert diff_keys(BASE, dict(BASE)) == []


def test_bool_vs_int_differs():
    assert diff_keys({"x": 1}, {"x": True}) != []


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"tensor_parallel_size": "two"}, "tensor_parallel_size"),
        ({"total_bytes": True}, "total_bytes"),
        ({"enforce_eager": "maybe"}, "enforce_eager"),
        ({"x": object()}, "unsupported"),
        ({"x": float("inf")}, "finite"),
        ({"": 1}, "empty field name"),
    ],
)
def test_bad_values(fields, match):
    with pytest.raises(CompatError, match=match):
        compat_key(fields)


def test_not_a_mapping():
    with pytest.raises(CompatError):
        compat_key(["model"])  # type: ignore[arg-type]


def test_known_fields_cover_design_and_startup_plan_keys():
    for name in ("compute_capability", "torch_version", "cuda_version", "world_size", "rank_count", "gpu_name", "total_bytes"):
        assert name in KNOWN_FIELDS
    assert isinstance(compat_key({}), CompatKey)


def test_subclassed_values_canonicalise_to_builtin_types():
    class TaggedInt(int):
        pass

    class TaggedStr(str):
        pass

    key = compat_key({TaggedStr("max_model_len"): TaggedInt(8192), "model": TaggedStr("m"), "extra": TaggedInt(3)})
    assert [type(v) for v in key.fields.values()] == [int, int, str]
    assert diff_keys(key, {"max_model_len": 8192, "model": "m", "extra": 3}) == []


# ---------------------------------------------------------------- the fields of a host's instance
def test_host_fields_take_each_field_from_where_it_lives():
    fields = host_fields(
        "/srv/m", {"revision": "r1", "max_model_len": 8192, "dtype": "bfloat16", "enable_prefix_caching": True, "api_server_count": 2},
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "OTHER": "x"},
        version_output="INFO some log line\n0.32.0\n", gpu={"name": "NVIDIA H200", "total_bytes": 150110961664, "compute_capability": "9.0"},
        driver_version="570.86.15", rank_count=2, runtime={"vllm_version": "0.32.0+cu128", "vllm_commit": "abc", "torch_version": "2.9.0"})
    assert fields == {
        "model": "/srv/m", "model_revision": "r1", "vllm_version": "0.32.0", "gpu_name": "NVIDIA H200", "total_bytes": 150110961664,
        "compute_capability": "9.0", "driver_version": "570.86.15", "rank_count": 2,
        "pytorch_cuda_alloc_conf": "expandable_segments:True", "vllm_commit": "abc", "torch_version": "2.9.0",
        "max_model_len": 8192, "dtype": "bfloat16",
    }
    # every serve-arg field is a key field, and the key's fields are the serve-arg ones plus the host's
    assert set(SERVE_ARG_FIELDS) <= set(KNOWN_FIELDS)
    assert compat_key(fields).hash == compat_key(dict(fields, max_model_len="8192")).hash


def test_host_fields_without_a_version_or_a_gpu_leave_them_out_of_the_key():
    fields = host_fields("/srv/m", None, None, version_output="", gpu=None, driver_version=None, rank_count=1)
    assert compat_key(fields).fields == {"model": "/srv/m", "rank_count": 1}


def test_a_gang_adds_its_layout_and_interconnect_and_a_one_host_key_stays_as_it_was():
    from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._compat import CompatError, compat_key, host_fields

    gpu = {"name": "NVIDIA H100 80GB HBM3", "total_bytes": 85520809984, "compute_capability": "9.0"}
    common = dict(version_output="0.33.0", gpu=gpu, driver_version="570.86.15", rank_count=8)
    one_host = host_fields("/srv/m", {"tensor_parallel_size": 8}, {}, **common)
    assert host_fields("/srv/m", {"tensor_parallel_size": 8}, {}, gang={}, **common) == one_host
    assert not set(one_host) & {"gang_mode", "nnodes", "gang_layout", "nccl_version", "infiniband"}
    gang = {"gang_mode": "mp", "nnodes": "2", "gang_layout": [8, 8], "infiniband": ["uverbs0", "rdma_cm"], "nccl_version": "2.27.3"}
    key = compat_key(host_fields("/srv/m", {"tensor_parallel_size": 8}, {}, gang=gang, **common))
    assert key.fields["nnodes"] == 2 and key.fields["infiniband"] == ["rdma_cm", "uverbs0"]
    assert key.hash != compat_key(one_host).hash
    # the same gang on another layout, or without InfiniBand, is another key
    other = compat_key(host_fields("/srv/m", {"tensor_parallel_size": 8}, {}, gang=dict(gang, gang_layout=[4, 4, 4, 4], nnodes=4), **common))
    no_ib = compat_key(host_fields("/srv/m", {"tensor_parallel_size": 8}, {}, gang=dict(gang, infiniband=[]), **common))
    assert len({key.hash, other.hash, no_ib.hash}) == 3
    with pytest.raises(CompatError, match="gang: unknown field.*world"):
        host_fields("/srv/m", {}, {}, gang={"world": 2}, **common)
