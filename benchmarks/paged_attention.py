#!/usr/bin/env python
"""Time one layer's attention for decodes, speculative verifications and prompt chunks: Tandem's
fused kernel vs the backend's pure-torch path (the block-table gather plus PyTorch's
scaled_dot_product_attention that it takes when the kernels are off), and with `--dtype bfloat16`
on an AMX CPU the tile kernel (`paged_attention_amx`) too. Prompt chunks (query longer than 16)
take SDPA on both of the first two paths, except on CPUs with AVX-512 and no AMX, where the kernel
takes them too (`kernel_takes_long_queries`): there these rows time the kernel against SDPA.

Each case is a batch of requests with the same context length and query length (1: decode,
1 + k: verification of k drafts), with the default model's head layout (5 query heads sharing one
KV head of 64). Both paths run interleaved, best of several rounds.

    python benchmarks/paged_attention.py --json benchmarks/results/paged_attention.json
    python benchmarks/paged_attention.py --dtype bfloat16 --heads 14 --kv-heads 2 \
        --json benchmarks/results/paged_attention_bf16.json
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
    (32, 1, 192),  # c=32 decode of the 415M peer checkpoint after 128 + 64 tokens
    (4, 128, 128),  # a 512-token step of four fresh 128-token prompts (the peer runs' prefill)
    (1, 512, 512),  # a 1024-token prompt's two chunks under a 512-token step budget
    (1, 512, 1024),
    (1, 512, 2048),
    (1, 2048, 2048),  # a whole 2048-token prompt in one step
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
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--calls", type=int, default=200, help="calls per timing round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from tandem import kernels
    from tandem.model.attention import TorchAttentionBackend
    from tandem.model.kv_quant import KVCacheFormat

    if not kernels.has("paged_attention"):
        raise SystemExit("Tandem's CPU kernels did not build here; nothing to compare")
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    dtype = getattr(torch, args.dtype)
    paths = {
        "kernel": TorchAttentionBackend(h, kvh, d, use_kernel=True),
        "torch": TorchAttentionBackend(h, kvh, d, use_kernel=False),
    }
    amx = TorchAttentionBackend(h, kvh, d, kv_format=KVCacheFormat("auto", dtype))
    if amx.tiles:
        paths["amx"] = amx
    rows = []
    names = "".join(f" {name + ' us':>10}" for name in paths)
    print(f"{'requests':>8} {'q_len':>5} {'context':>7}{names} {'speedup':>8}")
    with torch.inference_mode():
        for reqs, q_len, ctx in CASES:
            num_blocks = reqs * -(-ctx // bs) + 4
            cache = torch.randn(2, num_blocks, bs, kvh, d).to(dtype)
            t = reqs * q_len
            q, k, v = (torch.randn(t, n, d).to(dtype) for n in (h, kvh, kvh))
            calls = max(3, min(args.calls, int(2e7 // (reqs * q_len * ctx))))
            batches = {}
            for name, backend in paths.items():
                batches[name] = make_batch(reqs, q_len, ctx, bs, num_blocks)
                backend.prepare(batches[name])
            outs = {name: paths[name].forward(q, k, v, cache, batches[name]) for name in paths}
            err = max((outs[name].float() - outs["torch"].float()).abs().max().item() for name in paths)
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(args.rounds):
                for name, backend in paths.items():
                    batch = batches[name]
                    start = time.perf_counter()
                    for _ in range(calls):
                        backend.forward(q, k, v, cache, batch)
                    best[name] = min(best[name], (time.perf_counter() - start) / calls)
            row = {
                "requests": reqs,
                "query_len": q_len,
                "context": ctx,
                **{f"{name}_us": best[name] * 1e6 for name in paths},
                # the fastest Tandem path against the pure-torch one
                "speedup": best["torch"] / min(best[name] for name in paths if name != "torch"),
                "max_abs_diff": err,
            }
            rows.append(row)
            times = "".join(f" {row[name + '_us']:>10.1f}" for name in paths)
            print(f"{reqs:>8} {q_len:>5} {ctx:>7}{times} {row['speedup']:>7.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "heads": h,
            "kv_heads": kvh,
            "head_dim": d,
            "block_size": bs,
            "dtype": args.dtype,
            "threads": torch.get_num_threads(),
        }
        args.json.write_text(json.dumps({"config": meta, "results": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
