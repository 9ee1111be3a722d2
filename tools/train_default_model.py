"""Train Tandem's embedded default model and its draft on the Python standard library sources.

Reproducible (seeded) and CPU-only: a byte-level BPE tokenizer, a ~10M-parameter
Llama-architecture target and a ~1.5M-parameter draft sharing the tokenizer,
saved as ordinary Hugging Face checkpoint folders (float16 weights).

    python tools/train_default_model.py --out tandem/checkpoints
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TARGET = dict(
    hidden_size=320,
    intermediate_size=864,
    num_hidden_layers=8,
    num_attention_heads=5,
    num_key_value_heads=1,
    head_dim=64,
)
# Few layers (a draft pass costs per layer), but wide enough to agree with the target often.
DRAFT = dict(
    hidden_size=256,
    intermediate_size=576,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
)


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """Split the stdlib's non-test .py files by a hash of their path: ~5% held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3"}
    files = sorted(f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts))
    train, held = [], []
    for f in files:
        digest = hashlib.sha256(str(f.relative_to(root)).encode()).digest()[0]
        (held if digest < 13 else train).append(f)
    return train, held


def read(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    from tandem.checkpoints.bpe import train_bpe_tokenizer

    return train_bpe_tokenizer(texts, vocab_size, out, SPECIALS, CHAT_TEMPLATE)


def encode_corpus(tok, texts: list[str]) -> torch.Tensor:
    eos = tok.eos_token_id
    ids: list[int] = []
    for enc in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def make_model(shape: dict, vocab: int, max_len: int, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **shape,
    )
    return LlamaForCausalLM(cfg)


def bf16_is_fast() -> bool:
    """AMX or AVX512-BF16 make bf16 matmuls 2-3x faster than fp32 here; elsewhere they are slower."""
    from tandem.cpu import cpu_flags

    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def copy_rows(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Rows whose tail repeats an earlier span of the same row (16 to seq/2 tokens).

    Real language models copy from their context (induction heads), which is what prompt-lookup
    speculation relies on; a model this small trained on plain text barely learns to (greedy, it
    continued a repeated 32-token snippet for 0-9 tokens out of 64), so some rows make copying pay.
    """
    out = x.clone()
    seq = x.shape[1]
    for row in out:
        m = int(torch.randint(16, seq // 2 + 1, (1,), generator=g))
        a = int(torch.randint(0, seq - 2 * m + 1, (1,), generator=g))
        row[seq - m :] = row[a : a + m].clone()
    return out


def train(
    model,
    data: torch.Tensor,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    seed: int,
    name: str,
    bf16: bool = False,
    copy_fraction: float = 0.0,
    report=None,
) -> None:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    model.train()
    start = time.time()
    for step in range(steps):
        frac = step / max(1, steps - 1)
        scale = (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * frac))
        for group in opt.param_groups:
            group["lr"] = lr * max(scale, 0.05)
        idx = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([data[i : i + seq] for i in idx])
        n_copy = round(copy_fraction * batch)
        if n_copy:
            x[:n_copy] = copy_rows(x[:n_copy], g)
        # Mixed precision: fp32 master weights and optimizer state, bf16 matmuls.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            rate = (step + 1) * batch * seq / (time.time() - start)
            print(f"[{name}] step {step}/{steps} loss {loss.item():.3f} ({rate:.0f} tok/s)", flush=True)
        if report is not None and step % 200 == 199:
            model.eval()
            print(f"[{name}] step {step}: {report(model)}", flush=True)
            model.train()
    model.eval()


@torch.no_grad()
def perplexity(model, data: torch.Tensor, seq: int, max_rows: int = 256) -> float:
    total, count = 0.0, 0
    n = min(max_rows, (data.numel() - 1) // seq)
    for i in range(0, n, 8):
        rows = [data[j * seq : j * seq + seq] for j in range(i, min(n, i + 8))]
        x = torch.stack(rows)
        loss = model(input_ids=x, labels=x).loss
        total += loss.item() * x.numel()
        count += x.numel()
    return math.exp(total / count)


@torch.no_grad()
def copy_accuracy(model, data: torch.Tensor, rows: int = 64, body: int = 128, span: int = 64) -> float:
    """Greedy next-token accuracy while the input repeats an earlier stretch: each row is `body`
    held-out tokens followed by `body[32:32+span]`, scored on the repeat after its first token."""
    step = (data.numel() - body) // rows
    hits = total = 0
    for i in range(rows):
        w = data[i * step : i * step + body]
        x = torch.cat([w, w[32 : 32 + span]]).unsqueeze(0)
        pred = model(input_ids=x).logits[0].argmax(-1)
        # pred[j] predicts x[j + 1]; the repeat starts at index `body`.
        hits += int((pred[body : body + span - 1] == x[0, body + 1 :]).sum())
        total += span - 1
    return hits / total


def save(model, tok, out: Path, extra: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    # Older readers (vLLM, llama.cpp's converter) look for these keys.
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("torch_dtype", "float16")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(extra, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("tandem/checkpoints"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--target-steps", type=int, default=700)
    ap.add_argument("--draft-steps", type=int, default=2000)
    ap.add_argument(
        "--models",
        default="default,default-draft",
        help="which of default,default-draft to train (the tokenizer is retrained identically)",
    )
    ap.add_argument(
        "--copy-fraction",
        type=float,
        default=0.0,
        help="share of each batch's rows whose tail repeats an earlier span of the row (teaches copying)",
    )
    ap.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue training the checkpoints found here (e.g. tandem/checkpoints) instead of starting fresh",
    )
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--autocast",
        choices=("auto", "bf16", "off"),
        default="auto",
        help="bf16 mixed precision for training (auto: on where the CPU has AMX/AVX512-BF16)",
    )
    args = ap.parse_args()
    bf16 = args.autocast == "bf16" or (args.autocast == "auto" and bf16_is_fast())
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    train_files, held_files = stdlib_files()
    train_texts, held_texts = read(train_files), read(held_files)
    if args.init_from is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(args.init_from / "default"))
    else:
        tok = train_tokenizer(train_texts, args.vocab_size, args.out / "_tokenizer")
    train_ids, held_ids = encode_corpus(tok, train_texts), encode_corpus(tok, held_texts)
    print(
        f"train {len(train_files)} files / {train_ids.numel()} tokens; "
        f"held out {len(held_files)} files / {held_ids.numel()} tokens",
        flush=True,
    )

    results = {}
    wanted = set(args.models.split(","))
    for name, shape, steps, lr in (
        ("default", TARGET, args.target_steps, args.target_lr),
        ("default-draft", DRAFT, args.draft_steps, args.draft_lr),
    ):
        if name not in wanted:
            continue
        torch.manual_seed(args.seed)
        previous: dict = {}
        if args.init_from is not None:
            from transformers import LlamaForCausalLM

            model = LlamaForCausalLM.from_pretrained(str(args.init_from / name), dtype=torch.float32)
            previous = json.loads((args.init_from / name / "training.json").read_text())
            previous.pop("held_out_files", None)
            previous["held_out_copy_accuracy"] = round(copy_accuracy(model, held_ids), 3)
        else:
            model = make_model(shape, len(tok), 2048, tok)
        params = sum(p.numel() for p in model.parameters())
        t0 = time.time()
        train(
            model,
            train_ids,
            steps,
            args.batch,
            args.seq_len,
            lr,
            args.seed,
            name,
            bf16,
            args.copy_fraction,
            report=lambda m: f"held-out copy accuracy {copy_accuracy(m, held_ids):.3f}",
        )
        ppl = perplexity(model, held_ids, args.seq_len)
        copy = copy_accuracy(model, held_ids)
        info = {
            "parameters": params,
            "train_steps": steps,
            "learning_rate": lr,
            "copy_fraction": args.copy_fraction,
            "held_out_copy_accuracy": round(copy, 3),
            "batch": args.batch,
            "seq_len": args.seq_len,
            "train_tokens_seen": steps * args.batch * args.seq_len,
            "train_seconds": round(time.time() - t0, 1),
            "held_out_perplexity": round(ppl, 3),
            "held_out_files": [str(f.name) for f in held_files],
            "seed": args.seed,
            "bf16_autocast": bf16,
        }
        if previous:
            info["continued_from"] = previous
        print(
            f"[{name}] {params / 1e6:.2f}M params, held-out perplexity {ppl:.2f}, copy accuracy {copy:.3f}",
            flush=True,
        )
        save(model, tok, args.out / name, info)
        results[name] = info
    print(
        json.dumps({k: {kk: v for kk, v in r.items() if kk != "held_out_files"} for k, r in results.items()})
    )


if __name__ == "__main__":
    main()
