"""Report on the embedded default model: held-out perplexity, sample completions, draft acceptance.

Draft acceptance is measured as greedy speculative decoding would see it: at
each point of the target's own greedy continuation the draft proposes `k`
tokens greedily; the accepted ones are the longest prefix equal to the
target's next tokens; the target then contributes one more token. The
acceptance rate is accepted / proposed.

    python tools/default_model_report.py --json docs/default_model.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from tandem.models import DEFAULT_MODEL_DIR

DRAFT_DIR = DEFAULT_MODEL_DIR.parent / "default-draft"


def held_out_texts(max_files: int) -> list[str]:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from train_default_model import read, stdlib_files

    _, held = stdlib_files()
    return read(held[:max_files])


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq: int = 256, max_rows: int = 256) -> float:
    total, count = 0.0, 0
    n = min(max_rows, (ids.numel() - 1) // seq)
    for i in range(0, n, 8):
        x = torch.stack([ids[j * seq : j * seq + seq] for j in range(i, min(n, i + 8))])
        loss = model(input_ids=x, labels=x).loss
        total += loss.item() * x.numel()
        count += x.numel()
    return math.exp(total / count)


@torch.no_grad()
def greedy(model, prefix: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prefix]),
        attention_mask=torch.ones(1, len(prefix), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prefix) :].tolist()


def acceptance(target, draft, prefixes: list[list[int]], k: int, length: int) -> dict[str, float]:
    proposed = accepted = steps = 0
    for prefix in prefixes:
        ref = greedy(target, prefix, length)
        pos = 0
        while pos < len(ref) - 1:
            guess = greedy(draft, prefix + ref[:pos], k)
            a = 0
            while a < len(guess) and pos + a < len(ref) and guess[a] == ref[pos + a]:
                a += 1
            proposed += len(guess)
            accepted += a
            steps += 1
            pos += a + 1
    return {
        "k": k,
        "acceptance_rate": accepted / proposed,
        "mean_acceptance_length": 1 + accepted / steps,
        "proposed": proposed,
        "accepted": accepted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-prefixes", type=int, default=12)
    ap.add_argument("--length", type=int, default=64)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    target = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(DRAFT_DIR), dtype=torch.float32).eval()
    texts = held_out_texts(max_files=40)
    ids = []
    for t in texts:
        ids.extend([*tok.encode(t, add_special_tokens=False), tok.eos_token_id])
    ids_t = torch.tensor(ids)
    report: dict = {
        "held_out_tokens_scored": min(256, (len(ids) - 1) // 256) * 256,
        "target_perplexity": perplexity(target, ids_t),
        "draft_perplexity": perplexity(draft, ids_t),
    }
    # Code prefixes: the first lines of held-out files' function definitions.
    prefixes, samples = [], []
    for t in texts:
        for start in [i for i in range(len(t)) if t.startswith("\ndef ", i)][:2]:
            end = t.find("\n", start + 1)
            body_end = t.find("\n", end + 1)
            snippet = t[start + 1 : body_end + 1]
            prefixes.append(tok.encode(snippet, add_special_tokens=False))
            if len(samples) < 4:
                cont = greedy(target, prefixes[-1], 48)
                samples.append({"prefix": snippet, "completion": tok.decode(cont)})
        if len(prefixes) >= args.num_prefixes:
            break
    report["samples"] = samples
    report["draft_acceptance"] = acceptance(target, draft, prefixes[: args.num_prefixes], args.k, args.length)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
