"""Fixtures: a small trained tokenizer and tiny random-weight checkpoints built with transformers."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


def _corpus() -> list[str]:
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
    train_bpe_tokenizer(_corpus(), vocab_size, out, specials, CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


def build_model(out: Path, tokenizer_dir: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    kwargs = dict(TINY, vocab_size=512, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs)).eval()
    model.save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        key = json.dumps([arch, seed, overrides], sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-model")
            cache[key] = build_model(out, tokenizer_dir, arch, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(model_factory) -> Path:
    return model_factory("llama")


sys.path.insert(0, str(Path(__file__).parent))
