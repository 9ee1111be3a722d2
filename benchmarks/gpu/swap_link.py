"""The host link as preemption by swap uses it (docs/defaults.md, `swap_bandwidth_gbps`): the model
runner's own swap-out and swap-in (`ModelRunner.swap_out` / `swap_in`: a gather of the blocks on the
device, then one copy per block to pinned host memory, and back) of KV blocks shaped as a Llama-3-8B's
(32 layers, 8 KV heads of 128, bfloat16, 16-token blocks: 2 MiB a block), in GB/s each way.

    python benchmarks/gpu/swap_link.py [--device cuda] [--blocks 256] [--out swap_link.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.worker.model_runner import ModelRunner


def runner_over(caches: list[torch.Tensor], device: torch.device) -> ModelRunner:
    """A runner holding only what its swap copies read: the caches and their device (no model)."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.kv_caches, runner.device = caches, device
    runner.drafter = runner.head_drafter = None
    return runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=256, help="blocks moved per copy (each way)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    n = args.blocks
    shape = (2, 2 * n, args.block_size, args.kv_heads, args.head_dim)
    caches = [torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(args.layers)]
    runner = runner_over(caches, device)
    swap_bytes = runner.swap_block_bytes()
    runner.allocate_swap(n * swap_bytes)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out_pairs = [(d, h) for h, d in enumerate(range(0, 2 * n, 2))]
    in_pairs = [(h, d) for h, d in enumerate(range(1, 2 * n, 2))]
    best_out = best_in = float("inf")
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        runner.swap_out(out_pairs)
        sync()
        t1 = time.perf_counter()
        runner.swap_in(in_pairs)
        sync()
        best_out, best_in = min(best_out, t1 - t0), min(best_in, time.perf_counter() - t1)
    for layer in caches:  # what went out came back
        assert torch.equal(layer[:, 1::2], layer[:, 0::2])
    moved = n * swap_bytes
    result = {
        "device": str(device),
        "block_bytes": swap_bytes,
        "blocks": n,
        "swap_out_gb_per_s": moved / best_out / 1e9,
        "swap_in_gb_per_s": moved / best_in / 1e9,
        "pinned": bool(runner.swap_space and runner.swap_space[0].is_pinned()),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
