"""Tiny test checkpoints: a small byte-level BPE tokenizer trained on a few stdlib sources, and
random-weight models built with transformers (the fixtures of conftest.py use them)."""

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


# Architectures whose test checkpoints get random norm weights (the older ones keep transformers'
# initialisation, which their tests were written against).
RANDOM_NORMS = ("gemma2", "gemma3", "phi3")


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
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[arch]
    kwargs = dict(TINY, vocab_size=512, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs)).eval()
    if arch in RANDOM_NORMS:
        # Norm weights start equal (ones, or zeros for Gemma's 1 + w): random ones make a norm
        # loaded into the wrong place, or computed the wrong way, change the output.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.2)
    model.save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out
