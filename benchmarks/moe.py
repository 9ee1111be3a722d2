"""A mixture-of-experts model against the dense model with the same active parameters, offline.

Two random-weight checkpoints, written tensor by tensor (bfloat16 on disk, cached under
`--cache-dir`), with the layer shape of Qwen3-30B-A3B and fewer layers (default 4) so they fit in
memory and build in a minute:

- MoE (`Qwen3MoeForCausalLM`): hidden 2048, 32 query / 4 KV heads of 128, q/k norm, 128 experts of
  intermediate 768, top-8 renormalised; 2.42 GB of float32 experts per layer;
- dense (`Qwen3ForCausalLM`): the same attention with one gated MLP of intermediate 6144 = 8 x 768,
  so a token meets the same number of weights in both (the router's 128 x 2048 aside).

Both have vocabulary 32000 (untied head) and Llama-style tokenizers. Random routers route close to
uniformly, so a batch touches more distinct experts than a trained model's skewed routing would.

Measured with `LLM.generate` (token-id prompts, greedy, `ignore_eos`), one engine per system in its
own process: c=1 decode tok/s (one request; its output tokens after the first over the time since
the first) and c=32 output tok/s (32 requests at once; all output tokens over the wall time).

    python benchmarks/moe.py                          # float32, 4 layers
    python benchmarks/moe.py --quantization int8      # int8 weights, experts included
    python benchmarks/moe.py --dtype bfloat16 --layers 8
    python benchmarks/moe.py --quick                  # tiny shapes, a smoke test (seconds)
    python benchmarks/moe.py --llama-cpp DIR          # also llama.cpp on GGUF conversions

`--llama-cpp DIR`: a llama.cpp source tree with `convert_hf_to_gguf.py`, `gguf-py/` and a build with
`llama-batched-bench` (c=1 and c=32) or `llama-bench` (c=1 only) under build*/bin/ (see
benchmarks/peers/README.md). Both checkpoints are converted (`--gguf-type`, default f16); the
converter's Qwen3-MoE class only knows the byte-level tokenizers of published checkpoints, so the
conversion runs it with the Llama-style vocabulary reader. Anything missing: that part is skipped
with a message. Prints a table and writes benchmarks/results/moe.json (moe_quick.json for --quick).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
for _p in (REPO_ROOT, REPO_ROOT / "benchmarks" / "peers"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_intermediate: int
    layers: int
    vocab: int

    @property
    def dense_intermediate(self) -> int:
        return self.top_k * self.expert_intermediate

    def tag(self, kind: str) -> str:
        return (
            f"{kind}-h{self.hidden}-a{self.heads}-kv{self.kv_heads}-d{self.head_dim}-e{self.experts}"
            f"-k{self.top_k}-i{self.expert_intermediate}-l{self.layers}-v{self.vocab}"
        )

    def params(self) -> dict[str, int]:
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        expert = 3 * self.hidden * self.expert_intermediate
        embed = 2 * self.vocab * self.hidden
        return {
            "moe_total": embed + self.layers * (attn + self.experts * expert + self.experts * self.hidden),
            "moe_active": embed + self.layers * (attn + self.top_k * expert + self.experts * self.hidden),
            "dense_total": embed + self.layers * (attn + 3 * self.hidden * self.dense_intermediate),
        }


FULL = Shape(2048, 32, 4, 128, 128, 8, 768, 4, 32000)
QUICK = Shape(128, 4, 2, 32, 16, 4, 64, 2, 512)


def build_checkpoint(out: Path, shape: Shape, kind: str, tokenizer: Path, seed: int = 0) -> Path:
    """config.json, tokenizer and random bfloat16 weights (one safetensors file per layer)."""
    import torch
    from safetensors.torch import save_file

    if (out / "model.safetensors.index.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in tokenizer.iterdir():
        shutil.copy(f, tmp / f.name)
    g = torch.Generator().manual_seed(seed)
    h, d = shape.hidden, shape.head_dim

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * 0.02).to(torch.bfloat16)

    weight_map: dict[str, str] = {}

    def write(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    write(
        "embed.safetensors",
        {
            "model.embed_tokens.weight": rand(shape.vocab, h),
            "lm_head.weight": rand(shape.vocab, h),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        },
    )
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        t = {
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(shape.heads * d, h),
            p + "self_attn.k_proj.weight": rand(shape.kv_heads * d, h),
            p + "self_attn.v_proj.weight": rand(shape.kv_heads * d, h),
            p + "self_attn.o_proj.weight": rand(h, shape.heads * d),
            p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
        }
        if kind == "moe":
            t[p + "mlp.gate.weight"] = rand(shape.experts, h)
            for e in range(shape.experts):
                q = f"{p}mlp.experts.{e}."
                t[q + "gate_proj.weight"] = rand(shape.expert_intermediate, h)
                t[q + "up_proj.weight"] = rand(shape.expert_intermediate, h)
                t[q + "down_proj.weight"] = rand(h, shape.expert_intermediate)
        else:
            t[p + "mlp.gate_proj.weight"] = rand(shape.dense_intermediate, h)
            t[p + "mlp.up_proj.weight"] = rand(shape.dense_intermediate, h)
            t[p + "mlp.down_proj.weight"] = rand(h, shape.dense_intermediate)
        write(f"layer-{i:03d}.safetensors", t)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=1))
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if kind == "moe" else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if kind == "moe" else "qwen3",
        "hidden_size": h,
        "intermediate_size": shape.dense_intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": d,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    if kind == "moe":
        # Both names of the expert count: transformers writes num_local_experts, converters read num_experts.
        config.update(
            num_experts=shape.experts,
            num_local_experts=shape.experts,
            num_experts_per_tok=shape.top_k,
            moe_intermediate_size=shape.expert_intermediate,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(out)
    return out


def ensure_tokenizer(cache: Path, vocab: int) -> Path:
    out = cache / f"tokenizer-llama-v{vocab}"
    if not (out / "tokenizer.json").is_file():
        from make_checkpoint import llama_style_tokenizer

        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        llama_style_tokenizer(vocab, tmp)
        tmp.rename(out)
    return out


# -- one Tandem engine (run in a child process) -----------------------------------------------


def run_tandem(args: argparse.Namespace) -> dict[str, Any]:
    import random

    from tandem import LLM, SamplingParams

    rng = random.Random(args.seed)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]

    def prompt() -> dict[str, list[int]]:
        return {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]}

    start = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=max(2048, args.input_len),
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_model_len=args.input_len + args.output_len + 16,
    )
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt()], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    one = llm.generate([prompt()], params, use_tqdm=False)[0]
    m = one.metrics
    assert m is not None and m.first_token_time is not None and m.last_token_time is not None
    decode = (len(one.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)
    ttft = m.first_token_time - m.arrival_time
    batch = [prompt() for _ in range(args.concurrency)]
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "load_s": round(load_s, 1),
        "c1_decode_tok_s": round(decode, 2),
        "c1_ttft_s": round(ttft, 3),
        f"c{args.concurrency}_output_tok_s": round(tokens / wall, 2),
        f"c{args.concurrency}_wall_s": round(wall, 2),
    }


def tandem_child(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable, __file__, "--child", str(model), "--dtype", args.dtype,
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--concurrency", str(args.concurrency), "--seed", str(args.seed),
    ]  # fmt: skip
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"Tandem on {model} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- llama.cpp (optional) ---------------------------------------------------------------------

# Runs llama.cpp's converter with the Llama-style vocabulary reader for the Qwen3 classes: their
# default reader only accepts the byte-level BPE tokenizers of published Qwen checkpoints. The
# converter is one file in older llama.cpp, a `conversion` package with a class lookup in newer.
_CONVERT = """
import sys
sys.path[:0] = [sys.argv.pop(1), sys.argv.pop(1)]
import convert_hf_to_gguf as c

def llama_vocab(cls):
    cls.set_vocab = lambda self: self._set_vocab_llama_hf()
    return cls

for name in ("Qwen3MoeModel", "Qwen3Model"):
    if hasattr(c, name):
        llama_vocab(getattr(c, name))
if hasattr(c, "get_model_class"):
    lookup = c.get_model_class
    c.get_model_class = lambda name, *a, **k: llama_vocab(lookup(name, *a, **k))
c.main()
"""


def find_llama_cpp(root: Path) -> tuple[Path, Path | None, Path | None] | str:
    converter = root / "convert_hf_to_gguf.py"
    if not converter.is_file():
        return f"no convert_hf_to_gguf.py in {root}"
    text = "".join(f.read_text(errors="ignore") for f in [converter, *sorted(root.glob("conversion/*.py"))])
    if "Qwen3MoeForCausalLM" not in text:
        return "this llama.cpp's GGUF converter does not know Qwen3MoeForCausalLM"
    if "_set_vocab_llama_hf" not in text:
        return "this llama.cpp's converter has no Llama-style vocabulary reader"
    bins = sorted(root.glob("build*/bin"))
    batched = next((b / "llama-batched-bench" for b in bins if (b / "llama-batched-bench").is_file()), None)
    bench = next((b / "llama-bench" for b in bins if (b / "llama-bench").is_file()), None)
    if batched is None and bench is None:
        return f"no llama-batched-bench or llama-bench under {root}/build*/bin"
    return converter, batched, bench


def convert(root: Path, model: Path, outtype: str) -> Path:
    out = model.with_name(f"{model.name}-{outtype}.gguf")
    if not out.is_file():
        cmd = [sys.executable, "-c", _CONVERT, str(root), str(root / "gguf-py"), str(model)]
        proc = subprocess.run(
            [*cmd, "--outtype", outtype, "--outfile", str(out)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"GGUF conversion failed: {proc.stderr[-2000:]}")
    return out


def run_llama_cpp(
    gguf: Path, batched: Path | None, bench: Path | None, args: argparse.Namespace
) -> dict[str, Any]:
    threads = str(args.threads or os.cpu_count() or 1)
    if batched is not None:
        c = args.concurrency
        ctx = str(c * (args.input_len + args.output_len) + 256)
        cmd = [
            str(batched), "-m", str(gguf), "-t", threads, "-tb", threads, "-c", ctx, "-b", "2048",
            "-ub", "512", "-npp", str(args.input_len), "-ntg", str(args.output_len), "-npl", f"1,{c}",
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows = {}
        for line in out.splitlines():
            cells = [x.strip() for x in line.strip().strip("|").split("|")]
            if len(cells) == 10 and re.fullmatch(r"\d+", cells[2]):
                rows[int(cells[2])] = [float(x) for x in cells]
        # columns: PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s
        return {
            "c1_decode_tok_s": rows[1][7],
            f"c{c}_output_tok_s": round(c * args.output_len / rows[c][8], 2),
            "tool": "llama-batched-bench",
        }
    assert bench is not None
    cmd = [str(bench), "-m", str(gguf), "-t", threads, "-p", "0", "-n", str(args.output_len), "-o", "json"]
    runs = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return {"c1_decode_tok_s": round(runs[0]["avg_ts"], 2), "tool": "llama-bench (no c=32)"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes and lengths: a smoke test")
    p.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {FULL.layers})")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None, choices=[None, "int8"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 64)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=str(REPO_ROOT / "benchmarks" / ".cache"))
    p.add_argument("--llama-cpp", default=None, help="llama.cpp source tree with a build (optional)")
    p.add_argument("--gguf-type", default="f16", help="convert_hf_to_gguf.py --outtype (f32, f16, q8_0)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    default_len = (16, 8) if args.quick else (128, 64)
    args.input_len = args.input_len or default_len[0]
    args.output_len = args.output_len or default_len[1]
    if args.child:
        args.model = args.child
        print(json.dumps(run_tandem(args)))
        return

    base = QUICK if args.quick else FULL
    shape = Shape(**{**asdict(base), "layers": args.layers or base.layers})
    cache = Path(args.cache_dir)
    start = time.perf_counter()
    tokenizer = ensure_tokenizer(cache, shape.vocab)
    models = {kind: build_checkpoint(cache / shape.tag(kind), shape, kind, tokenizer) for kind in ("moe", "dense")}
    gc.collect()
    print(f"checkpoints ready in {time.perf_counter() - start:.0f} s: {', '.join(str(m) for m in models.values())}")
    params = shape.params()
    print(
        f"MoE {params['moe_total'] / 1e6:.1f}M parameters, {params['moe_active'] / 1e6:.1f}M active per token; "
        f"dense {params['dense_total'] / 1e6:.1f}M"
    )
    c = args.concurrency
    results: dict[str, dict[str, Any]] = {}
    for kind, model in models.items():
        results[f"tandem-{kind}"] = tandem_child(model, args)
        print(f"tandem-{kind}: {results[f'tandem-{kind}']}", flush=True)
    llama_note = None
    if args.llama_cpp:
        found = find_llama_cpp(Path(args.llama_cpp))
        if isinstance(found, str):
            llama_note = f"llama.cpp skipped: {found}"
        else:
            _, batched, bench = found
            try:
                for kind, model in models.items():
                    gguf = convert(Path(args.llama_cpp), model, args.gguf_type)
                    results[f"llamacpp-{args.gguf_type}-{kind}"] = run_llama_cpp(gguf, batched, bench, args)
                    print(f"llamacpp-{kind}: {results[f'llamacpp-{args.gguf_type}-{kind}']}", flush=True)
            except (RuntimeError, subprocess.CalledProcessError, KeyError, ValueError) as exc:
                llama_note = f"llama.cpp skipped: {exc}"
    else:
        llama_note = "llama.cpp skipped: no --llama-cpp DIR given"
    if llama_note:
        print(llama_note)

    print(f"\n| system | c=1 decode tok/s | c={c} output tok/s |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r.get('c1_decode_tok_s', '-')} | {r.get(f'c{c}_output_tok_s', '-')} |")
    moe, dense = results["tandem-moe"], results["tandem-dense"]
    print(
        f"\nTandem MoE / dense: c=1 {moe['c1_decode_tok_s'] / dense['c1_decode_tok_s']:.2f}x, "
        f"c={c} {moe[f'c{c}_output_tok_s'] / dense[f'c{c}_output_tok_s']:.2f}x"
    )
    record = {
        "shape": asdict(shape),
        "parameters": params,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "concurrency": c,
        "threads": args.threads,
        "results": results,
        "llama_cpp_note": llama_note,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }
    out = Path(args.out or REPO_ROOT / "benchmarks" / "results" / ("moe_quick.json" if args.quick else "moe.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
