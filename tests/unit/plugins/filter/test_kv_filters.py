# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

import json

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.filter.kv import FilterModule

F = FilterModule().filters()
LLAMA_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}


def test_filter_names():
    assert set(F) == {"to_bytes", "human_bytes", "kv_bytes_per_token", "kv_reference", "host_plan"}


def test_to_bytes():
    assert F["to_bytes"]("28.25GiB") == 30333206528
    assert F["to_bytes"]("30g") == 30 * 10**9
    assert F["to_bytes"](512) == 512


def test_to_bytes_error_names_field():
    with pytest.raises(AnsibleFilterError, match="to_bytes: guard: invalid size '-1GiB': must not be negative"):
        F["to_bytes"]("-1GiB", "guard")


def test_human_bytes():
    assert F["human_bytes"](30333206528) == "28.25GiB"
    assert F["human_bytes"](100000000, 1) == "95.4MiB"
    assert F["human_bytes"](100000000, exact=True) == "100MB"
    assert F["human_bytes"]("0.5GiB") == "512MiB"
    assert F["human_bytes"](1024.0) == "1KiB"
    with pytest.raises(AnsibleFilterError, match="integer number of bytes"):
        F["human_bytes"](1.5)
    with pytest.raises(AnsibleFilterError, match="human_bytes"):
        F["human_bytes"]("lots")


def test_round_trip_through_both_filters():
    for n in (0, 1, 1000, 30333206528, 123456789012):
        assert F["to_bytes"](F["human_bytes"](n, exact=True)) == n


def test_kv_bytes_per_token(tmp_path):
    assert F["kv_bytes_per_token"](LLAMA_8B) == 131072
    assert F["kv_bytes_per_token"](LLAMA_8B, {"kv_cache_dtype": "fp8", "tensor_parallel_size": 2}) == 32768
    assert F["kv_bytes_per_token"](LLAMA_8B, {"block_size": 16}, "block") == 131072 * 16
    # without a block size, the one vLLM of that release picks on that device
    assert F["kv_bytes_per_token"](LLAMA_8B, {}, "block", "0.33.0") == 131072 * 16
    assert F["kv_bytes_per_token"](LLAMA_8B, {}, "block", "0.34.0") == 131072 * 64
    assert F["kv_bytes_per_token"](LLAMA_8B, {"device": "cpu"}, "block", "0.34.0") == 131072 * 128
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_8B))
    assert F["kv_bytes_per_token"](str(path)) == 131072
    assert F["kv_bytes_per_token"](str(tmp_path), {"block_size": 128}, "block") == 131072 * 128


@pytest.mark.parametrize(
    "args, match",
    [
        ((dict(LLAMA_8B, sliding_window=4096),), "sliding"),
        (("/nonexistent/config.json",), "cannot read"),
        ((LLAMA_8B, {}, "page"), "per must be"),
        ((LLAMA_8B, ["tp"]), "serve_args must be a mapping"),
    ],
)
def test_kv_bytes_per_token_errors(args, match):
    with pytest.raises(AnsibleFilterError, match=match):
        F["kv_bytes_per_token"](*args)


def test_kv_reference_of_a_cpu_profiled_canary_is_plannable():
    from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class

    run = {
        "ranks": [{"rank": 0, "initial_free_bytes": None, "suggested_kv_bytes_fit": None, "suggested_kv_bytes_full": None,
                   "reserved_kv_bytes": None, "current_kv_bytes": None, "auto_kv_bytes": 2276332994}],
        "num_blocks": 34732, "block_size": 128, "kv_cache_tokens": 4445696, "max_concurrency": 8683.0,
        "max_model_len": 512, "kv_cache_memory_bytes": None, "verdict": "pass", "log_tail": "x" * 10,
    }
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "hidden_size": 128, "torch_dtype": "bfloat16"}
    ref = F["kv_reference"](run, [{"index": 1, "free_bytes": 9 * 1024**3, "total_bytes": 10 * 1024**3, "name": "cpu"}], [1],
                            config=config, serve_args={"max_model_len": 512, "block_size": 128})
    assert ref["ranks"] == [{"rank": 0, "free_bytes": 9 * 1024**3, "kv_bytes": None, "kv_bytes_full": None,
                             "kv_bytes_in_use": 2276332994}]
    assert ref["max_concurrency"] == 8683.0 and ref["max_model_len"] == 512 and ref["num_blocks"] == 34732
    assert "log_tail" not in ref["canary_result"]
    plan = plan_class({"reference": ref, "hosts": {"h": [{"rank": 0, "boot_free_bytes": 9 * 1024**3}]}, "guard_bytes": 0})
    # B_ref is the bytes of the blocks the engine made: the plan reproduces the engine's figures
    assert plan["kv_cache_memory_bytes"] == 34732 * 65536
    assert plan["num_blocks"] == 34732 and plan["kv_cache_tokens"] == 34732 * 128


def test_kv_reference_errors_name_the_input():
    with pytest.raises(AnsibleFilterError, match="ranks missing"):
        F["kv_reference"]({"ranks": []}, [{"index": 0, "free_bytes": 1}], [0])
    with pytest.raises(AnsibleFilterError, match="GPU 5 is not in the pre-boot probe"):
        F["kv_reference"]({"ranks": [{"rank": 0}]}, [{"index": 0, "free_bytes": 1}], [5])
    with pytest.raises(AnsibleFilterError, match="preboot must be"):
        F["kv_reference"]({"ranks": [{"rank": 0}]}, {"index": 0}, [0])
