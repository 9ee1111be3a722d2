#!/usr/bin/env python
"""Build the random-weight Llama checkpoint the peer comparisons run on.

Defaults give the 415.2M-parameter shape of issue #8 (hidden 896, 24 layers, 14 query / 2 KV
heads, head_dim 64, intermediate 4864, vocab 32000, untied), seeded. The tokenizer is a
Llama-2-style BPE (byte fallback, "▁" metaspace, <unk>/<s>/</s> = 0/1/2) trained on the Python
standard library sources: llama.cpp's GGUF converter does not recognise a byte-level GPT-2-style
pre-tokenizer, and this one converts cleanly. config.json also carries the keys older readers
(vLLM CPU, llama.cpp's converter) look for.

    python benchmarks/peers/make_checkpoint.py --out benchmarks/.cache/llama-415m
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path


def stdlib_texts(limit_bytes: int) -> list[str]:
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def llama_style_tokenizer(vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # Train on words split at "▁" (BPE over whole files as single words takes forever), then save
    # the unsplit form Llama tokenizers use; merges never cross "▁" either way.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_texts(8_000_000), trainer)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    fast.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden-size", type=int, default=896)
    ap.add_argument("--num-layers", type=int, default=24)
    ap.add_argument("--num-heads", type=int, default=14)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--intermediate-size", type=int, default=4864)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    args.out.mkdir(parents=True, exist_ok=True)
    llama_style_tokenizer(args.vocab_size, args.out)
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=args.max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(args.out))
    cfg_path = args.out / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved.setdefault("rope_theta", 10000.0)
    saved.setdefault("torch_dtype", "float32")
    cfg_path.write_text(json.dumps(saved, indent=2) + "\n")
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {params / 1e6:.1f}M parameters, vocab {args.vocab_size}")


if __name__ == "__main__":
    main()
