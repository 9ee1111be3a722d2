"""Offline throughput: Tandem (continuous batching) vs transformers `generate` (static batching).

Both systems run the same random-weight checkpoint in fp32 on the same seeded, mixed-length workload
(token-id prompts cut from tokenized Python stdlib sources, greedy, `ignore_eos`, a fixed number of
output tokens per prompt). Prints a table with the Tandem/HF ratio and writes every figure as JSON.

    .venv/bin/python benchmarks/throughput.py              # ~125M-param Llama, 32 prompts
    .venv/bin/python benchmarks/throughput.py --quick      # tiny model, 4 prompts: a smoke test
    .venv/bin/python benchmarks/throughput.py --model PATH # an existing checkpoint

Without `--model`, the checkpoint and its byte-level BPE tokenizer are built once and cached under
`--cache-dir` (default `benchmarks/.cache/`).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
BOS_ID, EOS_ID = 1, 2


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int

    @property
    def tag(self) -> str:
        return (
            f"llama-h{self.hidden_size}-i{self.intermediate_size}-l{self.num_hidden_layers}"
            f"-a{self.num_attention_heads}-kv{self.num_key_value_heads}-v{self.vocab_size}"
            f"-p{self.max_position_embeddings}"
        )


@dataclass(frozen=True)
class Preset:
    shape: ModelShape
    corpus_bytes: int  # stdlib text the tokenizer is trained on (and prompts are cut from)
    num_prompts: int
    min_input_len: int
    max_input_len: int
    min_output_len: int
    max_output_len: int
    hf_batch_size: int


FULL = Preset(
    # ~125M parameters: 2 x 24.6M (untied embeddings + lm_head) + 12 x 6.3M (layers).
    shape=ModelShape(768, 2048, 12, 12, 4, 32000, 2048),
    corpus_bytes=16_000_000,  # all of the stdlib (~11 MB on 3.11): enough to fill a 32000 vocab
    num_prompts=32,
    min_input_len=16,
    max_input_len=512,
    min_output_len=32,
    max_output_len=128,
    hf_batch_size=8,
)
QUICK = Preset(
    shape=ModelShape(64, 128, 2, 4, 2, 512, 512),
    corpus_bytes=200_000,
    num_prompts=4,
    min_input_len=8,
    max_input_len=64,
    min_output_len=8,
    max_output_len=16,
    hf_batch_size=2,
)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class RunResult:
    wall_time_s: float
    outputs: list[list[int]]
    extra: dict[str, Any]


# -- checkpoint ---------------------------------------------------------------------------------


def stdlib_texts(max_bytes: int) -> list[str]:
    """Python stdlib sources in a fixed order (tests and vendored packages left out), up to max_bytes."""
    lib = Path(os.__file__).parent
    skip = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "__pycache__"}
    texts: list[str] = []
    total = 0
    for path in sorted(lib.rglob("*.py")):
        if skip.intersection(path.relative_to(lib).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not texts:
        raise RuntimeError(f"found no Python sources under {lib}")
    return texts


def build_tokenizer(out: Path, vocab_size: int, texts: list[str]) -> int:
    """Train a byte-level BPE tokenizer on `texts`, save it to `out`, return its vocabulary size."""
    from tandem.checkpoints.bpe import train_bpe_tokenizer

    return len(train_bpe_tokenizer(texts, vocab_size, out, SPECIAL_TOKENS))


def build_checkpoint(out: Path, shape: ModelShape, corpus_bytes: int, seed: int) -> None:
    """A random-weight LlamaForCausalLM plus a tokenizer trained on stdlib sources, written to `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok_vocab = build_tokenizer(tmp, shape.vocab_size, stdlib_texts(corpus_bytes))
    if tok_vocab > shape.vocab_size:
        raise RuntimeError(f"tokenizer has {tok_vocab} tokens, more than the model's {shape.vocab_size}")
    torch.manual_seed(seed)
    config = LlamaConfig(**asdict(shape), bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def ensure_checkpoint(cache_dir: Path, shape: ModelShape, corpus_bytes: int, seed: int) -> Path:
    out = cache_dir / f"{shape.tag}-c{corpus_bytes}-s{seed}"
    if not (out / "config.json").is_file():
        print(f"building random-weight checkpoint {out} ...", flush=True)
        start = time.perf_counter()
        build_checkpoint(out, shape, corpus_bytes, seed)
        print(f"built in {time.perf_counter() - start:.1f} s", flush=True)
    return out


def read_model_config(path: Path) -> dict[str, Any]:
    cfg = json.loads((path / "config.json").read_text())
    keys = [
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
    ]
    return {k: cfg.get(k) for k in keys}


# -- workload -----------------------------------------------------------------------------------


def corpus_token_ids(model_path: Path, corpus_bytes: int, vocab_size: int) -> tuple[list[int], int]:
    """Stdlib text tokenized with the checkpoint's own tokenizer (ids outside the model vocab dropped),
    and the tokenizer's vocabulary size."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    encoded = tok(stdlib_texts(min(corpus_bytes, 1_000_000)), add_special_tokens=False)["input_ids"]
    return [t for ids in encoded for t in ids if 0 <= t < vocab_size], len(tok)


def make_workload(
    corpus: list[int],
    num_prompts: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> Workload:
    rng = random.Random(seed)
    if len(corpus) < input_range[1]:
        raise RuntimeError(f"tokenized corpus has {len(corpus)} tokens, fewer than {input_range[1]}")
    prompts, output_lens = [], []
    for _ in range(num_prompts):
        n = rng.randint(*input_range)
        start = rng.randrange(len(corpus) - n + 1)
        prompts.append(corpus[start : start + n])
        output_lens.append(rng.randint(*output_range))
    return Workload(prompts, output_lens)


# -- the two systems ----------------------------------------------------------------------------


def run_tandem(model_path: Path, work: Workload, engine_args: dict[str, Any]) -> RunResult:
    from tandem import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=str(model_path), dtype="float32", **engine_args)
    load_s = time.perf_counter() - start
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": work.prompts[0][:16]}], warm, use_tqdm=False)

    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    stats = getattr(llm.engine, "stats", None)
    steps_before = getattr(stats, "num_steps", None)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps_after = getattr(stats, "num_steps", None)

    outputs = [list(o.outputs[0].token_ids) for o in outs]
    extra: dict[str, Any] = {
        "load_time_s": load_s,
        "engine_args": {"dtype": "float32", **engine_args},
        "num_kv_blocks_allocated": getattr(llm.engine, "num_blocks", None),
        "engine_steps": None if steps_before is None else steps_after - steps_before,
    }
    del llm
    gc.collect()
    return RunResult(wall, outputs, extra)


def hf_batches(work: Workload, batch_size: int) -> list[list[int]]:
    """Prompt indices sorted by input length, cut into static batches."""
    order = sorted(range(len(work.prompts)), key=lambda i: len(work.prompts[i]))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def hf_generate_batch(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> Any:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return out[:, width:]


def run_hf(model_path: Path, work: Workload, batch_size: int) -> RunResult:
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    # Like Tandem's ignore_eos: EOS may be generated but does not stop (min_new_tokens only masks EOS
    # logits while an eos_token_id is set, which would change greedy picks, so unset it).
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = (
            model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else 0
        )
    pad_id = int(pad_id[0] if isinstance(pad_id, list) else pad_id)
    model.generation_config.eos_token_id = None
    num_params = sum(p.numel() for p in model.parameters())
    hf_generate_batch(model, [work.prompts[0][:16]], 4, pad_id)  # warm-up

    outputs: list[list[int]] = [[] for _ in work.prompts]
    batches = hf_batches(work, batch_size)
    raw_generated = padded_prompt_tokens = 0
    start = time.perf_counter()
    for batch in batches:
        new_tokens = max(work.output_lens[i] for i in batch)
        generated = hf_generate_batch(model, [work.prompts[i] for i in batch], new_tokens, pad_id)
        raw_generated += generated.numel()
        padded_prompt_tokens += len(batch) * max(len(work.prompts[i]) for i in batch)
        for row, i in enumerate(batch):
            outputs[i] = generated[row, : work.output_lens[i]].tolist()
    wall = time.perf_counter() - start

    extra = {
        "load_time_s": load_s,
        "batch_size": batch_size,
        "num_batches": len(batches),
        "raw_generated_tokens": raw_generated,
        "padded_prompt_tokens": padded_prompt_tokens,
        "raw_output_tokens_per_s": raw_generated / wall,
        "num_parameters": num_params,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    del model
    gc.collect()
    return RunResult(wall, outputs, extra)


# -- reporting ----------------------------------------------------------------------------------


def summarize(result: RunResult, work: Workload) -> dict[str, Any]:
    produced = sum(len(o) for o in result.outputs)
    return {
        "wall_time_s": result.wall_time_s,
        "output_tokens": work.output_tokens,
        "output_tokens_produced": produced,
        "total_tokens": work.prompt_tokens + work.output_tokens,
        "output_tokens_per_s": work.output_tokens / result.wall_time_s,
        "total_tokens_per_s": (work.prompt_tokens + work.output_tokens) / result.wall_time_s,
        **result.extra,
    }


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    exact = sum(x == y for x, y in zip(a, b))
    prefix_fracs = []
    for x, y in zip(a, b):
        common = next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix_fracs.append(common / max(len(x), len(y), 1))
    return {
        "num_prompts": len(a),
        "num_exact_match": exact,
        "exact_match_fraction": exact / max(len(a), 1),
        "mean_common_prefix_fraction": sum(prefix_fracs) / max(len(prefix_fracs), 1),
    }


def print_table(tandem: dict[str, Any], hf: dict[str, Any], batch_size: int) -> None:
    rows = [
        ("tandem (continuous batching)", tandem),
        (f"transformers (static batch {batch_size})", hf),
    ]
    header = f"{'system':<34} {'wall s':>8} {'out tok':>8} {'out tok/s':>10} {'total tok/s':>12}"
    print(header)
    print("-" * len(header))
    for name, r in rows:
        print(
            f"{name:<34} {r['wall_time_s']:>8.2f} {r['output_tokens']:>8d} "
            f"{r['output_tokens_per_s']:>10.1f} {r['total_tokens_per_s']:>12.1f}"
        )
    ratio = tandem["output_tokens_per_s"] / hf["output_tokens_per_s"]
    print(
        f"{'ratio tandem / transformers':<34} {hf['wall_time_s'] / tandem['wall_time_s']:>7.2f}x {'':>8} "
        f"{ratio:>9.2f}x {tandem['total_tokens_per_s'] / hf['total_tokens_per_s']:>11.2f}x"
    )
    print(
        f"(transformers generated {hf['raw_generated_tokens']} raw tokens for {hf['output_tokens']} useful: "
        f"{hf['raw_output_tokens_per_s']:.1f} raw tok/s)"
    )


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="existing checkpoint folder (default: build a random Llama)")
    p.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "benchmarks" / ".cache")
    p.add_argument(
        "--result-json", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "throughput.json"
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 4 prompts: a ~15 s smoke test")
    p.add_argument("--num-prompts", type=int, help="default 32 (quick: 4)")
    p.add_argument("--min-input-len", type=int, help="default 16 (quick: 8)")
    p.add_argument("--max-input-len", type=int, help="default 512 (quick: 64)")
    p.add_argument("--min-output-len", type=int, help="default 32 (quick: 8)")
    p.add_argument("--max-output-len", type=int, help="default 128 (quick: 16)")
    p.add_argument("--hf-batch-size", type=int, help="transformers static batch size, default 8 (quick: 2)")
    p.add_argument("--seed", type=int, default=0, help="workload and weight seed")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--num-kv-blocks", type=int, help="Tandem KV blocks (default: enough for every prompt at once)"
    )
    p.add_argument("--threads", type=int, help="torch threads for both systems (default: torch's)")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for name in (
        "num_prompts",
        "min_input_len",
        "max_input_len",
        "min_output_len",
        "max_output_len",
        "hf_batch_size",
    ):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    args.preset = preset
    for name in ("num_prompts", "min_input_len", "min_output_len", "hf_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_input_len < args.min_input_len or args.max_output_len < args.min_output_len:
        p.error("a max length is below its min length")
    return args


def default_kv_blocks(work: Workload, block_size: int) -> int:
    return sum(math.ceil((len(p) + n) / block_size) + 1 for p, n in zip(work.prompts, work.output_lens))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    preset: Preset = args.preset
    built = args.model is None
    model_path = (
        ensure_checkpoint(args.cache_dir, preset.shape, preset.corpus_bytes, args.seed)
        if built
        else args.model
    )
    model_cfg = read_model_config(model_path)
    need = args.max_input_len + args.max_output_len
    if model_cfg["max_position_embeddings"] and need > model_cfg["max_position_embeddings"]:
        raise SystemExit(f"max input + output ({need}) exceeds max_position_embeddings of {model_path}")

    corpus, tokenizer_size = corpus_token_ids(model_path, preset.corpus_bytes, model_cfg["vocab_size"])
    work = make_workload(
        corpus,
        args.num_prompts,
        (args.min_input_len, args.max_input_len),
        (args.min_output_len, args.max_output_len),
        args.seed,
    )
    engine_args: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks or default_kv_blocks(work, args.block_size),
    }
    if args.threads:
        engine_args["num_threads"] = args.threads

    print(
        f"model {model_path} ({'built, random weights' if built else 'given'}): {model_cfg}\n"
        f"workload: {args.num_prompts} prompts, input {args.min_input_len}..{args.max_input_len} "
        f"({work.prompt_tokens} tokens), output {args.min_output_len}..{args.max_output_len} "
        f"({work.output_tokens} tokens), greedy, ignore_eos; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    tandem_run = run_tandem(model_path, work, engine_args)
    print(f"tandem: {tandem_run.wall_time_s:.2f} s", flush=True)
    hf_run = run_hf(model_path, work, args.hf_batch_size)
    print(f"transformers: {hf_run.wall_time_s:.2f} s", flush=True)

    tandem = summarize(tandem_run, work)
    hf = summarize(hf_run, work)
    if tandem["output_tokens_produced"] != work.output_tokens:
        print(
            f"WARNING: tandem produced {tandem['output_tokens_produced']} output tokens, "
            f"{work.output_tokens} were requested",
            flush=True,
        )
    num_params = hf.pop("num_parameters")
    result = {
        "command": [sys.executable, *sys.argv] if argv is None else [sys.executable, __file__, *argv],
        "command_line": shlex.join(sys.argv if argv is None else [__file__, *argv]),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "torch_num_threads": torch.get_num_threads(),
        "model": {
            "path": str(model_path),
            "built_random_weights": built,
            "dtype": "float32",
            "num_parameters": num_params,
            **model_cfg,
            "tokenizer_vocab_size": tokenizer_size,
        },
        "workload": {
            "num_prompts": args.num_prompts,
            "seed": args.seed,
            "input_len_range": [args.min_input_len, args.max_input_len],
            "output_len_range": [args.min_output_len, args.max_output_len],
            "prompt_tokens": work.prompt_tokens,
            "output_tokens": work.output_tokens,
            "input_lens": [len(p) for p in work.prompts],
            "output_lens": work.output_lens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        "tandem": tandem,
        "hf": hf,
        "ratio_tandem_over_hf": {
            "output_tokens_per_s": tandem["output_tokens_per_s"] / hf["output_tokens_per_s"],
            "total_tokens_per_s": tandem["total_tokens_per_s"] / hf["total_tokens_per_s"],
            "speedup_wall_time": hf["wall_time_s"] / tandem["wall_time_s"],
        },
        "greedy_agreement": greedy_agreement(tandem_run.outputs, hf_run.outputs),
    }
    print()
    print(
        f"model: {num_params / 1e6:.1f}M params, {_shape_line(model_cfg)} (tokenizer {tokenizer_size}), fp32, "
        f"{'random weights' if built else model_path}; torch threads {torch.get_num_threads()}"
    )
    print_table(tandem, hf, args.hf_batch_size)
    agree = result["greedy_agreement"]
    print(
        f"greedy outputs identical for {agree['num_exact_match']}/{agree['num_prompts']} prompts "
        f"(mean common prefix {agree['mean_common_prefix_fraction']:.1%})"
    )
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.result_json}")
    return result


def _shape_line(cfg: dict[str, Any]) -> str:
    return (
        f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads "
        f"/ {cfg['num_key_value_heads']} KV heads, intermediate {cfg['intermediate_size']}, "
        f"vocab {cfg['vocab_size']}"
    )


if __name__ == "__main__":
    main()
