# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The block size vLLM picks itself, per release and device, and the release rules behind it.

The figures vLLM gives for these cases are checked against vLLM's own code, release by
release, in tests/integration/test_kv_oracle_matrix.py; here the rules themselves.
"""

from __future__ import annotations

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_release import RELEASES, SUPPORTED_WHEELS, parse_version, release_rules
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._geometry import (
    GeometryError,
    UnpredictableGeometry,
    capacity_model,
    engine_target,
    geometry_from_config,
)
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class

GIB = 1024**3
# Qwen3-Next-80B-A3B's config.json (the fields the planner reads)
QWEN3_NEXT = {
    "model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "hidden_size": 2048, "torch_dtype": "bfloat16", "full_attention_interval": 4, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}
# Jamba-v0.1
JAMBA = {
    "model_type": "jamba", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
    "torch_dtype": "bfloat16", "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_expand": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
}
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
         "torch_dtype": "bfloat16"}
DEEPSEEK = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}


def test_release_rules_follow_the_runtime_version():
    assert RELEASES == ("0.32", "0.33", "0.34") and [v.rsplit(".", 1)[0] for v in SUPPORTED_WHEELS] == list(RELEASES)
    assert parse_version("0.33.0+cpu") == (0, 33, 0) and parse_version("v0.34.0rc1") == (0, 34, 0) and parse_version("main") is None
    assert release_rules("0.32.0+cpu").release == "0.32" and release_rules("0.32.0+cpu").notes == ()
    assert release_rules("0.33.1").mamba_cache_mode_flag is False and release_rules("0.32.0").mamba_cache_mode_flag is True
    assert (release_rules("0.33.0").cuda_default_block, release_rules("0.34.0").cuda_default_block) == (16, 64)
    newer = release_rules("0.36.2")
    assert newer.release == "0.34" and newer.notes == (
        "vLLM 0.36.2 is newer than 0.34, the newest release this collection knows: planned with 0.34's rules",)
    assert release_rules(None).release == "0.34" and "not known" in release_rules(None).notes[0]
    assert release_rules("0.30.1").release == "0.32" and "older than 0.32" in release_rules("0.30.1").notes[0]
    assert "not readable" in release_rules("nightly").notes[0]


def test_the_device_comes_from_the_serve_args_or_the_cpu_builds_versions():
    assert engine_target("0.32.0+cpu").device == "cpu"
    assert engine_target("0.32.0", torch_version="2.13.0+cpu").device == "cpu"
    assert engine_target("0.33.0", torch_version="2.9.0+cu129").device == "cuda"
    assert engine_target("0.33.0", device="CPU").device == "cpu"
    with pytest.raises(ValueError, match="device must be cuda or cpu"):
        engine_target("0.33.0", device="tpu")
    with pytest.raises(GeometryError, match="serve_args.device"):
        geometry_from_config(LLAMA, {"device": "xpu"})


@pytest.mark.parametrize("version, block, blocks, per_request, concurrency, tokens", [
    # the figures of vLLM 0.32 and 0.33 on an H200 (40 GiB, max_model_len 8192, prefix caching on)
    ("0.32.0", 544, 3212, 22, 146.00, 1_196_032),
    ("0.33.0", 576, 3034, 24, 126.42, 1_035_605),
    ("0.34.0", 576, 3034, 24, 126.42, 1_035_605),
])
def test_qwen3_next_block_size_is_aligned_to_its_state_page(version, block, blocks, per_request, concurrency, tokens):
    layout = capacity_model(QWEN3_NEXT, {"max_model_len": 8192}, engine_target(version, compute_capability="9.0"))
    assert layout.block_size == block and "so that one attention page holds a state page" in layout.block_size_source
    got = layout.num_blocks(40 * GIB)
    assert (got, layout.blocks_per_request(8192), round(layout.max_concurrency(got, 8192), 2), layout.tokens(got, 8192)) == (
        blocks, per_request, concurrency, tokens)


def test_the_flashinfer_gdn_prefill_kernel_is_chosen_as_vllm_chooses_it():
    serve = {"max_model_len": 8192}
    # Ampere: no FlashInfer GDN prefill, 0.33 keeps 0.32's block and blocks per request
    assert capacity_model(QWEN3_NEXT, serve, engine_target("0.33.0", compute_capability="8.0")).block_size == 544
    # Blackwell: only with CUDA 13, and then the CUDA version must be known
    assert capacity_model(QWEN3_NEXT, serve, engine_target("0.33.0", compute_capability="10.0", cuda_version="13.0")).block_size == 576
    assert capacity_model(QWEN3_NEXT, serve, engine_target("0.33.0", compute_capability="10.0", cuda_version="12.9")).block_size == 544
    with pytest.raises(UnpredictableGeometry, match="CUDA runtime version"):
        capacity_model(QWEN3_NEXT, serve, engine_target("0.33.0", compute_capability="10.0"))
    with pytest.raises(UnpredictableGeometry, match="compute capability, which is not known"):
        capacity_model(QWEN3_NEXT, serve, engine_target("0.33.0"))
    # prefix caching off: no checkpoint, 0.32's alignment
    off = capacity_model(QWEN3_NEXT, dict(serve, enable_prefix_caching=False), engine_target("0.33.0", compute_capability="9.0"))
    assert (off.block_size, off.state_blocks) == (544, 1)


def test_mamba_cache_mode_is_ignored_from_033_and_said():
    serve = {"max_model_len": 8192, "mamba_cache_mode": "none"}
    old = capacity_model(QWEN3_NEXT, serve, engine_target("0.32.0", compute_capability="9.0"))
    new = capacity_model(QWEN3_NEXT, serve, engine_target("0.33.0", compute_capability="9.0"))
    assert (old.state_blocks, new.state_blocks) == (1, 3)
    assert "serve_args.mamba_cache_mode is ignored by vLLM 0.33 (the mode follows prefix caching)" in new.notes


def test_a_given_block_too_small_for_the_state_is_raised_as_vllm_raises_it():
    # vLLM steps in multiples of the given block: 256 * cdiv(state page, 256 tokens' attention page) = 768
    layout = capacity_model(QWEN3_NEXT, {"block_size": 256}, engine_target("0.32.0", compute_capability="9.0"))
    assert layout.block_size == 768 and layout.block_size_source.startswith("serve_args.block_size 256 raised to 768")
    kept = capacity_model(QWEN3_NEXT, {"block_size": 1024}, engine_target("0.32.0", compute_capability="9.0"))
    assert (kept.block_size, kept.block_size_source) == (1024, "serve_args.block_size (it holds the state page)")


def test_cpu_build_block_sizes():
    target = engine_target("0.32.0+cpu", cpu_bf16=True)
    llama = geometry_from_config(LLAMA, {}, target)
    assert (llama.block_size, llama.block_size_source) == (128, "vLLM 0.32 on the CPU build picks 128 for attention layers")
    assert geometry_from_config(DEEPSEEK, {}, target).block_size == 16
    assert geometry_from_config(dict(DEEPSEEK, model_type="deepseek_v4"), {"block_size": 64}, target).block_size == 256
    # Jamba: the Mamba state (float32 SSM state on hosts with AVX-512 BF16) needs two 128-token steps
    jamba = capacity_model(JAMBA, {}, target)
    assert jamba.block_size == 256
    # without AVX-512 BF16 the state stays in bf16 and one step holds it: not knowing the host, no figure
    assert capacity_model(JAMBA, {}, engine_target("0.32.0+cpu", cpu_bf16=False)).block_size == 128
    with pytest.raises(UnpredictableGeometry, match=r"host CPU feature that is not known.*\(128, 256\)"):
        capacity_model(JAMBA, {}, engine_target("0.32.0+cpu"))


def test_the_one_request_floor_follows_the_engines_block():
    # a Jamba-shaped tiny model on the CPU build: the floor is counted in the engine's 128-token blocks
    tiny = dict(JAMBA, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    layout = capacity_model(tiny, {}, engine_target("0.32.0+cpu", cpu_bf16=True))
    assert layout.block_size == 128 and layout.block_size_source == "vLLM 0.32 on the CPU build: 128 holds the state page"
    assert layout.bytes_for_one_request(512) == (layout.blocks_per_request(512) + 1) * layout.bytes_per_block


@pytest.mark.parametrize("capability, version, block", [
    ("9.0", "0.33.0", 16), ("9.0", "0.34.0", 64), ("8.0", "0.32.0", 16), ("10.0", "0.33.0", 32), ("10.0", "0.34.0", 64),
    ("12.0", "0.33.0", 16),
])
def test_mla_block_size_follows_the_default_mla_backend(capability, version, block):
    geo = geometry_from_config(DEEPSEEK, {}, engine_target(version, compute_capability=capability))
    assert geo.block_size == block and "MLA decode backend" in geo.block_size_source


def test_unmodelled_choices_are_named_not_guessed():
    with pytest.raises(UnpredictableGeometry, match="compute capability, which is not known"):
        geometry_from_config(DEEPSEEK, {}, engine_target("0.33.0"))
    with pytest.raises(UnpredictableGeometry, match="not modelled"):
        geometry_from_config(dict(DEEPSEEK, model_type="deepseek_v32", index_head_dim=128), {}, engine_target("0.33.0", compute_capability="9.0"))
    minimax = {"model_type": "minimax_text_01", "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
               "head_dim": 128, "hidden_size": 1024, "torch_dtype": "bfloat16", "attn_type_list": [0, 0, 0, 1] * 2}
    with pytest.raises(UnpredictableGeometry, match="state page is not modelled"):
        capacity_model(minimax, {}, engine_target("0.32.0", compute_capability="9.0"))
    # a given block is taken as is, and the source says the state was not checked
    given = capacity_model(minimax, {"block_size": 256}, engine_target("0.32.0", compute_capability="9.0"))
    assert given.block_size == 256 and "taken as is" in given.block_size_source


def test_033_refuses_a_half_precision_kv_cache_other_than_the_models():
    assert geometry_from_config(LLAMA, {"kv_cache_dtype": "float16"}, engine_target("0.32.0")).dtype_bytes == 2
    with pytest.raises(GeometryError, match="serve_args.kv_cache_dtype float16: vLLM 0.33 refuses"):
        geometry_from_config(LLAMA, {"kv_cache_dtype": "float16"}, engine_target("0.33.0"))
    assert geometry_from_config(LLAMA, {"kv_cache_dtype": "bfloat16"}, engine_target("0.33.0")).dtype_bytes == 2


def _plan(reference):
    return plan_class({"host_class": "h200", "reference": reference, "hosts": {"a": [{"rank": 0, "boot_free_bytes": "42GiB"}]},
                       "guard_bytes": "0.5GiB", "max_model_len": 8192})


def test_the_plan_says_which_block_size_and_rules_it_used():
    ranks = [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "40GiB"}]
    geometry = {"config": QWEN3_NEXT, "serve_args": {"max_model_len": 8192}}
    record = {"compat": {"vllm_version": "0.33.0", "compute_capability": "9.0"}, "profile": {"ranks": ranks, "total_bytes": "141GiB",
                                                                                             "geometry": geometry}}
    plan = _plan(record)
    assert plan["block_size"] == 576 and plan["blocks_per_request"] == 24
    assert any(r.startswith("block size 576: vLLM 0.33 on CUDA compute capability 9.0 raises the block to 576") for r in plan["reasons"])
    newer = _plan(dict(record, compat={"vllm_version": "0.37.0", "compute_capability": "9.0"}))
    assert "vLLM 0.37.0 is newer than 0.34, the newest release this collection knows: planned with 0.34's rules" in newer["reasons"]
    # the profiled canary's own block size wins where it differs, and the plan says so
    canary = _plan(dict(record, profile=dict(record["profile"], block_size=544)))
    assert canary["block_size"] == 544
    assert any("the profiled canary used block size 544 where vLLM 0.33 on CUDA compute capability 9.0 is modelled to pick 576" in r
               for r in canary["reasons"])
    # nothing known of the GPU: the canary's figure, or no capacity from the config
    unknown = {"compat": {"vllm_version": "0.33.0"}, "profile": {"ranks": ranks, "total_bytes": "141GiB", "geometry": geometry}}
    assert _plan(unknown)["capacity_source"] is None
    measured = _plan(dict(unknown, profile=dict(unknown["profile"], block_size=576)))
    assert (measured["block_size"], measured["capacity_source"]) == (576, "layout")
    assert any(r.startswith("block size: vLLM 0.33 on CUDA: whether the FlashInfer GDN prefill kernel runs depends on the GPU's")
               and r.endswith("the profiled canary's block size 576 is used") for r in measured["reasons"]), measured["reasons"]


def test_a_bad_runtime_version_names_the_field():
    with pytest.raises(Exception, match=r"reference.vllm_version: expected a version string"):
        _plan({"ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "40GiB"}], "vllm_version": "0.33\n.0"})


def test_a_034_profiled_canary_measures_without_the_extensible_kv_cache():
    from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._canary import CanarySpec, canary_argv

    def argv(**kw):
        return canary_argv(CanarySpec(executable="/opt/vllm/bin/vllm", model="/m", gpu_memory_utilization=0.9, **kw), 8000)

    assert "--no-enable-extensible-kv-cache" in argv(vllm_version="0.34.0")
    assert "--no-enable-extensible-kv-cache" in argv(vllm_version="0.35.2")  # newer: the newest known rules
    # a release without it, the CPU build, a manual canary (a fixed budget turns it off) or the user's own choice: unchanged
    for kw in ({"vllm_version": "0.33.0"}, {"vllm_version": "0.34.0+cpu"}, {}, {"vllm_version": "0.34.0", "serve_args": {"device": "cpu"}},
               {"vllm_version": "0.34.0", "mode": "manual", "kv_cache_memory_bytes": 1 << 30}):
        assert not any("extensible" in a for a in argv(**kw)), kw
    assert "--enable-extensible-kv-cache" in argv(vllm_version="0.34.0", serve_args={"enable_extensible_kv_cache": True})
