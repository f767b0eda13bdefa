# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""KV capacity of every model family, on config shapes of the public ``config.json`` files.

Each test names how capacity is derived: one full-attention/MLA group
(``KVGeometry``), KV-cache groups as vLLM groups them (``KVLayout``), or the
engine's own figures when the layout is not known.
"""

from __future__ import annotations

import math

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._geometry import (
    GeometryError,
    KVGeometry,
    UnpredictableGeometry,
    capacity_model,
    engine_target,
    geometry_from_config,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._kv_layout import FAMILIES, KVLayout, layer_kinds
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class

GIB = 1024**3

LLAMA_31_8B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096, "torch_dtype": "bfloat16"}
MISTRAL_7B_V01 = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "hidden_size": 4096, "sliding_window": 4096, "torch_dtype": "bfloat16"}
PHI3_MINI_4K = {"model_type": "phi3", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                "hidden_size": 3072, "sliding_window": 2047, "torch_dtype": "bfloat16"}
GEMMA2_9B = {"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 256, "hidden_size": 3584, "sliding_window": 4096, "torch_dtype": "float32"}
GEMMA3_27B = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
              "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
                              "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024,
                              "sliding_window_pattern": 6},
              "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 27}}
GPT_OSS_20B = {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
               "head_dim": 64, "hidden_size": 2880, "sliding_window": 128, "torch_dtype": "bfloat16",
               "layer_types": ["sliding_attention", "full_attention"] * 12}
LLAMA4_SCOUT = {"model_type": "llama4", "torch_dtype": "bfloat16",
                "text_config": {"model_type": "llama4_text", "num_hidden_layers": 48, "num_attention_heads": 40,
                                "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120,
                                "attention_chunk_size": 8192, "no_rope_layers": [1, 1, 1, 0] * 12}}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
               "hidden_size": 7168, "torch_dtype": "bfloat16"}
DEEPSEEK_V32 = dict(DEEPSEEK_V3, model_type="deepseek_v32", index_head_dim=128, index_n_heads=64, index_topk=2048)
QWEN3_NEXT_80B = {"model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                  "head_dim": 256, "hidden_size": 2048, "full_attention_interval": 4, "linear_num_value_heads": 32,
                  "torch_dtype": "bfloat16"}
JAMBA_V01 = {"model_type": "jamba", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16,
             "torch_dtype": "bfloat16"}
NEMOTRON_H_8B = {"model_type": "nemotron_h", "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "hidden_size": 4096, "torch_dtype": "bfloat16",
                 "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"}
GRANITE_40_H_SMALL = {"model_type": "granitemoehybrid", "num_hidden_layers": 40, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16",
                      "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)]}
FALCON_H1_7B = {"model_type": "falcon_h1", "num_hidden_layers": 44, "num_attention_heads": 12, "num_key_value_heads": 2,
                "head_dim": 128, "hidden_size": 3072, "mamba_d_state": 256, "torch_dtype": "bfloat16"}
MINIMAX_TEXT_01 = {"model_type": "minimax_text_01", "num_hidden_layers": 80, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 6144, "torch_dtype": "bfloat16",
                   "attn_type_list": [0, 0, 0, 0, 0, 0, 0, 1] * 10}

SERVE = {"max_num_batched_tokens": 2048}


def _page(kv_heads: int, head_dim: int, block: int = 16, dtype_bytes: int = 2) -> int:
    return block * kv_heads * 2 * head_dim * dtype_bytes


def _layout(cfg, **serve) -> KVLayout:
    # these figures are vLLM 0.32's on a Hopper GPU
    model = capacity_model(cfg, dict(SERVE, **serve), engine_target("0.32.0", compute_capability="9.0"))
    assert isinstance(model, KVLayout), model
    return model


# ------------------------------------------------------------ one group: geometry
def test_full_attention_is_one_group_geometry():
    model = capacity_model(LLAMA_31_8B, {})
    assert isinstance(model, KVGeometry)
    assert model.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert layer_kinds(LLAMA_31_8B, "llama")[0] == "full_attention"


@pytest.mark.parametrize("kv_dtype, per_layer", [("auto", 576 * 2), ("fp8", 576), ("fp8_e5m2", 576), ("fp8_ds_mla", 656)])
def test_mla_per_kv_dtype(kv_dtype, per_layer):
    geo = geometry_from_config(DEEPSEEK_V3, {"kv_cache_dtype": kv_dtype, "tensor_parallel_size": 8, "block_size": 64})
    assert geo.mla
    assert geo.bytes_per_token == 61 * per_layer  # one latent head, not split by TP


@pytest.mark.parametrize("kv_dtype, per_layer", [("auto", 576 * 2 + 132), ("fp8_ds_mla", 656 + 132)])
def test_deepseek_v32_indexer_cache_shares_the_mla_group(kv_dtype, per_layer):
    geo = geometry_from_config(DEEPSEEK_V32, {"kv_cache_dtype": kv_dtype, "block_size": 64})
    # indexer key cache: 128 uint8 values + one float32 scale per 128 values, in the same group as MLA
    assert geo.bytes_per_token == 61 * per_layer
    assert geo.bytes_per_block == 61 * per_layer * 64


def test_fp8_ds_mla_needs_an_mla_model():
    with pytest.raises(GeometryError, match="needs an MLA model"):
        geometry_from_config(LLAMA_31_8B, {"kv_cache_dtype": "fp8_ds_mla"})


# --------------------------------------------------------- sliding window layouts
def test_mistral_sliding_window_on_every_layer():
    layout = _layout(MISTRAL_7B_V01)
    assert layout.family == "sliding_window"
    assert [(g.kind, g.layers, g.window) for g in layout.groups] == [("sliding", 32, 4096)]
    assert layout.bytes_per_block == 32 * _page(8, 128)
    # cdiv(min(4095 + 2048, 32768), 16) + 1 blocks instead of 32768 / 16
    assert layout.blocks_per_request(32768) == 385
    assert layout.blocks_per_request(1024) == 64 + 1  # shorter than the window: the whole request, + 1
    with pytest.raises(UnpredictableGeometry, match="sliding"):
        geometry_from_config(MISTRAL_7B_V01, {})


def test_phi3_window_applies_to_every_layer():
    layout = _layout(PHI3_MINI_4K)
    assert layout.family == "sliding_window"
    assert layout.groups[0].layers == 32 and layout.groups[0].window == 2047
    assert layout.bytes_per_block == 32 * _page(32, 96)
    assert layout.blocks_per_request(4096) == 256 + 1  # 2046 + 2048 tokens >= 4096: the whole request


def test_gemma2_alternates_even_sliding_odd_global():
    layout = _layout(GEMMA2_9B)
    assert layout.family == "interleaved_sliding_window"
    assert sorted((g.kind, g.layers) for g in layout.groups) == [("full", 21), ("sliding", 21)]
    assert layout.group_size == 21
    # float32 checkpoints run in bf16: 2 bytes
    assert layout.bytes_per_block == 21 * _page(8, 256)
    assert layout.blocks_per_request(8192) == 512 + (384 + 1)  # min(4095 + 2048, 8192) = 6143 tokens


def test_gemma3_five_to_one_pattern_makes_seven_groups():
    layout = _layout(GEMMA3_27B)
    kinds = sorted((g.kind, g.layers) for g in layout.groups)
    # 10 global layers (every 6th), 52 sliding ones: group size 10, 6 sliding groups (two padded to 10)
    assert kinds == [("full", 10)] + [("sliding", 8)] * 2 + [("sliding", 9)] * 4
    assert layout.group_size == 10
    assert layout.bytes_per_block == 10 * _page(16, 128)
    assert layout.blocks_per_request(131072) == 8192 + 6 * (192 + 1)  # min(1023 + 2048, L) = 3071 tokens
    blocks = layout.num_blocks(40 * GIB)
    assert blocks == 40 * GIB // (10 * _page(16, 128))
    assert layout.tokens(blocks, 131072) == int(blocks / (8192 + 6 * 193) * 131072)


def test_gemma3_layer_types_config_and_disabled_hybrid_manager():
    text = dict(GEMMA3_27B["text_config"], torch_dtype="bfloat16")
    del text["sliding_window_pattern"]
    text["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)]
    assert _layout(text).groups == _layout(GEMMA3_27B).groups
    off = _layout(GEMMA3_27B, disable_hybrid_kv_cache_manager=True)
    assert [(g.kind, g.layers) for g in off.groups] == [("full", 62)]
    assert off.bytes_per_block == 62 * _page(16, 128)
    assert off.blocks_per_request(131072) == 8192


def test_cohere2_pattern_makes_every_fourth_layer_global():
    cfg = {"model_type": "cohere2", "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 8,
           "hidden_size": 8192, "sliding_window": 4096, "sliding_window_pattern": 4, "torch_dtype": "bfloat16"}
    layout = _layout(cfg)
    assert sorted((g.kind, g.layers) for g in layout.groups) == [("full", 10)] + [("sliding", 10)] * 3
    assert layout.bytes_per_block == 10 * _page(8, 128)


def test_gpt_oss_alternating_layers():
    layout = _layout(GPT_OSS_20B)
    assert sorted((g.kind, g.layers, g.window) for g in layout.groups) == [("full", 12, None), ("sliding", 12, 128)]
    assert layout.bytes_per_block == 12 * _page(8, 64)
    assert layout.blocks_per_request(131072) == 8192 + (cdiv_(127 + 2048, 16) + 1)


def cdiv_(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------- chunked local attention
def test_llama4_chunked_local_with_nope_global_layers():
    layout = _layout(LLAMA4_SCOUT)
    assert layout.family == "chunked_local"
    assert sorted((g.kind, g.layers) for g in layout.groups) == [("chunked", 12)] * 3 + [("full", 12)]
    assert layout.bytes_per_block == 12 * _page(8, 128)
    # chunked: cdiv(min(8192 + 2048, L), 16) per group; NoPE: the whole request
    assert layout.blocks_per_request(131072) == 8192 + 3 * 640
    # with the hybrid manager off (VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0) chunked layers become full
    off = _layout(LLAMA4_SCOUT, allow_chunked_local_attn_with_hybrid_kv_cache="0")
    assert [(g.kind, g.layers) for g in off.groups] == [("full", 48)]


def test_llama4_interval_when_no_rope_layers_missing():
    text = {k: v for k, v in LLAMA4_SCOUT["text_config"].items() if k != "no_rope_layers"}
    text["torch_dtype"] = "bfloat16"
    assert sorted((g.kind, g.layers) for g in _layout(text).groups) == [("chunked", 12)] * 3 + [("full", 12)]


# ---------------------------------------------------------- state-space hybrids
@pytest.mark.parametrize(
    "cfg, block, attention, states, group_size",
    [
        (QWEN3_NEXT_80B, 544, 12, 36, 12),
        (JAMBA_V01, 2048, 4, 28, 4),
        (NEMOTRON_H_8B, 1024, 4, 24, 4),
        (GRANITE_40_H_SMALL, 1024, 4, 36, 4),
        (FALCON_H1_7B, 2048, 44, 44, 44),
        (MINIMAX_TEXT_01, 256, 10, 70, 10),
    ],
    ids=["qwen3-next", "jamba", "nemotron-h", "granite-4.0-h", "falcon-h1", "minimax"],
)
def test_state_space_hybrids_group_attention_and_states(cfg, block, attention, states, group_size):
    layout = _layout(cfg, block_size=block)
    assert layout.family == "hybrid_state_space"
    full = sum(g.layers for g in layout.groups if g.kind == "full")
    state = sum(g.layers for g in layout.groups if g.kind == "state")
    assert (full, state, layout.group_size) == (attention, states, group_size)
    kv_heads, head = cfg["num_key_value_heads"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # state pages are padded to the attention page at the engine's block size
    assert layout.bytes_per_block == group_size * _page(kv_heads, head, block)
    groups_full = -(-attention // group_size)
    groups_state = -(-states // group_size)
    full_blocks = groups_full * -(-8192 // block)
    # prefix caching (vLLM 0.32's default) puts state layers in "align" mode: 2 blocks, + a checkpoint for Mamba2 mixers
    mamba2 = cfg["model_type"] in ("granitemoehybrid", "nemotron_h", "falcon_h1")
    assert layout.blocks_per_request(8192) == full_blocks + (3 if mamba2 else 2) * groups_state
    assert _layout(cfg, block_size=block, enable_prefix_caching=False).blocks_per_request(8192) == full_blocks + groups_state
    assert _layout(cfg, block_size=block, mamba_cache_mode="none").blocks_per_request(8192) == full_blocks + groups_state


def test_tiny_granite_hybrid_matches_the_cpu_engine():
    # the real CPU engine with make_family_models.py's granite-hybrid at 60,000,000 bytes, max_model_len 512:
    # "CPU KV cache size: 66,925 tokens, Maximum concurrency for 512 tokens per request: 130.71x", block 128
    cfg = {"model_type": "granitemoehybrid", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 128, "torch_dtype": "bfloat16", "layer_types": ["mamba", "attention", "mamba", "attention"]}
    layout = _layout(cfg, block_size=128)
    assert layout.bytes_per_block == 2 * _page(2, 32, 128)
    blocks = layout.num_blocks(60_000_000)
    assert blocks == 915
    assert layout.blocks_per_request(512) == 4 + 3
    assert round(layout.max_concurrency(blocks, 512), 2) == 130.71
    assert layout.tokens(blocks, 512) == 66_925


def test_unknown_layouts_are_named_not_sized():
    with pytest.raises(UnpredictableGeometry, match="state-space hybrid"):
        capacity_model({"model_type": "zamba2", "num_hidden_layers": 38, "num_attention_heads": 32, "hidden_size": 2560,
                        "torch_dtype": "bfloat16"}, {})
    with pytest.raises(UnpredictableGeometry, match="layer_types"):
        capacity_model(dict(LLAMA_31_8B, layer_types=["chunked_attention"] * 32), {})


def test_every_family_is_documented():
    text = (__import__("pathlib").Path(__file__).resolve().parents[4] / "docs" / "model-families.md").read_text()
    for family in FAMILIES:
        assert f"`{family}`" in text


# ---------------------------------------------------------------- the planner
TINY_GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "hidden_size": 128, "sliding_window": 128, "torch_dtype": "bfloat16",
               "layer_types": ["sliding_attention", "full_attention"] * 2}


def _plan_spec(kv_free: int, **ref_over):
    ref = {
        "ranks": [{"rank": 0, "free_bytes": kv_free + 4 * GIB, "kv_bytes_in_use": kv_free}],
        "total_bytes": 24 * GIB,
        "block_size": 128,
        "geometry": {"config": TINY_GEMMA3, "serve_args": {"device": "cpu"}},
        "max_model_len": 512,
    }
    ref.update(ref_over)
    return {
        "host_class": "cpu",
        "reference": ref,
        "hosts": {"a": [{"rank": 0, "boot_free_bytes": kv_free + 4 * GIB}]},
        "guard_bytes": 0,
        "max_model_len": 512,
    }


def test_plan_of_the_tiny_gemma3_matches_the_engine_figures():
    # what the real CPU engine reported at --kv-cache-memory-bytes 60000000, max_model_len 512, block 128:
    # 915 blocks, "CPU KV cache size: 52,053 tokens, Maximum concurrency for 512 tokens per request: 101.67x"
    plan = plan_class(_plan_spec(60_000_000, num_blocks=915, max_concurrency=101.66666666666667, engine_kv_bytes=60_000_000))
    assert plan["capacity_source"] == "layout"
    assert plan["kv_layout"]["family"] == "interleaved_sliding_window"
    assert plan["bytes_per_block"] == 2 * 128 * 2 * 64 * 2
    assert plan["num_blocks"] == 915
    assert plan["blocks_per_request"] == 4 + 5
    assert plan["kv_cache_tokens"] == 52_053
    assert plan["max_concurrency_vllm"] == 101.67
    assert plan["max_concurrency"] == 101


def test_plan_refuses_a_budget_below_one_request_of_every_group():
    # reference: 915 blocks in use; a co-tenant on the host leaves a budget of 400,000 bytes (6 blocks), but one
    # request needs 4 + 5 blocks (both KV-cache groups) + the null block = 655,360 bytes
    def plan_at(budget: int):
        s = _plan_spec(60_000_000, num_blocks=915, max_concurrency=101.66666666666667)
        b_ref = 915 * 65536
        s["hosts"]["a"][0]["boot_free_bytes"] -= b_ref - budget
        return plan_class(s)

    plan = plan_at(400_000)
    assert plan["kv_cache_memory_bytes"] == 400_000
    assert plan["decision"] == "refuse"
    assert plan["one_request_bytes"] == 10 * 65536
    assert any("(9 blocks summed over 2 KV-cache groups + the null block)" in r for r in plan["reasons"])
    assert plan_at(10 * 65536)["decision"] == "deploy"
    assert plan_at(10 * 65536 - 1)["decision"] == "refuse"


def test_plan_admission_and_fit_admission_count_every_group():
    s = _plan_spec(60_000_000)
    s["admission"] = {"concurrency": 8, "tokens_per_request": 512}
    s["budget_mode"] = "fit_admission"
    s["fit_headroom"] = 0
    plan = plan_class(s)
    assert plan["fit"]["required_blocks"] == 8 * 9 + 1
    assert plan["kv_cache_memory_bytes"] == 73 * 65536
    assert plan["max_concurrency"] == 8
    fp8 = plan["what_if_fp8"]
    assert fp8["bytes_per_block"] == 65536 // 2 and not fp8["already_one_byte"]
    assert fp8["admission_bytes"] == 73 * 32768


def test_plan_without_max_model_len_gives_no_multi_group_tokens():
    s = _plan_spec(60_000_000)
    del s["max_model_len"], s["reference"]["max_model_len"]
    plan = plan_class(s)
    # no engine blocks in the reference: the logged in-use figure less its rounding
    assert plan["num_blocks"] == (60_000_000 - math.ceil(0.005 * GIB)) // 65536
    assert plan["kv_cache_tokens"] is None and plan["max_concurrency"] is None
    assert any("tokens not computed" in r for r in plan["reasons"])


def test_plan_what_if_fp8_for_a_one_byte_cache_is_the_plan():
    s = _plan_spec(60_000_000)
    s["reference"]["geometry"]["serve_args"]["kv_cache_dtype"] = "fp8"
    plan = plan_class(s)
    assert plan["bytes_per_block"] == 32768
    assert plan["what_if_fp8"]["already_one_byte"]
    assert plan["what_if_fp8"]["num_blocks"] == plan["num_blocks"]


def test_plan_in_use_bytes_are_the_blocks_the_engine_made():
    # a profiled CPU reference: no fit suggestion, "Auto set (2.12/...) GiB" rounded to 0.01 GiB
    s = _plan_spec(int(2.12 * GIB), num_blocks=34_732, max_concurrency=3859.11)
    plan = plan_class(s)
    assert plan["kv_cache_memory_bytes"] == 34_732 * 65536
    assert any("B_ref is the KV memory" in r for r in plan["reasons"])
    # the real engine: "Auto set (1.05/11.09) GiB", 1920.00x at 512 tokens = 17,280 blocks = 1.0547 GiB (logged rounded down)
    plan = plan_class(_plan_spec(int(1.05 * GIB), num_blocks=17_280, max_concurrency=1920.0))
    assert plan["kv_cache_memory_bytes"] == 17_280 * 65536
    assert plan["num_blocks"] == 17_280 and plan["kv_cache_tokens"] == 983_040
    # more blocks than the logged figure can hold: the layout or the figures are wrong, the log less its rounding is used
    plan = plan_class(_plan_spec(int(1.05 * GIB), num_blocks=18_000, max_concurrency=2000.0))
    assert plan["kv_cache_memory_bytes"] == int(1.05 * GIB) - math.ceil(0.005 * GIB)
    assert any("exceed the KV memory it logged" in r for r in plan["reasons"])


def test_plan_uses_the_engine_request_blocks_when_the_window_is_ambiguous():
    # max_model_len 1024: full 8 blocks; sliding cdiv(min(127 + in_flight, 1024), 128) + 1 is 2..9 blocks
    # depending on max_num_batched_tokens, which the serve args do not give
    s = _plan_spec(60_000_000, num_blocks=915, max_concurrency=915 / 12, max_model_len=1024)
    s["max_model_len"] = 1024
    plan = plan_class(s)
    assert plan["capacity_source"] == "layout"
    assert plan["blocks_per_request"] == 12
    assert any("taken from the profiled canary (12)" in r for r in plan["reasons"])
    # without the engine's concurrency: the most a window can hold (conservative)
    del s["reference"]["max_concurrency"]
    plan = plan_class(s)
    assert plan["blocks_per_request"] == 8 + 9
    # given max_num_batched_tokens the config decides: min(127 + 256, 1024) = 383 tokens -> 3 + 1 blocks
    s["reference"]["geometry"]["serve_args"]["max_num_batched_tokens"] = 256
    assert plan_class(s)["blocks_per_request"] == 8 + 4
    # an engine figure outside what the layout allows: the engine's own figures win, and it is said
    s["reference"]["max_concurrency"] = 915 / 30
    s["reference"]["engine_kv_bytes"] = 60_000_000
    plan = plan_class(s)
    assert plan["capacity_source"] == "engine"
    assert any("layout needs 12..12 blocks per request" in r for r in plan["reasons"])


def test_plan_unknown_layout_derives_capacity_from_the_engine():
    s = _plan_spec(60_000_000, num_blocks=915, max_concurrency=101.66666666666667, engine_kv_bytes=60_000_000)
    s["reference"]["geometry"] = {"config": {"model_type": "zamba2", "num_hidden_layers": 4, "num_attention_heads": 4,
                                             "hidden_size": 128, "torch_dtype": "bfloat16"}, "serve_args": {}}
    plan = plan_class(s)
    assert plan["capacity_source"] == "engine"
    assert plan["blocks_per_request"] == 9
    assert plan["num_blocks"] == 915
    assert plan["kv_cache_tokens"] == 52_053
    assert plan["what_if_fp8"] is None
    assert any("derived from the profiled canary's own figures" in r for r in plan["reasons"])
    del s["reference"]["max_concurrency"]
    plan = plan_class(s)
    assert plan["num_blocks"] is None
    assert any("lacks the engine figures" in r for r in plan["reasons"])
