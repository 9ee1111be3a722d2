"""CPU per generated token of the engine process and of the API process, against how many tokens
the request has generated (issue 42, point 8): flat from 100 to 8000 when a token's work does not
depend on what came before it.

Runs `tandem serve` and streams completions one at a time, each `ignore_eos` with
`max_tokens` = the largest length, with the per-token features whose cost used to grow with the
output: penalties (repetition, frequency, presence), `logprobs=1`, a stop string that never
matches (the detokenizer holds text back for it), seeded sampling. While a stream runs, the CPU
time of both processes (all threads, /proc/PID/task/*/schedstat, in nanoseconds) is read as the
client's token count crosses each window's bounds; a window's CPU over its tokens is the CPU per
token at that length. The windows end at each `--lengths` value and span a tenth of it (at least
50 tokens), so a request's start (HTTP, tokenizing, prefill) falls in none of them.

The model: the embedded default model's context is 2048 tokens, so by default a random-weight
Llama is built on first use (into `--cache-dir`) with the default model's tokenizer and vocabulary
(4096), one layer, hidden size 64, two query heads of 16 dimensions over one KV head, and
`max_position_embeddings` 8448. Attention, the one part of a token's work that must grow with the
context, is then a small part of a step (a 16-dimension head over 8000 positions), so what is
measured is the engine's and the API process's own work per token. `--model PATH` runs another
checkpoint (its context must hold the largest length plus the prompt).

    python benchmarks/per_token_cpu.py                    # 100, 500, 2000, 8000 tokens, 3 requests
    python benchmarks/per_token_cpu.py --quick            # 100 and 800 tokens, 1 request (smoke test)
    python benchmarks/per_token_cpu.py --lengths 100,1000,4000 --repeats 5 --result-json out.json

Prints a table (microseconds of CPU per token per process and window, the median over requests,
and the ratio of the longest window's figure to the shortest's) and writes every figure as JSON
(default benchmarks/results/per_token_cpu.json). The figures need an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tandem.checkpoints import default_model_path  # noqa: E402
from tandem.cpu import cpu_model  # noqa: E402
from tandem.loadgen.server_process import ServerProcess  # noqa: E402

LENGTHS = (100, 500, 2000, 8000)
QUICK_LENGTHS = (100, 800)
# The built model's context: the longest request (8000 tokens) plus its prompt, in whole blocks.
CONTEXT = 8448
# A window spans this fraction of the length it ends at, and at least MIN_WINDOW tokens.
WINDOW_FRACTION = 0.1
MIN_WINDOW = 50
PROMPT = "def fibonacci(n):"
# Never produced by the model in practice; its length makes the detokenizer hold text back.
STOP = "\u00a7never\u00a7stop\u00a7"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_model(out: Path) -> Path:
    """A random-weight Llama with the default model's tokenizer and a CONTEXT-token context."""
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    src = Path(default_model_path())
    base = json.loads((src / "config.json").read_text())
    cfg = transformers.LlamaConfig(
        vocab_size=base["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=CONTEXT,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    tmp = out.with_name(out.name + ".tmp")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(tmp))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            (tmp / name).write_bytes((src / name).read_bytes())
    tmp.rename(out)
    return out


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of a process so far, in nanoseconds (schedstat: finer than the
    clock ticks of /proc/PID/stat, which are 10 ms)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total


def windows(lengths: list[int]) -> list[tuple[int, int]]:
    """(first token, last token) of the window ending at each length."""
    return [(max(1, n - max(MIN_WINDOW, int(n * WINDOW_FRACTION))), n) for n in lengths]


def stream_once(
    server: ServerProcess, engine_pid: int, max_tokens: int, marks: list[int], seed: int
) -> dict[str, Any]:
    """One streamed completion; the two processes' CPU as the client's token count reaches each
    of `marks` (sorted), with the count it had then."""
    body = {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 1.0,
        "seed": seed,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "logprobs": 1,
        "stop": [STOP],
    }
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    api_pid = server.proc.pid
    readings: list[dict[str, int]] = []
    tokens = chunks = 0
    start = {"api": cpu_ns(api_pid), "engine": cpu_ns(engine_pid)}
    pending = list(marks)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                lp = choice.get("logprobs") or {}
                tokens += len(lp.get("tokens") or [])
            chunks += 1
            while pending and tokens >= pending[0]:
                readings.append({"mark": pending.pop(0), "tokens": tokens, "api_ns": cpu_ns(api_pid),
                                 "engine_ns": cpu_ns(engine_pid)})
    finally:
        conn.close()
    end = {"api": cpu_ns(api_pid), "engine": cpu_ns(engine_pid)}
    return {
        "tokens": tokens,
        "chunks": chunks,
        "readings": readings,
        "api_cpu_s": (end["api"] - start["api"]) / 1e9,
        "engine_cpu_s": (end["engine"] - start["engine"]) / 1e9,
    }


def per_token(run: dict[str, Any], window: tuple[int, int]) -> dict[str, float]:
    """Microseconds of CPU per token in a window, for each process."""
    at = {r["mark"]: r for r in run["readings"]}
    a, b = at[window[0]], at[window[1]]
    n = b["tokens"] - a["tokens"]
    if n <= 0:
        raise RuntimeError(f"no tokens between the readings of window {window}")
    return {
        "tokens": n,
        "api_us": (b["api_ns"] - a["api_ns"]) / n / 1e3,
        "engine_us": (b["engine_ns"] - a["engine_ns"]) / n / 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the built long-context model)")
    p.add_argument("--lengths", default=None, help=f"comma-separated (default {','.join(map(str, LENGTHS))})")
    p.add_argument("--repeats", type=int, default=None, help="streamed requests (default 3; --quick 1)")
    p.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    p.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, one request")
    p.add_argument("--cache-dir", default=str(REPO_ROOT / "benchmarks" / ".cache" / "per_token_cpu"))
    p.add_argument("--result-json", default=str(REPO_ROOT / "benchmarks" / "results" / "per_token_cpu.json"))
    args = p.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(",")) if args.lengths else list(
        QUICK_LENGTHS if args.quick else LENGTHS
    )
    repeats = args.repeats or (1 if args.quick else 3)
    built = args.model is None
    model = Path(args.model) if args.model else build_model(Path(args.cache_dir) / f"llama-1l-{CONTEXT}")
    wins = windows(lengths)
    marks = sorted({m for w in wins for m in w})
    max_tokens = lengths[-1]
    server_args = ["--served-model-name", "m", "--num-threads", str(args.threads), "--max-num-seqs", "4"]
    server_args += ["--max-model-len", str(CONTEXT if built else max_tokens + 64)]
    runs = []
    with ServerProcess(model, *server_args, startup_timeout=600) as server:
        engine = server.engine_pid
        stream_once(server, engine, 256, [], seed=0)  # warm-up: kernels, first-use paths
        for r in range(repeats):
            run = stream_once(server, engine, max_tokens, marks, seed=1 + r)
            if run["tokens"] != max_tokens:
                raise RuntimeError(f"the stream carried {run['tokens']} tokens, not {max_tokens}")
            runs.append(run)
        server.stop()
    figures = []
    for w in wins:
        each = [per_token(run, w) for run in runs]
        figures.append(
            {
                "length": w[1],
                "window": list(w),
                "api_us_per_token": statistics.median(e["api_us"] for e in each),
                "engine_us_per_token": statistics.median(e["engine_us"] for e in each),
                "runs": each,
            }
        )
    first, last = figures[0], figures[-1]
    ratio = {
        proc: last[f"{proc}_us_per_token"] / first[f"{proc}_us_per_token"]
        if first[f"{proc}_us_per_token"] > 0
        else float("nan")
        for proc in ("api", "engine")
    }
    result = {
        "command_line": shlex.join([sys.executable, *sys.argv]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "model": "built: 1 layer, hidden 64, 2x16-dim heads, 1 KV head, vocab 4096, "
        f"context {CONTEXT}, random weights" if built else str(model),
        "server_args": server_args,
        "quick": args.quick,
        "repeats": repeats,
        "lengths": lengths,
        "workload": {"prompt": PROMPT, "stop": STOP, "penalties": [1.1, 0.1, 0.1], "logprobs": 1,
                     "temperature": 1.0, "ignore_eos": True, "stream": True},
        "windows": figures,
        "ratio_longest_over_shortest": ratio,
        "requests": [{k: v for k, v in run.items() if k != "readings"} for run in runs],
    }
    print(f"CPU per generated token (us), median of {repeats} streamed request(s), model {result['model']}")
    print(f"{'length':>8} {'window':>13} {'API process':>12} {'engine':>10}")
    for f in figures:
        window = f"{f['window'][0]}-{f['window'][1]}"
        print(f"{f['length']:>8} {window:>13} {f['api_us_per_token']:>12.1f} {f['engine_us_per_token']:>10.1f}")
    print(f"longest / shortest: API process {ratio['api']:.2f}, engine {ratio['engine']:.2f}")
    out = Path(args.result_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
