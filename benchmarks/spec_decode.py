"""Speculative decoding: output tokens/s with and without speculation, same run, several concurrencies.

Workloads: `code` (windows of held-out Python stdlib files, where drafts are
often right), `agentic` (turns of an agent over one file: outputs repeat from turn to turn; for a
`--model` with a chat template, an agent's edit turns through it, tandem/loadgen/agentic.py,
answers ending at EOS), `repeat` (a held-out code snippet followed by its own first
quarter again, so continuing it means copying, as in a code edit that
reproduces most of its input: the repetitive case prompt lookup is for) and
`random` (random token prompts, where drafts rarely are right), and for an instruct model `chat`
(user messages of tandem/loadgen/chat_prompts.py's test split through the chat template, answers
ending at EOS, so not `ignore_eos`). For
each concurrency c, `--requests-per-level` requests run through one `generate`
call with `max_num_seqs=c`, greedy, a seeded spread of output lengths (the same for every method)
(`ignore_eos`). Methods: no speculation, n-gram lookup (the engine's default
window, 1-4 tokens), suffix speculation (a tree, or `suffix-chain`) and the draft model, with the
adaptive controller (the default) and, for reference, a fixed `k` (`-fixed`, `-fixed-k`).
Model: the embedded default model and its draft unless `--model/--draft`; `--model
smollm2-135m-instruct` is the pulled real model, its EAGLE/Medusa heads the recipe's (`tandem
train-draft --model smollm2-135m-instruct ...`, written beside the model in the model cache, where
the engine finds them; `--eagle/--medusa DIR` for others).

    python benchmarks/spec_decode.py --result-json benchmarks/results/spec_decode.json
    python benchmarks/spec_decode.py --model smollm2-135m-instruct --workloads chat code \
        --methods off ngram suffix eagle --concurrency 1 4 16 32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def repo_relative(path: str) -> str:
    """Paths inside the repository are recorded relative to it (results are committed)."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else path


def code_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[list[int]]:
    sys.path.insert(0, str(REPO / "tools"))
    from train_default_model import read, stdlib_files

    _, held = stdlib_files()
    rng = random.Random(seed)
    texts = read(held)
    out: list[list[int]] = []
    while len(out) < n:
        ids = tokenizer.encode(rng.choice(texts), add_special_tokens=False)
        if len(ids) > length + 8:
            start = rng.randrange(0, len(ids) - length)
            out.append(ids[start : start + length])
    return out


def repeat_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[list[int]]:
    """A code snippet of 3/4 of `length` tokens, then its first quarter again."""
    body_len = length * 3 // 4
    return [body + body[: length - body_len] for body in code_prompts(tokenizer, n, body_len, seed)]


def agentic_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[list[int]]:
    """An agent's loop over one file: each turn's prompt is a short turn of its own (a quarter of
    `length`: a tool result, an instruction) followed by the same file (the rest), so the model's
    continuations repeat from turn to turn, as an agent re-emitting what it edits: the workload
    suffix speculation is for (what ended requests wrote drafts for the next)."""
    file_len = length * 3 // 4
    (file,) = code_prompts(tokenizer, 1, file_len, seed + 7)
    heads = code_prompts(tokenizer, n, length - file_len, seed)
    return [head + file for head in heads]


def agentic_chat_prompts(tokenizer: Any, n: int, seed: int, output_len: int) -> tuple[list[list[int]], list[int]]:
    """An agent's turns over parts of held-out stdlib files through the chat template
    (tandem/loadgen/agentic.py): each asks for the whole part back after an edit, and the next turn
    shows the part as edited. Each turn may write the part again plus `output_len` tokens (answers
    end at EOS); returns the prompts and those limits."""
    sys.path.insert(0, str(REPO / "tools"))
    from train_default_model import stdlib_files

    from tandem.loadgen.agentic import agentic_prompt_ids, agentic_turns

    _, held = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    # The encodings' codec modules are one boilerplate file many times over: sessions on two of
    # them would draft for each other as no two files of an agent's repository do.
    sources = [
        (str(f.relative_to(root)), f.read_text(encoding="utf-8", errors="replace"))
        for f in held
        if "encodings" not in f.relative_to(root).parts
    ]
    turns = agentic_turns(sources, tokenizer, n, seed)
    return agentic_prompt_ids(tokenizer, turns), [t.part_tokens + output_len for t in turns]


def chat_prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    """Instructions of the chat set's test split (no template or subject the heads trained on)."""
    from tandem.loadgen.chat_prompts import chat_messages, chat_prompt_ids

    return chat_prompt_ids(tokenizer, chat_messages(n, seed, "test"))


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def token_prompts(workload: str, tokenizer: Any, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` tokens of a token-window workload: code, repeat, agentic or random."""
    if workload == "code":
        return code_prompts(tokenizer, n, length, seed)
    if workload == "repeat":
        return repeat_prompts(tokenizer, n, length, seed)
    if workload == "agentic":
        return agentic_prompts(tokenizer, n, length, seed)
    if workload == "random":
        return random_prompts(len(tokenizer), n, length, seed)
    raise ValueError(f"no token-window workload {workload!r}")


def output_lengths(n: int, mean: int, spread: float, seed: int) -> list[int]:
    """Per-request output lengths, uniform in mean * [1 - spread, 1 + spread] (the same for every method).

    Equal lengths make a closed-loop offline run move in lockstep: without speculation every
    request of a wave finishes in the same step and the next wave's prompts run as one large,
    efficient prefill; speculation desynchronizes the finishes, so the same prompts are computed
    a few at a time inside decode steps. That difference (measured at c=64: up to 10%) is an
    artifact of equal lengths, not a cost of speculation, and real traffic does not have it."""
    rng = random.Random(seed + 1)
    lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return [rng.randint(lo, hi) for _ in range(n)]


def run_methods(
    model: str,
    prompts: list[list[int]],
    out_lens: list[int],
    conc: int,
    specs: dict[str, dict | None],
    threads: int | None,
    slice_s: float,
    ignore_eos: bool = True,
) -> dict[str, dict[str, Any]]:
    """All methods' engines at once, each stepped for `slice_s` of wall time in turn (`math.inf`: each
    to the end, one after another); each method's rate is its tokens over the time its own steps took.

    This VM's speed drifts by 10-20% over seconds (identical back-to-back runs: 669-890 tok/s), so
    methods run one after another compare different machines. Taking turns every 50 ms puts every
    method on the same machine: two identical engines measured 0.98-1.02x of each other (at c=4,
    median of 8 repeats within 1%), against 0.94-1.07x with quarter-second turns. The cost is a cold
    cache at the start of each turn (the model re-read, a few ms, the same share for every method)."""
    from tandem import LLM, SamplingParams

    llms = {
        name: LLM(
            model,
            max_num_seqs=conc,
            speculative_config=spec,
            num_threads=threads,
            enable_prefix_caching=False,
        )
        for name, spec in specs.items()
    }
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos) for n in out_lens]
    busy = dict.fromkeys(llms, 0.0)
    outs: dict[str, dict[str, Any]] = {name: {} for name in llms}
    for llm in llms.values():
        llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=4), use_tqdm=False)
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            llm.engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sp)
    active = list(llms)
    while active:
        for name in list(active):
            engine = llms[name].engine
            start = time.perf_counter()
            while engine.has_unfinished_requests() and time.perf_counter() - start < slice_s:
                for out in engine.step(emit_unfinished=False):
                    outs[name][out.request_id] = out
            busy[name] += time.perf_counter() - start
            if not engine.has_unfinished_requests():
                active.remove(name)
    results = {}
    for name, llm in llms.items():
        ordered = [outs[name][f"r{i}"] for i in range(len(prompts))]
        tokens = sum(len(o.outputs[0].token_ids) for o in ordered)
        results[name] = {
            "wall_s": busy[name],
            "output_tokens": tokens,
            "output_tok_s": tokens / busy[name],
            "token_ids": [o.outputs[0].token_ids for o in ordered],
        }
        stats = llm.get_stats()
        # Steps (prefill and decode) against output tokens: what speculation saved, in forwards.
        results[name]["engine_steps"] = stats["engine_steps"]
        if stats["spec_decode_num_drafts"]:
            results[name]["spec"] = {
                key.removeprefix("spec_decode_"): value
                for key, value in stats.items()
                if key.startswith("spec_decode_")
            }
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument(
        "--requests-per-level",
        type=int,
        nargs="+",
        default=None,
        help="requests per concurrency level (default: max(8, 4*c): four waves, so the steady state outweighs the first and last steps)",
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=96, help="mean output tokens per request")
    ap.add_argument(
        "--output-len-spread",
        type=float,
        default=0.5,
        help="output lengths are uniform in output-len * [1 - spread, 1 + spread] (0: all equal)",
    )
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument(
        "--suffix-tokens",
        type=int,
        default=None,
        help="suffix speculation's most draft tokens (tree nodes) a step (default: min(32, 4 * k))",
    )
    ap.add_argument(
        "--suffix-spec-factor",
        type=float,
        default=None,
        help="suffix_decoding_max_spec_factor: draft at most this many tokens per matched token "
        "(default: the engine's, 1.0)",
    )
    ap.add_argument(
        "--agentic",
        choices=["auto", "chat", "tokens"],
        default="auto",
        help="`agentic` workload: turns through the chat template (`chat`), or token windows of "
        "one file (`tokens`); auto: chat for a --model with a chat template, tokens for the embedded "
        "default model (a code model: its template is a stub it was not tuned on)",
    )
    ap.add_argument(
        "--workloads",
        nargs="+",
        default=["repeat", "code", "random"],
        choices=["repeat", "code", "random", "agentic", "chat"],
    )
    ap.add_argument("--methods", nargs="+", default=["off", "ngram", "draft", "draft-fixed-k"])
    ap.add_argument(
        "--eagle", default=None, help="EAGLE head folder (unset: beside the model, as the engine finds it)"
    )
    ap.add_argument("--medusa", default=None, help="Medusa heads folder (unset: beside the model)")
    ap.add_argument(
        "--head-tokens", type=int, default=8, help="EAGLE/Medusa: tree nodes (num_speculative_tokens)"
    )
    ap.add_argument("--tree-topk", type=int, default=4, help="EAGLE/Medusa: children per expanded node")
    ap.add_argument("--tree-depth", type=int, default=6, help="EAGLE/Medusa: the deepest node")
    ap.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="EAGLE/Medusa: tokens the heads' read-out multiplies (unset: the engine's default; 0: all)",
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every method this many times, interleaved, and report the median (machine noise)",
    )
    ap.add_argument(
        "--slice",
        type=float,
        default=0.05,
        help="seconds each method's engine steps before the next takes its turn (0: whole runs in sequence)",
    )
    ap.add_argument("--result-json", type=Path, default=REPO / "benchmarks" / "results" / "spec_decode.json")
    args = ap.parse_args()

    from tandem.checkpoints import DEFAULT_MODEL_DIR, default_model_path
    from tandem.checkpoints.resolve import resolve_model

    model = args.model or default_model_path()
    draft = args.draft or str(DEFAULT_MODEL_DIR.parent / "default-draft")
    from transformers import AutoTokenizer

    # A pulled name or a GGUF file reads its tokenizer from the folder prepared from it.
    tok = AutoTokenizer.from_pretrained(resolve_model(model).path)
    tree = {
        "num_speculative_tokens": args.head_tokens,
        "tree_topk": args.tree_topk,
        "tree_depth": args.tree_depth,
    }
    if args.draft_vocab_size is not None:
        tree["draft_vocab_size"] = args.draft_vocab_size
    eagle = {"method": "eagle", **tree} | ({"model": args.eagle} if args.eagle else {})
    medusa = {"method": "medusa", **tree} | ({"model": args.medusa} if args.medusa else {})
    suffix_k = args.suffix_tokens or min(32, 4 * args.k)
    suffix: dict[str, Any] = {"method": "suffix", "num_speculative_tokens": suffix_k}
    if args.suffix_spec_factor is not None:
        suffix["suffix_decoding_max_spec_factor"] = args.suffix_spec_factor
    agentic_chat = args.agentic == "chat" or (
        args.agentic == "auto" and args.model is not None and bool(getattr(tok, "chat_template", None))
    )
    methods: dict[str, dict | None] = {
        "off": None,
        # A second engine with speculation off: its ratio to "off" is the run's noise band (two
        # identical engines), against which a method's ratio near 1 is read.
        "off-twin": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        },
        "ngram-fixed-k": {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
            "adaptive": False,
        },
        # Suffix speculation drafts long repeats: four times the chain methods' k, as a tree.
        "suffix": suffix,
        "suffix-fixed": suffix | {"adaptive": False},
        "suffix-chain": suffix | {"suffix_decoding_tree": False},
        # The heads shipped for the default model (`--model` elsewhere: `tandem train-draft` first,
        # the head in the folder beside the model); by default a tree of 8 nodes, the engine's.
        "eagle": eagle,
        "eagle-fixed": eagle | {"adaptive": False},
        "medusa": medusa,
        "medusa-fixed": medusa | {"adaptive": False},
        "draft": {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k},
        "draft-fixed-k": {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": args.k,
            "adaptive": False,
        },
    }
    methods = {name: spec for name, spec in methods.items() if name in args.methods}
    results: list[dict[str, Any]] = []
    print(
        f"{'workload':<8} {'conc':>4} {'method':<14} {'tok/s':>8} {'vs off':>7} {'accept':>7} {'acc len':>7} {'same':>5}"
    )
    for wl in args.workloads:
        for li, conc in enumerate(args.concurrency):
            n = args.requests_per_level[li] if args.requests_per_level else max(8, 4 * conc)
            if wl == "chat":
                prompts = chat_prompts(tok, n, args.seed)
            else:
                prompts = token_prompts(wl, tok, n, args.prompt_len, args.seed)
            out_lens = output_lengths(n, args.output_len, args.output_len_spread, args.seed)
            # Chat answers end at EOS; token windows have no end, so run to their length.
            ignore_eos = not (wl == "chat" or (wl == "agentic" and agentic_chat))
            if wl == "agentic" and agentic_chat:
                prompts, out_lens = agentic_chat_prompts(tok, n, args.seed, args.output_len)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}
            for _ in range(args.repeats):
                if args.slice > 0:  # all methods take turns within the repeat
                    got = run_methods(
                        model, prompts, out_lens, conc, methods, args.threads, args.slice, ignore_eos
                    )
                else:  # one after another, so a slow patch of the machine hits all methods
                    got = {}
                    for name, spec in methods.items():
                        got |= run_methods(
                            model, prompts, out_lens, conc, {name: spec}, args.threads, math.inf, ignore_eos
                        )
                for name in methods:
                    runs[name].append(got[name])
            base = None
            base_name = next(iter(methods))
            for name in methods:
                rates = sorted(x["output_tok_s"] for x in runs[name])
                r = dict(runs[name][0], output_tok_s=rates[len(rates) // 2], all_tok_s=rates)
                if base is None:
                    base = r
                # The median of paired ratios: each repeat's methods ran back to back, so a ratio
                # within one repeat is not moved by the machine's drift between repeats.
                pairs = sorted(
                    a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs[name], runs[base_name])
                )
                ratio = pairs[len(pairs) // 2]
                same = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"])) / len(prompts)
                acc = r.get("spec", {}).get("acceptance_rate", float("nan"))
                acc_len = r.get("spec", {}).get("mean_acceptance_length", float("nan"))
                print(
                    f"{wl:<8} {conc:>4} {name:<14} {r['output_tok_s']:>8.1f} {ratio:>6.2f}x {acc:>7.2f} {acc_len:>7.2f} {same:>5.2f}",
                    flush=True,
                )
                results.append(
                    {
                        "workload": wl,
                        "concurrency": conc,
                        "method": name,
                        "num_requests": n,
                        "output_tok_s": r["output_tok_s"],
                        "output_tok_s_repeats": r["all_tok_s"],
                        "wall_s": r["wall_s"],
                        "ratio_vs_off": ratio,
                        "ratio_vs_off_repeats": pairs,
                        "greedy_identical_fraction": same,
                        "output_tokens": r["output_tokens"],
                        "engine_steps": r["engine_steps"],
                        "spec": r.get("spec"),
                    }
                )
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(
        json.dumps(
            {
                "command": shlex.join(sys.argv),
                "model": repo_relative(model),
                "draft": repo_relative(draft),
                "k": args.k,
                "suffix": suffix,
                "heads": {"eagle": eagle, "medusa": medusa},
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "output_len_spread": args.output_len_spread,
                "slice_s": args.slice,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.result_json}")


if __name__ == "__main__":
    main()
