# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The README's worked example is what the planner computes, not typed-in figures."""
from __future__ import annotations

import re
from pathlib import Path

from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import human_bytes
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class

README = Path(__file__).resolve().parents[2] / "README.md"
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "torch_dtype": "bfloat16"}


def worked_example() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("### Worked example")
    return text[start:text.index("\n## ", start)]


def test_readme_worked_example_matches_the_planner() -> None:
    plan = plan_class({
        "host_class": "readme",
        "reference": {"ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"}], "total_bytes": "141GiB",
                      "geometry": {"config": LLAMA_8B, "serve_args": {"max_model_len": 8192}}, "vllm_version": "0.33.0"},
        "hosts": {"a": [{"rank": 0, "boot_free_bytes": "40.75GiB"}]},
        "guard_bytes": "0.5GiB",
    })
    section = worked_example()
    assert re.search(r"B_adj\s+= 30 - max\(0, 42 - 40\.75\) - 0\.5 = (\S+) GiB", section).group(1) + "GiB" \
        == human_bytes(plan["kv_cache_memory_bytes"])
    floor = re.search(r"F_floor = 42 - \(30 - 0\.5 - 28\.25\) = (\S+) GiB", section).group(1)
    assert floor + "GiB" == human_bytes(plan["free_floor_bytes"][0])
    assert f"{plan['bytes_per_token']:,} bytes per token" in section
    assert f"{plan['num_blocks']:,} blocks, {plan['kv_cache_tokens']:,} tokens" in section


def test_readme_rollout_figures_use_the_default_gate_margin() -> None:
    margin, granule = default("gate_margin_bytes"), default("budget_granularity_bytes")
    plan = plan_class({
        "host_class": "readme",
        "reference": {"ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"}], "total_bytes": "141GiB",
                      "geometry": {"config": LLAMA_8B, "serve_args": {"max_model_len": 8192}}, "vllm_version": "0.33.0"},
        "hosts": {"a": [{"rank": 0, "boot_free_bytes": "40.75GiB"}]},
        "guard_bytes": "0.5GiB", "gate_margin_bytes": margin, "budget_granularity_bytes": granule,
    })
    section = worked_example()
    said = re.search(r"less the gate margin \((\S+) MiB by default.*?rounded down to\s+(\S+) MiB: (\S+) GiB, (\S+) blocks, (\S+) tokens, "
                     r"floor (\S+) GiB", section, re.S)
    assert said, section
    assert (int(said.group(1)) * 1024**2, int(said.group(2)) * 1024**2) == (margin, granule)
    assert said.group(3) + "GiB" == human_bytes(plan["kv_cache_memory_bytes"])
    assert (said.group(4), said.group(5)) == (f"{plan['num_blocks']:,}", f"{plan['kv_cache_tokens']:,}")
    assert said.group(6) + "GiB" == human_bytes(plan["free_floor_bytes"][0])
