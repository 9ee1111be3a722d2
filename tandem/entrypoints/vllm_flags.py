"""vLLM's flags that Tandem takes without implementing them, one table for the command line, the
offline `LLM(...)` keywords and docs/compatibility.md (tests/engine/test_compatibility_flags.py
holds the page's rows equal to `VLLM_FLAGS`):

- "accepted, ignored": parsed, with no effect; a note naming the flag and the reason is written at
  start whenever one is set;
- "not applicable": refused with the reason (`tandem: error: ...`, exit 2; a ValueError from `LLM`).

The flags Tandem implements (its own and vLLM's "supported" ones) are plain argparse arguments in
tandem/entrypoints/cli.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

IGNORED = "accepted, ignored"
NOT_APPLICABLE = "not applicable"
# The parsers an ignored flag is added to: every parser with engine arguments (and an `LLM(...)`
# keyword), or `tandem serve` only.
ENGINE, SERVE = "engine", "serve"


@dataclass(frozen=True)
class VllmFlag:
    """One row of docs/compatibility.md's flag table: its flags (`--lora-*`: every flag that starts
    so; a one-letter flag such as `-O` also with its value attached, `-O3`), status and reason, as
    the page writes them."""

    flags: tuple[str, ...]
    status: str
    reason: str
    # An ignored flag's value type (None: a switch) and the parsers it is on.
    value: type | None = None
    scope: str = ENGINE

    @property
    def message(self) -> str:
        """The reason as the terminal shows it (without the page's code spans)."""
        return self.reason.replace("`", "")

    def matches(self, name: str) -> bool:
        for flag in self.flags:
            if flag.endswith("*"):
                if name.startswith(flag[:-1]):
                    return True
            elif name == flag or (len(flag) == 2 and name.startswith(flag)):
                return True
        return False


def _ignored(flag: str, reason: str, value: type | None = None, scope: str = ENGINE) -> VllmFlag:
    return VllmFlag((flag,), IGNORED, reason, value, scope)


def _refused(*flags: str, reason: str) -> VllmFlag:
    return VllmFlag(flags, NOT_APPLICABLE, reason)


VLLM_FLAGS: tuple[VllmFlag, ...] = (
    _ignored(
        "--trust-remote-code",
        "Tandem runs only its own model code for the supported architectures and never executes code "
        "shipped with a checkpoint",
    ),
    _ignored(
        "--disable-log-requests",
        "Tandem does not log request contents (`--enable-log-requests` is not taken)",
        scope=SERVE,
    ),
    _refused(
        "--pipeline-parallel-size",
        "--data-parallel-size",
        "--data-parallel-*",
        "--distributed-executor-backend",
        "--enable-expert-parallel",
        reason="one process per engine; data parallelism is `--num-instances` (Ray)",
    ),
    _refused("--calculate-kv-scales", reason="scales are computed per token at write time, never per tensor"),
    _refused("--num-gpu-blocks-override", reason="`--num-kv-blocks` is the CPU equivalent"),
    _refused(
        "--cpu-offload-gb",
        "--kv-offloading-*",
        reason="weights stay where the model runs; the KV of preempted requests goes to host memory "
        "with `--swap-space`",
    ),
    _refused(
        "--compilation-config",
        "-O",
        "--cuda-graph-sizes",
        "--max-seq-len-to-capture",
        reason="no torch.compile; on CUDA, decode batches up to `--max-num-seqs` are captured as CUDA graphs "
        "(`--enforce-eager` turns them off); Tandem's CPU kernels are built at first load",
    ),
    _refused(
        "--disable-custom-all-reduce",
        "--worker-cls",
        "--worker-extension-cls",
        reason="no GPU workers or collective communication: one engine process runs the model",
    ),
    _refused(
        "--download-dir",
        "--revision",
        "--code-revision",
        "--tokenizer-revision",
        "--hf-token",
        "--model-loader-extra-config",
        reason="a model is a local safetensors folder or GGUF file, read as its path says "
        "(or a name `tandem pull` fetched)",
    ),
    _refused("--tokenizer-mode", reason="Hugging Face fast tokenizers (`tokenizer.json`) only"),
    _refused("--max-parallel-loading-workers", reason="each engine loads its checkpoint in its own process"),
    _refused(
        "--rope-scaling",
        "--rope-theta",
        "--hf-overrides",
        "--hf-config-path",
        reason="the checkpoint's `config.json` is used as is",
    ),
    _refused("--model-impl", reason="Tandem's own model code only"),
    _refused(
        "--enable-lora", "--lora-*", "--max-lora*", "--max-loras", "--lora-modules", reason="no LoRA adapters"
    ),
    _refused(
        "--limit-mm-per-prompt",
        "--mm-processor-kwargs",
        "--mm-*",
        "--media-io-kwargs",
        "--allowed-local-media-path",
        reason="text-only models",
    ),
    _refused(
        "--task",
        "--runner",
        "--convert",
        "--override-pooler-config",
        reason="generation only (no embedding, scoring or reward models)",
    ),
    _refused(
        "--structured-outputs-config",
        "--guided-decoding-backend",
        "--reasoning-parser",
        reason="structured output always uses llguidance (chosen by measurement: "
        "`benchmarks/grammar_backends.py`); no reasoning parsers",
    ),
    _ignored("--disable-log-stats", "Tandem logs no periodic statistics; `/metrics` serves them"),
    _refused("--max-log-len", reason="request contents are not logged"),
    _refused(
        "--enable-prompt-tokens-details",
        reason="`usage.prompt_tokens_details.cached_tokens` is always reported",
    ),
    _refused(
        "--enable-force-include-usage",
        "--enable-server-load-tracking",
        "--enable-request-id-headers",
        reason="a stream carries usage when its request sets `stream_options.include_usage`; the server's "
        "load is on `/metrics`; no request-id headers",
    ),
    _refused("--disable-fastapi-docs", reason="`/openapi.json` and `/docs` are always served"),
    _refused(
        "--ssl-keyfile",
        "--ssl-certfile",
        "--ssl-ca-certs",
        "--ssl-cert-reqs",
        "--root-path",
        "--uds",
        reason="terminate TLS and path routing in a proxy in front (docs/deployment.md)",
    ),
    _refused(
        "--allowed-origins",
        "--allowed-methods",
        "--allowed-headers",
        "--allow-credentials",
        "--middleware",
        reason="no CORS or custom middleware",
    ),
    _refused(
        "--chat-template-content-format",
        "--trust-request-chat-template",
        "--default-chat-template-kwargs",
        reason="content parts are flattened to text",
    ),
    _refused(
        "--tool-server",
        "--tool-parser-plugin",
        "--exclude-tools-when-tool-choice-none",
        reason="the built-in `--tool-call-parser` parsers only; under `tool_choice` `none` the template "
        "still sees the tools",
    ),
    _refused(
        "--kv-transfer-config",
        "--kv-events-config",
        reason="Tandem's own KV transfer between instances: `--kv-transport`, `--prefill-instances`, "
        "`--decode-instances`",
    ),
    _refused("--stream-interval", reason="every token is streamed"),
)

# vLLM engine arguments Tandem implements but only in part (a ValueError otherwise; see `check`).
PARTLY_SUPPORTED = ("tensor_parallel_size", "enable_chunked_prefill")


def dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_ignored_flags(group: argparse._ArgumentGroup, scope: str) -> None:
    """Add the ignored flags of `scope` to `group`: they parse and do nothing (`check` notes them)."""
    for row in VLLM_FLAGS:
        if row.status != IGNORED or row.scope != scope:
            continue
        (flag,) = row.flags
        help_text = f"accepted and ignored: {row.message}"
        if row.value is None:
            group.add_argument(flag, action="store_true", help=help_text)
        else:
            group.add_argument(flag, type=row.value, default=None, help=help_text)


def not_applicable(arg: str) -> tuple[str, VllmFlag] | None:
    """For a command-line word Tandem's parser does not know: the flag as given and its row, if the
    page calls it not applicable."""
    if not arg.startswith("-"):
        return None
    name = arg.split("=", 1)[0]
    for row in VLLM_FLAGS:
        if row.status == NOT_APPLICABLE and row.matches(name):
            return name, row
    return None


def ignored_engine_arguments() -> frozenset[str]:
    """The `LLM(...)` keywords that are accepted and ignored."""
    return frozenset(
        dest(row.flags[0]) for row in VLLM_FLAGS if row.status == IGNORED and row.scope == ENGINE
    )


def refusal(name: str) -> str | None:
    """Why the `LLM(...)` keyword `name` is refused, if the page calls its flag not applicable."""
    found = not_applicable("--" + name.replace("_", "-"))
    return None if found is None else f"{name} is not applicable in Tandem: {found[1].message}"


def check(values: Mapping[str, Any], command_line: bool) -> list[str]:
    """Refuse the vLLM settings in `values` (keyed by engine-argument name) that Tandem cannot
    honour (ValueError); return a note for each ignored one that is set. `command_line`: name them
    as flags (`--gpu-memory-utilization`), else as `LLM(...)` keywords."""

    def spell(name: str) -> str:
        return "--" + name.replace("_", "-") if command_line else name

    tp = values.get("tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(
            f"{spell('tensor_parallel_size')} must be 1 (got {tp}): Tandem runs a model in one process; "
            f"{'' if command_line else 'tandem serve '}--num-instances runs several engines"
        )
    if values.get("enable_chunked_prefill", True) is False:
        what = "--no-enable-chunked-prefill" if command_line else "enable_chunked_prefill=False"
        raise ValueError(f"{what}: Tandem always chunks long prefills under the token budget")
    gpu = values.get("gpu_memory_utilization")
    is_number = isinstance(gpu, (int, float)) and not isinstance(gpu, bool)
    if gpu is not None and not (is_number and 0.0 < gpu <= 1.0):
        raise ValueError(f"{spell('gpu_memory_utilization')} must be in (0, 1], got {gpu!r}")
    notes = []
    for row in VLLM_FLAGS:
        name = dest(row.flags[0])
        if row.status == IGNORED and values.get(name) not in (None, False):
            notes.append(f"{spell(name)} is accepted and ignored: {row.message}")
    return notes
