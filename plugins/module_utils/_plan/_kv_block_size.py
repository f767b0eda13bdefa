# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The KV-cache block size vLLM picks itself, per release, device and layout.

Plain Python, no Ansible import, no vLLM import. Most serve arguments give no
``block_size``; vLLM then chooses one, and the planner must use the same figure
(blocks, tokens and the one-request floor all follow it). :func:`block_size`
returns it with the reason, or ``size=None`` when the choice is not modelled
(the caller then sizes from the profiled canary's own block size or declares
the capacity unknown: never a default of 16 by guess).

What vLLM does (``platforms/interface.py`` ``update_block_size_for_backend`` and
``_align_hybrid_block_size``, ``platforms/cpu.py``; 0.32 to 0.34):

* CUDA, attention layers: ``CacheConfig.DEFAULT_BLOCK_SIZE`` (16; 64 from
  0.34), which the default attention backends (FlashAttention, FlashInfer,
  Triton) accept.
* CUDA, MLA: the default MLA decode backend of the GPU generation decides:
  Triton MLA on compute capability 8.x and 12.x and FlashAttention MLA on 9.0
  keep the default; FlashInfer MLA on 10.x takes 32 or 64 (32 while the
  default is 16). A GPU whose capability is not known is not modelled.
* CPU build: 128 for attention layers; 16 for MLA (the reference MLA kernel,
  on hosts without AMX tiles); 256 for DeepSeek-V4.
* Hybrid state-space models: the attention page is raised until it holds one
  layer's state, ``block = k * cdiv(state_page, k * attention_page_per_token)``
  with ``k = max(smallest kernel block, block so far)`` (CUDA 16, CPU 32),
  then rounded up to a multiple of every backend's smallest kernel block; from
  0.33 on, GDN layers with the FlashInfer GDN prefill kernel (Hopper; 10.x and
  12.x with ``linear_key_head_dim`` 128 and CUDA 13; prefix caching on) make
  ``k`` a multiple of 64 (their prefill checkpoint alignment). A block the user
  gave is raised the same way when it cannot hold the state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .._engine._vllm_release import ReleaseRules, release_rules
from ._kv_capacity import DTYPE_BYTES
from ._kv_layout import UnknownLayout

__all__ = [
    "BlockSize",
    "EngineTarget",
    "UnknownBlockSize",
    "attention_block_size",
    "engine_target",
    "hybrid_block_size",
    "is_gdn",
    "state_page_bytes",
]

CPU_DEFAULT_BLOCK = 128


class UnknownBlockSize(UnknownLayout):
    """vLLM's choice of block size for this engine and layout is not modelled (reason in the message)."""


_KERNEL_BLOCK = {"cuda": 16, "cpu": 32}
_GDN_FLASHINFER_BLOCK = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class EngineTarget:
    """The engine a plan is for: its release's rules, its device and what of the device matters.

    ``compute_capability`` is the GPU's (``(9, 0)`` on Hopper), None when unknown
    or on the CPU build; ``cpu_bf16`` whether a CPU host has AVX-512 BF16 (the
    CPU build then keeps SSM state in float32), None when unknown.
    """

    rules: ReleaseRules
    device: str
    compute_capability: tuple[int, int] | None = None
    cuda_major: int | None = None
    cpu_bf16: bool | None = None

    def describe(self) -> str:
        where = "the CPU build" if self.device == "cpu" else (
            f"CUDA compute capability {self.compute_capability[0]}.{self.compute_capability[1]}" if self.compute_capability else "CUDA"
        )
        return f"vLLM {self.rules.release} on {where}"


def _capability(value: Any) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        try:
            return int(value[0]), int(value[1])
        except (TypeError, ValueError):
            return None
    parts = value.strip().split(".") if isinstance(value, str) else []
    if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
        return int(parts[0]), int(parts[1])
    return None


def engine_target(vllm_version: Any = None, device: Any = None, compute_capability: Any = None, cuda_version: Any = None,
                  cpu_bf16: bool | None = None, torch_version: Any = None) -> EngineTarget:
    """The :class:`EngineTarget` of a runtime: its version, device and GPU capability.

    Without ``device``, a ``+cpu`` vLLM or torch version (the CPU build's wheels) names the CPU build, else CUDA.
    """
    rules = release_rules(vllm_version)
    dev = str(device or "").strip().lower()
    if not dev:
        cpu = any(isinstance(v, str) and v.strip().endswith("+cpu") for v in (vllm_version, torch_version))
        dev = "cpu" if cpu else "cuda"
    if dev not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device!r}")
    cuda_major = None
    if isinstance(cuda_version, str) and cuda_version.split(".")[0].isdigit():
        cuda_major = int(cuda_version.split(".")[0])
    return EngineTarget(rules, dev, _capability(compute_capability) if dev == "cuda" else None, cuda_major, cpu_bf16)


@dataclass(frozen=True)
class BlockSize:
    """A block size (None when vLLM's choice is not modelled) and where it comes from, for the plan's reasons."""

    size: int | None
    source: str


def attention_block_size(target: EngineTarget, *, given: int | None, mla: bool, model_type: str) -> BlockSize:
    """The block size of a model without state-space layers (before any hybrid alignment)."""
    if target.device == "cpu":
        if model_type == "deepseek_v4":
            return BlockSize(256, "the CPU build's DeepSeek-V4 kernels take only 256 (vLLM overrides any other)")
        if mla:
            return BlockSize(16, "the CPU build's MLA kernel takes only 16 (vLLM overrides any other; hosts with AMX tiles use "
                                 "another kernel: give serve_args.block_size there)")
        if given:
            return BlockSize(given, "serve_args.block_size")
        return BlockSize(CPU_DEFAULT_BLOCK, f"{target.describe()} picks {CPU_DEFAULT_BLOCK} for attention layers")
    if given:
        return BlockSize(given, "serve_args.block_size")
    default = target.rules.cuda_default_block
    if mla:
        cap = target.compute_capability
        if cap is None:
            return BlockSize(None, f"{target.describe()}: the MLA decode backend, which picks the block size, depends on the GPU's "
                                   "compute capability, which is not known (give serve_args.block_size, or profile a canary)")
        if model_type in ("deepseek_v32", "deepseek_v4") or cap[0] not in (8, 9, 10, 12):
            return BlockSize(None, f"{target.describe()}: the block size of this MLA model's backends is not modelled "
                                   "(give serve_args.block_size, or profile a canary)")
        if cap[0] == 10:
            size = max(32, default)
            return BlockSize(size, f"{target.describe()}: the FlashInfer MLA decode backend takes 32 or 64, so {size}")
        backend = "FlashAttention MLA" if cap[0] == 9 else "Triton MLA"
        return BlockSize(default, f"{target.describe()}: the {backend} decode backend keeps vLLM's default {default}")
    return BlockSize(default, f"{target.describe()} keeps its default {default} (the CUDA attention backends accept it)")


def gdn_flashinfer_prefill(target: EngineTarget, prefix_caching: bool, key_head_dim: Any) -> bool:
    """Whether vLLM picks the FlashInfer GDN prefill kernel, which adds a checkpoint block and a 64-token alignment."""
    if not target.rules.gdn_flashinfer_prefill or target.device != "cuda" or not prefix_caching:
        return False
    cap = target.compute_capability
    if cap is None:
        raise UnknownBlockSize(f"{target.describe()}: whether the FlashInfer GDN prefill kernel runs depends on the GPU's "
                               "compute capability, which is not known (probe the GPUs, or give serve_args.block_size)")
    if cap[0] == 9:
        return True
    if cap[0] in (10, 12) and key_head_dim == 128:
        if target.cuda_major is None:
            raise UnknownBlockSize(f"{target.describe()}: whether the FlashInfer GDN prefill kernel runs depends on the CUDA "
                                   "runtime version (13 or later), which is not known")
        return target.cuda_major >= 13
    return False


def is_gdn(model_type: str) -> bool:
    """Whether a model's state layers are gated delta nets (Qwen3-Next, Qwen3.5): the FlashInfer GDN prefill rules apply."""
    return "qwen3_next" in model_type or "qwen3_5" in model_type


def _dtype_bytes(name: Any, where: str) -> int:
    key = str(name).lower().replace("torch.", "")
    # state caches are kept in 16 or 32 bits
    if DTYPE_BYTES.get(key, 0) < 2:
        raise UnknownLayout(f"{where} {name!r}: a state dtype this planner does not size")
    return DTYPE_BYTES[key]


def _positive(cfg: Mapping[str, Any], key: str, family: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or int(value) != value:
        raise UnknownLayout(f"{family} state: model config {key} is {value!r}, a positive integer is needed to size its state page")
    return int(value)


def _divide(a: int, tp: int, what: str) -> int:
    if a % tp:
        raise UnknownLayout(f"{what} {a} is not divisible by tensor_parallel_size {tp}")
    return a // tp


def state_page_bytes(cfg: Mapping[str, Any], model_type: str, *, tp: int, model_dtype_bytes: int, serve_args: Mapping[str, Any],
                     target: EngineTarget, ssm_float32: bool) -> int:
    """Bytes of one state-space layer's state on one rank (vLLM's ``MambaSpec.page_size_bytes`` before padding).

    ``ssm_float32`` keeps the SSM (temporal) state in float32 (the CPU build with
    AVX-512 BF16 does); otherwise its dtype follows ``mamba_ssm_cache_dtype``.
    Raises :class:`UnknownLayout` for a state this planner does not size.
    """
    spec = int(serve_args.get("num_speculative_tokens") or 0)
    conv_name = str(serve_args.get("mamba_cache_dtype") or "auto")
    conv_bytes = model_dtype_bytes if conv_name == "auto" else _dtype_bytes(conv_name, "serve_args.mamba_cache_dtype")
    ssm_name = str(serve_args.get("mamba_ssm_cache_dtype") or "auto")
    if ssm_name == "auto":
        # vLLM's per-model config hooks: NemotronH defaults to float32, Qwen3.5 reads mamba_ssm_dtype
        if "nemotron_h" in model_type:
            ssm_name = str(cfg.get("mamba_ssm_cache_dtype") or "float32")
        elif cfg.get("mamba_ssm_dtype"):
            ssm_name = str(cfg["mamba_ssm_dtype"])
    ssm_bytes = conv_bytes if ssm_name == "auto" else _dtype_bytes(ssm_name, "mamba_ssm_cache_dtype")
    if ssm_float32:
        ssm_bytes = 4
    if is_gdn(model_type):
        family = "gated delta net"
        nk, nv = _positive(cfg, "linear_num_key_heads", family), _positive(cfg, "linear_num_value_heads", family)
        dk, dv = _positive(cfg, "linear_key_head_dim", family), _positive(cfg, "linear_value_head_dim", family)
        kernel = _positive(cfg, "linear_conv_kernel_dim", family)
        conv = (kernel - 1 + spec) * _divide(dk * nk * 2 + dv * nv, tp, "GDN conv dim")
        temporal = _divide(nv, tp, "linear_num_value_heads") * dv * dk
        return conv * conv_bytes + temporal * ssm_bytes
    if "jamba" in model_type:
        family = "Mamba"
        inner = _positive(cfg, "mamba_expand", family) * _positive(cfg, "hidden_size", family)
        kernel, state = _positive(cfg, "mamba_d_conv", family), _positive(cfg, "mamba_d_state", family)
        per_rank = _divide(inner, tp, "Mamba intermediate size")
        return (kernel - 1) * per_rank * conv_bytes + per_rank * state * ssm_bytes
    if any(t in model_type for t in ("nemotron_h", "granitemoehybrid", "falcon_h1", "bamba")):
        family = "Mamba2"
        if "nemotron_h" in model_type:
            heads, head_dim = _positive(cfg, "mamba_num_heads", family), _positive(cfg, "mamba_head_dim", family)
            inner, groups = heads * head_dim, _positive(cfg, "n_groups", family)
            state, kernel = _positive(cfg, "ssm_state_size", family), _positive(cfg, "conv_kernel", family)
        else:
            heads, head_dim = _positive(cfg, "mamba_n_heads", family), _positive(cfg, "mamba_d_head", family)
            d_ssm = cfg.get("mamba_d_ssm") if "falcon_h1" in model_type else None
            inner = int(d_ssm) if d_ssm else int(_positive(cfg, "mamba_expand", family) * _positive(cfg, "hidden_size", family))
            groups, state = _positive(cfg, "mamba_n_groups", family), _positive(cfg, "mamba_d_state", family)
            kernel = _positive(cfg, "mamba_d_conv", family)
        if groups % tp:
            groups += tp - groups  # vLLM replicates the groups a head shard needs
        conv = (kernel - 1 + spec) * _divide(inner + 2 * groups * state, tp, "Mamba2 conv dim")
        temporal = _divide(heads, tp, "Mamba2 heads") * head_dim * state
        return conv * conv_bytes + temporal * ssm_bytes
    raise UnknownLayout(f"model_type {model_type!r}: the size of its state page is not modelled, so neither is the block size "
                        "vLLM aligns to it")


def hybrid_block_size(target: EngineTarget, *, start: int, attention_page_per_token: int, state_pages: set[int],
                      gdn_prefill: bool, given: bool) -> BlockSize:
    """The attention block vLLM raises ``start`` to so that one attention page holds a state page.

    ``state_pages`` are the candidate state page sizes (one when every fact is
    known): when they lead to different blocks the block size is not modelled.
    """
    kernel = _KERNEL_BLOCK[target.device]
    step = max(kernel, start)
    if gdn_prefill:
        # prefill checkpoints land on block boundaries: the step is also a multiple of their alignment
        step = step * _GDN_FLASHINFER_BLOCK // math.gcd(step, _GDN_FLASHINFER_BLOCK)
    blocks = set()
    for page in state_pages:
        block = step * _cdiv(page, step * attention_page_per_token)
        block = kernel * _cdiv(block, kernel)
        blocks.add(max(start, block))
    if len(blocks) != 1:
        return BlockSize(None, f"{target.describe()}: the state's dtype depends on a host CPU feature that is not known, and the "
                               f"aligned block size with it ({', '.join(str(b) for b in sorted(blocks))}); give serve_args.block_size")
    block = blocks.pop()
    how = "the FlashInfer GDN prefill kernel makes it a multiple of 64" if gdn_prefill else f"kernel blocks of {kernel}"
    if block == start:
        source = "serve_args.block_size (it holds the state page)" if given else f"{target.describe()}: {start} holds the state page"
        return BlockSize(block, source)
    origin = f"serve_args.block_size {start} raised" if given else f"{target.describe()} raises the block"
    return BlockSize(block, f"{origin} to {block} so that one attention page holds a state page ({how})")
