"""Tiny test checkpoints: a small byte-level BPE tokenizer trained on a few stdlib sources, and
random-weight Llama-family models built with transformers (the fixtures of conftest.py use them)."""

from __future__ import annotations

import os
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def corpus() -> list[str]:
    lib = Path(os.__file__).parent
    texts = []
    for name in ["os.py", "json/encoder.py", "textwrap.py", "string.py", "functools.py"]:
        p = lib / name
        if p.is_file():
            texts.append(p.read_text(errors="ignore"))
    texts.append("héllo wörld — 你好，世界 🙂 emoji and ünïcödé text " * 20)
    return texts


def build_tokenizer(out: Path, vocab_size: int = 512) -> None:
    from tandem.checkpoints.bpe import train_bpe_tokenizer

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    train_bpe_tokenizer(corpus(), vocab_size, out, specials, CHAT_TEMPLATE)


def build_model(out: Path, tokenizer_dir: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[arch]
    kwargs = dict(TINY, vocab_size=512, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs)).eval()
    model.save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out
