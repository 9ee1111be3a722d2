#!/usr/bin/env python
"""Time one layer's attention for decodes and speculative verifications: Tandem's fused kernel vs
the backend's pure-torch path (the block-table gather plus PyTorch's scaled_dot_product_attention
that it takes when the kernels are off).

Each case is a batch of requests with the same context length and query length (1: decode,
1 + k: verification of k drafts), with the default model's head layout (5 query heads sharing one
KV head of 64). Both paths run interleaved, best of several rounds.

    python benchmarks/paged_attention.py --json benchmarks/results/paged_attention.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

# (requests, query tokens each, context tokens each)
CASES = [
    (1, 1, 200),
    (1, 5, 200),
    (4, 1, 200),
    (4, 5, 200),
    (16, 1, 300),
    (16, 5, 300),
    (64, 1, 200),
    (1, 1, 1000),
]


def make_batch(reqs: int, q_len: int, ctx: int, block: int, num_blocks: int):
    """The engine's own flat batch (`build_batch`) for `reqs` requests of `ctx` tokens, each with its
    last `q_len` to compute, in shuffled disjoint blocks of the cache."""
    from tandem.core.request import Request
    from tandem.sampling_params import SamplingParams
    from tandem.worker.batch import build_batch

    per = -(-ctx // block)
    tables = np.random.default_rng(0).permutation(num_blocks)[: reqs * per].reshape(reqs, per)
    requests = []
    for i in range(reqs):
        r = Request(f"r{i}", [0] * ctx, SamplingParams(), max_tokens=1)
        r.block_ids, r.num_computed_tokens = tables[i].tolist(), ctx - q_len
        requests.append(r)
    batch, _ = build_batch(requests, [q_len] * reqs, block, torch.device("cpu"))
    return batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=5)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--calls", type=int, default=200, help="calls per timing round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from tandem import kernels
    from tandem.model.attention import TorchAttentionBackend

    if not kernels.has("paged_attention"):
        raise SystemExit("Tandem's CPU kernels did not build here; nothing to compare")
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    paths = {
        "kernel": TorchAttentionBackend(h, kvh, d, use_kernel=True),
        "torch": TorchAttentionBackend(h, kvh, d, use_kernel=False),
    }
    rows = []
    print(f"{'requests':>8} {'q_len':>5} {'context':>7} {'kernel us':>10} {'torch us':>9} {'speedup':>8}")
    with torch.inference_mode():
        for reqs, q_len, ctx in CASES:
            num_blocks = reqs * -(-ctx // bs) + 4
            cache = torch.randn(2, num_blocks, bs, kvh, d)
            t = reqs * q_len
            q, k, v = torch.randn(t, h, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
            batches = {}
            for name, backend in paths.items():
                batches[name] = make_batch(reqs, q_len, ctx, bs, num_blocks)
                backend.prepare(batches[name])
            outs = {name: paths[name].forward(q, k, v, cache, batches[name]) for name in paths}
            err = (outs["kernel"] - outs["torch"]).abs().max().item()
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(args.rounds):
                for name, backend in paths.items():
                    batch = batches[name]
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        backend.forward(q, k, v, cache, batch)
                    best[name] = min(best[name], (time.perf_counter() - start) / args.calls)
            row = {
                "requests": reqs,
                "query_len": q_len,
                "context": ctx,
                "kernel_us": best["kernel"] * 1e6,
                "torch_us": best["torch"] * 1e6,
                "speedup": best["torch"] / best["kernel"],
                "max_abs_diff": err,
            }
            rows.append(row)
            print(
                f"{reqs:>8} {q_len:>5} {ctx:>7} {row['kernel_us']:>10.1f} {row['torch_us']:>9.1f} "
                f"{row['speedup']:>7.2f}x"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "heads": h,
            "kv_heads": kvh,
            "head_dim": d,
            "block_size": bs,
            "threads": torch.get_num_threads(),
        }
        args.json.write_text(json.dumps({"config": meta, "results": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
