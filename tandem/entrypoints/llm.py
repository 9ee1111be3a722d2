"""The offline batch API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any, cast

from tandem.config import EngineConfig
from tandem.engine.chat import check_tools, template_messages
from tandem.engine.llm_engine import LLMEngine, PromptType
from tandem.entrypoints import vllm_flags
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger("tandem.llm")


def default_model_path() -> str:
    from tandem.checkpoints import default_model_path as find

    return find()


class LLM:
    """Generate completions for a batch of prompts with continuous batching.

    Engine arguments are named as in vLLM: `max_model_len`, `max_num_seqs`,
    `max_num_batched_tokens`, `block_size`, `dtype`, `kv_cache_dtype`, `seed`, plus
    `kv_cache_memory` (bytes) or `num_kv_blocks`, `device` ("auto", "cuda", "cpu"),
    `gpu_memory_utilization`, `enforce_eager`, `load_format` ("auto", "dummy") and
    `attention_backend` (docs/gpu.md). vLLM's other arguments are taken as `tandem serve`
    takes their flags (docs/compatibility.md): `trust_remote_code`,
    `disable_log_stats` are accepted and ignored (a warning says so),
    `tensor_parallel_size` must be 1, `enable_chunked_prefill` True, and a not-applicable one (such
    as `cpu_offload_gb`) is a ValueError with the reason. `swap_space` (GiB of host memory for
    preempted requests' KV) and `preemption_mode` ("auto", "swap", "recompute") are vLLM's.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        known = set(EngineConfig.__dataclass_fields__) - {"model"}
        vllm_only = set(vllm_flags.PARTLY_SUPPORTED) | vllm_flags.ignored_engine_arguments()
        unknown = sorted(set(engine_args) - known - vllm_only)
        for name in unknown:
            why = vllm_flags.refusal(name)
            if why is not None:
                raise ValueError(why)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s): {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known | vllm_only))}"
            )
        for note in vllm_flags.check(engine_args, command_line=False):
            logger.warning(note)
        config_args = {k: v for k, v in engine_args.items() if k in known}
        self.engine = LLMEngine(EngineConfig(model=model or default_model_path(), **config_args))
        self._ids = itertools.count()

    def get_stats(self) -> dict[str, Any]:
        """The engine's gauges and counters, each under its metric's name (tandem/core/stats.py:
        `prefix_cache_hits`, `spec_decode_num_accepted_tokens`, `engine_step_seconds`, ...; a
        histogram as value -> times observed), plus `engine_overhead_fraction`,
        `spec_decode_mean_acceptance_length` and `spec_decode_acceptance_rate`."""
        return self.engine.core.snapshot()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer.hf

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or a dict with `prompt` or
        `prompt_token_ids` and optionally `cache_salt` and `tenant`. `priority`
        (one int per prompt, lower runs first) matters under the `priority`
        scheduling policy.
        """
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        )
        # The type checker cannot tell one prompt of token ids from a list of prompts: say which.
        batch = [cast("PromptType", prompts)] if single else list(cast("Sequence[PromptType]", prompts))
        if sampling_params is None:
            params = [SamplingParams()] * len(batch)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(
                    f"got {len(params)} sampling params for {len(batch)} prompts; pass one or one per prompt"
                )
        priorities = list(priority) if priority is not None else [0] * len(batch)
        if len(priorities) != len(batch):
            raise ValueError(f"got {len(priorities)} priorities for {len(batch)} prompts")
        return self._run(batch, params, priorities, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        *,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (one, or a list of them), rendered with the model's
        chat template (or `chat_template`) as the HTTP chat route renders them: content given as
        text parts is joined, assistant tool calls' JSON arguments become objects, `tools` (OpenAI
        tool definitions) and `chat_template_kwargs` reach the template. `continue_final_message`
        leaves the last (assistant) message open for the model to go on with; it needs
        `add_generation_prompt=False`. Tool calls in the output are not parsed (as in vLLM)."""
        if messages and isinstance(messages[0], list):
            conversations = messages
        else:
            conversations = [cast("list[dict[str, Any]]", messages)]
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(
                "chat_template_kwargs must be a dict of template variables, "
                f"got {type(chat_template_kwargs).__name__}"
            )
        tool_defs = check_tools(tools)
        tok = self.engine.tokenizer
        prompts = [
            {
                "prompt_token_ids": tok.apply_chat_template(
                    template_messages(conv),
                    add_generation_prompt,
                    chat_template,
                    tool_defs,
                    continue_final_message,
                    chat_template_kwargs,
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(
        self, prompts: list[PromptType], params: list[SamplingParams], priorities: list[int], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, sp, prio in zip(prompts, params, priorities):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, sp, priority=prio)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step(emit_unfinished=False):
                    results[order[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]
