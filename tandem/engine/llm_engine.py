"""The in-process engine: front end (tokenize, detokenize) and engine core in one process."""

from __future__ import annotations

from tandem.checkpoints.resolve import resolve_engine_config
from tandem.config import EngineConfig, ModelConfig
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.scheduler import Scheduler
from tandem.core.stats import EngineCounters
from tandem.engine.core import EngineCore
from tandem.engine.processor import InputProcessor, OutputProcessor, PromptType
from tandem.engine.tokenizer import Tokenizer
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        # A pulled model's name or a GGUF file becomes the folder read below.
        self.config = config = resolve_engine_config(config)
        ModelConfig.from_pretrained(config.model)  # a bad checkpoint folder fails here, clearly
        self.tokenizer = Tokenizer(config.tokenizer or config.model)
        extra_eos = () if self.tokenizer.eos_token_id is None else (self.tokenizer.eos_token_id,)
        self.core = EngineCore(config, extra_eos)
        self.inputs = InputProcessor(
            self.tokenizer, self.core.limits, config.structured_outputs_check_timeout_s
        )
        self.outputs = OutputProcessor(self.tokenizer)

    # Views of the core, for tests, benchmarks and metrics.
    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def kv(self) -> KVCacheManager:
        return self.core.kv

    @property
    def counters(self) -> EngineCounters:
        return self.core.counters

    @property
    def model_config(self) -> ModelConfig:
        return self.core.model_config

    @property
    def num_blocks(self) -> int:
        return self.core.num_blocks

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if request_id in self.outputs.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        req, text = self.inputs.process(
            request_id, prompt, params, arrival_time, priority, tenant, cache_salt
        )
        self.core.add_request(req)
        self.outputs.add(req, text)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_requests(ids)
        self.outputs.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self, emit_unfinished: bool = True) -> list[RequestOutput]:
        """Run one scheduling step; return outputs of the requests it advanced.

        With `emit_unfinished=False` only finished requests are returned (the
        offline path), sparing a per-step copy of every running output.
        """
        outputs, stops, failed = self.outputs.process(self.core.step(), emit_unfinished)
        for request_id, index, reason in stops:
            self.core.stop_sample(request_id, index, reason)
        self.core.abort_requests(failed)
        return outputs
