"""Generate a tiny random-weight Llama model that the vLLM CPU engine serves.

Geometry (what the KV-cache tests rely on): hidden 128, 4 attention heads,
2 KV heads, head_dim 32, 2 layers, vocab 512, bfloat16. Weights come from a
fixed seed, the tokenizer is a ``tokenizers`` WordLevel model built here:
nothing is downloaded.

Usage: python make_tiny_model.py DEST
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SEED = 1234
VOCAB_SIZE = 512
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def _vocab() -> dict[str, int]:
    words = list(SPECIAL)
    words += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words += [str(d) for d in range(10)]
    words += [".", ",", "?", "!", ":", "'", "-", "user", "assistant", "system"]
    n = 0
    while len(words) < VOCAB_SIZE:
        words.append(f"w{n}")
        n += 1
    return {w: i for i, w in enumerate(words)}


def build(dest: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.eval()

    tok = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    fast.save_pretrained(tmp)

    # vLLM reads the dtype from config.json: make sure it says bfloat16 under
    # both spellings used by transformers releases.
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    dest = Path(argv[1]).resolve()
    build(dest)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"tiny model written to {dest} ({size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
