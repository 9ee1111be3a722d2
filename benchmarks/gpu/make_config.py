#!/usr/bin/env python
"""Write a checkpoint folder with no weights, for `load_format="dummy"`: config.json of a named
shape and a small tokenizer (the prompts are token ids; outputs are not detokenized).

Shapes: `qwen3-0.6b` (Qwen3-0.6B: hidden 1024, 28 layers, 16/8 heads of 128, intermediate 3072,
vocab 151936, tied embeddings), `llama3-8b` (Llama-3-8B: hidden 4096, 32 layers, 32/8 heads,
intermediate 14336, vocab 128256), `tiny` (a few layers, for running the scripts on a CPU).

    python benchmarks/gpu/make_config.py --shape llama3-8b --out /tmp/llama3-8b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
    ),
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    "tiny": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1024,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
}


def tokenizer(out: Path) -> None:
    """A word-level tokenizer of a few hundred tokens: the front end needs one to start."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(253)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 1 << 20,
            },
            indent=2,
        )
    )


def make(shape: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**SHAPES[shape], "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tokenizer(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    print(make(args.shape, args.out))


if __name__ == "__main__":
    main()
