"""The `tandem` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from tandem.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="KV cache size in bytes")
    g.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides memory)"
    )
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = [
        "tokenizer",
        "dtype",
        "seed",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "kv_cache_memory",
        "num_kv_blocks",
        "num_threads",
    ]
    return {n: getattr(args, n) for n in names}


def _generate(args: argparse.Namespace) -> int:
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.entrypoints.llm import default_model_path

    params = SamplingParams(
        n=1,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
        seed=args.sampling_seed,
    )
    engine = LLMEngine(EngineConfig(model=args.model or default_model_path(), **engine_kwargs(args)))
    if args.chat:
        prompt: Any = {
            "prompt_token_ids": engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}]
            )
        }
    else:
        prompt = args.prompt
        sys.stdout.write(args.prompt)
    engine.add_request("cli", prompt, params)
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed to stdout")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
