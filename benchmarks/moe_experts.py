"""One MoE layer's expert path, the ways it could run (the measurement behind tandem/model/experts.py).

Shape: Qwen3-30B-A3B's layer (hidden 2048, 128 experts, top-8, expert intermediate 768), float32,
random routing (a softmax over random logits), at 1, 8, 32 and 256 tokens. Candidates, each
timed in interleaved rounds (best of the rounds, per layer):

- `tandem`: what `run_experts` picks (one token: its experts in turn; more: grouped by expert);
- `grouped`: sort the (token, expert) pairs by expert, one product per active expert over its
  slice, scatter-add back (Tandem's path above one token);
- `token_by_token`: every (token, expert) pair in turn, no sort (Tandem's path for one token);
- `gathered_bmm`: gather the selected experts' weights and run one batched product per
  projection (copies the weights it reads; only up to 8 tokens: it needs T * 8 weight copies);
- `grouped_mm`: `torch._grouped_mm` over the sorted pairs (one call for all experts);
- `grouped_onednn`: the grouped loop with each expert's weights also packed for oneDNN (twice the
  experts' memory);
- `int8`: Tandem's int8 experts (`quantization="int8"`; weight-only without VNNI).

    python benchmarks/moe_experts.py                # the full shape, ~5 GiB of weights
    python benchmarks/moe_experts.py --quick        # 16 experts of hidden 256: a smoke test

Prints a table (ms per layer and the ratio to `tandem`) and writes benchmarks/results/moe_experts.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tandem.config import MoEConfig  # noqa: E402
from tandem.model import experts as experts_mod  # noqa: E402
from tandem.model.experts import Experts, Int8Experts, route, run_experts  # noqa: E402

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def make_experts(num_experts: int, hidden: int, inter: int) -> Experts:
    experts = Experts(num_experts, hidden, inter).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    for e in range(num_experts):  # one expert at a time: no full-size temporary
        experts.gate_up_proj[e].normal_(0, 0.02, generator=g)
        experts.down_proj[e].normal_(0, 0.02, generator=g)
    return experts


def candidates(experts: Experts, int8: Int8Experts | None, onednn: bool) -> dict[str, Fn]:
    w13, w2 = experts.gate_up_proj, experts.down_proj
    num_experts, inter = experts.num_experts, experts.intermediate_size

    def forced(max_direct: int) -> Fn:
        def fn(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            saved, experts_mod.DIRECT_MAX_TOKENS = experts_mod.DIRECT_MAX_TOKENS, max_direct
            try:
                return run_experts(experts, x, ids, w)
            finally:
                experts_mod.DIRECT_MAX_TOKENS = saved

        return fn

    def gathered_bmm(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = x.repeat_interleave(ids.shape[1], dim=0).unsqueeze(1)  # [S, 1, H]
        gu = torch.bmm(rows, w13[flat].transpose(1, 2)).squeeze(1)
        gate, up = gu.chunk(2, dim=-1)
        y = torch.bmm((F.silu(gate) * up).unsqueeze(1), w2[flat].transpose(1, 2)).squeeze(1)
        return (y * w.reshape(-1, 1)).view(*ids.shape, -1).sum(dim=1)

    def sorted_pairs(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        return order, order // ids.shape[1], x.index_select(0, order // ids.shape[1])

    def grouped_mm(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        order, token_of, rows = sorted_pairs(x, ids)
        offs = torch.bincount(ids.reshape(-1), minlength=num_experts).cumsum(0).to(torch.int32)
        gu = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
        gate, up = gu.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
        out = torch.zeros_like(x)
        return out.index_add_(0, token_of, y * w.reshape(-1)[order].unsqueeze(1))

    out: dict[str, Fn] = {
        "tandem": lambda x, ids, w: run_experts(experts, x, ids, w),
        "grouped": forced(0),
        "token_by_token": forced(1 << 30),
        "gathered_bmm": gathered_bmm,
        "grouped_mm": grouped_mm,
    }
    if onednn:
        packed13 = [torch.ops.mkldnn._reorder_linear_weight(w13[e].contiguous(), 8) for e in range(num_experts)]
        packed2 = [torch.ops.mkldnn._reorder_linear_weight(w2[e].contiguous(), 8) for e in range(num_experts)]

        def lin(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")

        def grouped_onednn(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            order, token_of, rows = sorted_pairs(x, ids)
            counts = torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()
            y = torch.empty_like(rows)
            start = 0
            for e, n in enumerate(counts):
                if n:
                    gate, up = lin(rows[start : start + n], packed13[e]).split(inter, dim=-1)
                    y[start : start + n] = lin(F.silu(gate) * up, packed2[e])
                    start += n
            return torch.zeros_like(x).index_add_(0, token_of, y * w.reshape(-1)[order].unsqueeze(1))

        out["grouped_onednn"] = grouped_onednn
    if int8 is not None:
        out["int8"] = lambda x, ids, w: int8(x, ids, w)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small shape and few rounds: a smoke test")
    p.add_argument("--tokens", default="1,8,32,256")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-onednn", action="store_true", help="skip the packed copy (saves the experts' size)")
    p.add_argument("--no-int8", action="store_true")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "moe_experts.json"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hidden, num_experts, top_k, inter = (256, 16, 4, 96) if args.quick else (2048, 128, 8, 768)
    rounds = 2 if args.quick else args.rounds
    tokens = [int(t) for t in args.tokens.split(",")]
    moe = MoEConfig(num_experts, top_k, inter, norm_topk_prob=True, float32_routing_weights=False)
    experts = make_experts(num_experts, hidden, inter)
    int8 = None if args.no_int8 else Int8Experts(experts)
    fns = candidates(experts, int8, onednn=not args.no_onednn)
    g = torch.Generator().manual_seed(1)
    results: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for t in tokens:
            x = torch.randn(t, hidden, generator=g)
            w, ids = route(torch.randn(t, num_experts, generator=g), moe)
            names = [n for n in fns if not (n == "gathered_bmm" and t > 8)]
            reference = fns["grouped"](x, ids, w)
            for n in names:  # a warm-up call each, and a check that all agree
                y = fns[n](x, ids, w)
                tol = 5e-2 if n == "int8" else 1e-4
                if not torch.allclose(y, reference, atol=tol * float(reference.abs().max()), rtol=0):
                    raise SystemExit(f"{n} disagrees with the grouped path at {t} tokens")
            best = dict.fromkeys(names, float("inf"))
            for _ in range(rounds):
                for n in names:
                    start = time.perf_counter()
                    fns[n](x, ids, w)
                    best[n] = min(best[n], time.perf_counter() - start)
            results[str(t)] = {n: round(v * 1e3, 3) for n, v in best.items()}
            active = int(torch.unique(ids).numel())
            row = "  ".join(f"{n} {v * 1e3:.2f} ({v / best['tandem']:.2f}x)" for n, v in best.items())
            print(f"{t:4d} tokens, {active:3d} experts active: {row}", flush=True)
    record = {
        "shape": {"hidden": hidden, "experts": num_experts, "top_k": top_k, "expert_intermediate": inter},
        "dtype": "float32",
        "ms_per_layer": results,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
