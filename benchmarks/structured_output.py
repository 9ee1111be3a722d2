"""Offline decode throughput with and without a JSON schema, at one stream and at 32, on the default
model: what structured output costs, and the grammar mask's share of a step.

    python benchmarks/structured_output.py [--dtype float32] [--out benchmarks/results/structured_output.json]

The mask share is the time the engine spends computing token bitmasks (`StructuredOutputManager.
mask_time_s`) over its step time; the throughput ratio also counts applying the mask and advancing
the matchers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from tandem import LLM, SamplingParams
from tandem.sampling_params import StructuredOutputsParams

# Every output this schema allows is longer than the runs' max_tokens, so constrained and plain runs
# decode the same number of tokens in the same number of steps, every row masked at every step.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "role": {"enum": ["reader", "writer", "owner"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
        "bio": {"type": "string", "minLength": 2000, "maxLength": 2000},
    },
    "required": ["name", "role", "tags", "bio"],
    "additionalProperties": False,
}


def run(llm: LLM, concurrency: int, num_requests: int, max_tokens: int, constrained: bool) -> dict[str, Any]:
    sp = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=sp
    )
    prompts = [f"Record {i} as JSON:" for i in range(num_requests)]
    core = llm.engine.core
    mask0, rows0 = core.structured.mask_time_s, core.structured.num_masked_rows
    step0, steps0 = core.counters.engine_step_seconds, core.counters.engine_steps
    start = time.perf_counter()
    outs = []
    for i in range(0, num_requests, concurrency):
        outs += llm.generate(prompts[i : i + concurrency], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    step_s = core.counters.engine_step_seconds - step0
    mask_s = core.structured.mask_time_s - mask0
    return {
        "concurrency": concurrency,
        "constrained": constrained,
        "requests": num_requests,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "steps": core.counters.engine_steps - steps0,
        "step_time_s": step_s,
        "mask_time_s": mask_s,
        "masked_rows": core.structured.num_masked_rows - rows0,
        "mask_fraction_of_step": mask_s / step_s if step_s else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/structured_output.json")
    args = ap.parse_args()

    llm = LLM(dtype=args.dtype, max_num_seqs=32, seed=0)
    # Warm both paths (oneDNN primitives, the grammar backend and this schema's compile).
    run(llm, 32, 32, 8, False)
    run(llm, 32, 32, 8, True)
    results = []
    for concurrency, num_requests in ((1, 2), (32, 32)):
        for constrained in (False, True):
            r = run(llm, concurrency, num_requests, args.max_tokens, constrained)
            results.append(r)
            print(
                f"c={concurrency:<3} {'json schema' if constrained else 'plain':<12} {r['tokens_per_s']:8.1f} tok/s  "
                f"steps {r['steps']:5d}  mask {r['mask_time_s'] * 1e3:8.1f} ms = "
                f"{100 * r['mask_fraction_of_step']:5.2f}% of step time"
            )
    summary = {}
    for concurrency in (1, 32):
        plain, schema = (r for r in results if r["concurrency"] == concurrency)
        summary[f"c{concurrency}"] = {
            "throughput_ratio": schema["tokens_per_s"] / plain["tokens_per_s"],
            "mask_fraction_of_step": schema["mask_fraction_of_step"],
        }
        print(
            f"c={concurrency}: constrained/plain throughput {summary[f'c{concurrency}']['throughput_ratio']:.3f}, "
            f"mask {100 * schema['mask_fraction_of_step']:.2f}% of a step"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dtype": args.dtype, "runs": results, "summary": summary}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
