"""Write the simulator's small sample traces (tandem/sim/samples/), deterministically for a seed.

The real traces cannot be shipped (size, and no downloads here), so these imitate their formats
exactly and their statistics roughly, enough for tests and for trying the simulator:

- azure_conv_sample.csv: Azure's LLM inference trace CSV (TIMESTAMP with .NET's 7 fractional
  digits, ContextTokens, GeneratedTokens), lengths shaped like the 2023 conversation trace (context
  median about 1k tokens, output median about 130, both heavy-tailed), bursty arrivals at ~5/s.
- mooncake_sample.jsonl: Mooncake's JSONL (timestamp in ms, input_length, output_length, hash_ids
  of 512-token blocks, ids numbered in order of first appearance), made of multi-turn chat sessions:
  a turn's prompt is the previous prompt, the previous answer and a new message, so it repeats the
  previous prompt's full blocks, and most sessions open with one of a few shared system prompts.

    python tools/make_sim_samples.py            # rewrites tandem/sim/samples/
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

OUT_DIR = Path(__file__).resolve().parent.parent / "tandem" / "sim" / "samples"
AZURE_START = datetime(2023, 11, 16, 18, 15, 46)
AZURE_START_TICKS = 6805900  # the .6805900 of the first timestamp, in 100 ns ticks
TICKS_PER_S = 10**7
BLOCK = 512  # Mooncake's hash block size


def lognormal_ints(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(np.clip(round(rng.lognormal(np.log(median), sigma)), lo, hi))


def gamma_arrivals(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    """Arrival times from 0: gamma gaps with mean 1/rate, burstier than Poisson for burstiness < 1."""
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def azure_timestamp(seconds: float) -> str:
    """Azure's style: '2023-11-16 18:15:46.6805900', 7 fractional digits."""
    ticks = AZURE_START_TICKS + round(seconds * TICKS_PER_S)
    whole, frac = divmod(ticks, TICKS_PER_S)
    moment = AZURE_START + timedelta(seconds=whole)
    return f"{moment:%Y-%m-%d %H:%M:%S}.{frac:07d}"


def azure_rows(rng: np.random.Generator, n: int) -> list[str]:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t in gamma_arrivals(rng, n, rate=5.0, burstiness=0.5):
        context = lognormal_ints(rng, median=1000, sigma=0.9, lo=8, hi=8000)
        generated = lognormal_ints(rng, median=130, sigma=0.8, lo=1, hi=1000)
        rows.append(f"{azure_timestamp(float(t))},{context},{generated}")
    return rows


@dataclass
class Session:
    last_arrival_s: float
    input_length: int
    output_length: int
    hash_ids: list[int] = field(default_factory=list)


@dataclass
class HashIds:
    """Mooncake numbers blocks in order of first appearance."""

    next_id: int = 0

    def fresh(self, count: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        return ids


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def mooncake_rows(rng: np.random.Generator, n: int) -> list[str]:
    ids = HashIds()
    # Shared system prompts of 1-4 blocks; their ids are given on first use, like all others.
    system_sizes = [int(rng.integers(1, 5)) for _ in range(5)]
    system_prompts: dict[int, list[int]] = {}
    sessions: list[Session] = []
    rows = []
    for t in gamma_arrivals(rng, n, rate=5.0, burstiness=0.7):
        t = float(t)
        # A user answers after reading and typing: a session continues only after some think time.
        ready = [s for s in sessions if t - s.last_arrival_s > 3.0]
        if ready and rng.random() < 0.6:
            s = ready[int(rng.integers(len(ready)))]
            message = lognormal_ints(rng, median=300, sigma=1.0, lo=5, hi=4000)
            length = min(s.input_length + s.output_length + message, 60_000)
            # The previous prompt's full blocks recur; its last partial block is now completed by
            # new tokens, so it hashes differently.
            reused = s.hash_ids[: s.input_length // BLOCK]
            s.hash_ids = reused + ids.fresh(blocks(length) - len(reused))
        else:
            prefix: list[int] = []
            if rng.random() < 0.8:
                k = int(rng.integers(len(system_sizes)))
                if k not in system_prompts:
                    system_prompts[k] = ids.fresh(system_sizes[k])
                prefix = system_prompts[k]
            message = lognormal_ints(rng, median=2500, sigma=1.0, lo=20, hi=16_000)
            length = len(prefix) * BLOCK + message
            s = Session(t, length, 0, prefix + ids.fresh(blocks(length) - len(prefix)))
            sessions.append(s)
        s.last_arrival_s, s.input_length = t, length
        s.output_length = lognormal_ints(rng, median=250, sigma=0.9, lo=1, hi=2000)
        rows.append(
            json.dumps(
                {
                    "timestamp": round(t * 1000),
                    "input_length": length,
                    "output_length": s.output_length,
                    "hash_ids": s.hash_ids,
                }
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=300)
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    azure = azure_rows(np.random.default_rng([args.seed, 0]), args.num_requests)
    mooncake = mooncake_rows(np.random.default_rng([args.seed, 1]), args.num_requests)
    (args.out_dir / "azure_conv_sample.csv").write_text("\n".join(azure) + "\n", encoding="utf-8")
    (args.out_dir / "mooncake_sample.jsonl").write_text("\n".join(mooncake) + "\n", encoding="utf-8")
    print(f"wrote {len(azure) - 1} + {len(mooncake)} requests to {args.out_dir}")


if __name__ == "__main__":
    main()
