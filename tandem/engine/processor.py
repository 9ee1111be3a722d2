"""The front end's halves of a request: text in (tokenize, validate) and text out (detokenize, stop, logprobs)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.core.limits import EngineLimits, check_cache_salt
from tandem.core.step_io import SampledLogprobs
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.messages import EngineCoreRequest, SampleOutput
from tandem.engine.token_controls import resolve as resolve_token_controls
from tandem.engine.tokenizer import Tokenizer, check_text
from tandem.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tandem.structured.checker import GrammarChecker

PromptType = str | list[int] | dict[str, Any]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A prompt text longer than this many characters per token of max_model_len cannot fit whatever
# it tokenizes to (times the longest token's length: normalization may shorten text a little).
PROMPT_CHARS_SLACK = 2

logger = logging.getLogger("tandem.engine")


class InputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, limits: EngineLimits, grammar_check_timeout_s: float | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.grammar_check_timeout_s = grammar_check_timeout_s
        self._checker: GrammarChecker | None = None
        self._checker_lock = threading.Lock()
        # Prompt texts longer than this are refused by length, before any tokenization.
        self.max_prompt_chars = PROMPT_CHARS_SLACK * tokenizer.max_token_chars * limits.max_model_len

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
        cache_salt: str | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Tokenize and validate; raise ValueError naming the problem. Returns the request and prompt text."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize(prompt)
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt", cache_salt)
            tenant = prompt.get("tenant", tenant)
        for name, value in (("cache_salt", cache_salt), ("tenant", tenant)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        check_cache_salt(cache_salt)
        if isinstance(priority, bool) or not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be a signed 64-bit integer, got {priority!r}")
        if not ids:
            raise ValueError("the prompt is empty")
        if params.truncate_prompt_tokens is not None:
            keep = params.truncate_prompt_tokens
            keep = self.limits.max_model_len if keep == -1 else keep
            if len(ids) > keep:
                # The prompt text no longer matches the ids: echo decodes them instead.
                ids, text = ids[-keep:], None
        if params.uses_token_controls or params.bad_words:
            params = resolve_token_controls(
                params, lambda w: self.tokenizer.encode(w, add_special_tokens=False), self.limits.vocab_size
            )
        max_tokens = self.limits.max_tokens_for(len(ids), params.max_tokens)
        self.limits.check(ids, max_tokens, params.n, params.stop_ids)
        self.check_constraints(params)
        req = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            tenant=tenant,
            cache_salt=cache_salt,
        )
        return req, text

    @property
    def checker(self) -> GrammarChecker:
        """Where structured-output specs are compiled before they are queued (started on first use)."""
        with self._checker_lock:
            if self._checker is None:
                from tandem.structured.checker import GrammarChecker

                eos = self.limits.eos_token_ids
                if not eos and self.tokenizer.eos_token_id is not None:
                    eos = (self.tokenizer.eos_token_id,)
                self._checker = GrammarChecker(
                    self.tokenizer.path, self.limits.vocab_size, eos, self.grammar_check_timeout_s
                )
            return self._checker

    def check_constraints(self, params: SamplingParams) -> None:
        """Refuse constraints no output can satisfy, and a structured-output spec that does not
        compile (compiled in a check process: tandem/structured/checker.py)."""
        banned = [w[0] for w in params.bad_words_token_ids or () if len(w) == 1]
        allowed = params.allowed_token_ids
        if params.structured_outputs is not None:
            self.checker.check(params.structured_outputs, allowed, banned)
        elif allowed is not None and banned and set(allowed) <= set(banned):
            raise ValueError("allowed_token_ids: every allowed token is one of the bad_words: nothing could be generated")

    def close(self) -> None:
        if self._checker is not None:
            self._checker.close()

    def check_prompt_text(self, text: str) -> None:
        """Refuse a prompt text that cannot fit the context whatever it tokenizes to, or that is
        not valid Unicode, before spending time on tokenizing it."""
        self.check_length(len(text), "the prompt")
        check_text(text, "the prompt")

    def check_length(self, num_chars: int, what: str) -> None:
        """Refuse `num_chars` characters of prompt text (`what`) that cannot fit in max_model_len."""
        if num_chars > self.max_prompt_chars:
            raise ValueError(
                f"{what} ({num_chars} characters) cannot fit in max_model_len "
                f"({self.limits.max_model_len} tokens)"
            )

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            self.check_prompt_text(prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, list):
            ids, text = prompt, None
        else:
            raise ValueError(
                f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
            )
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return text, list(ids)


@dataclass(slots=True)
class _Sample:
    """Front-end state of one output sequence."""

    index: int
    detok: IncrementalDetokenizer
    # Every token so far (a request resumed elsewhere is sent them again).
    token_ids: list[int] = field(default_factory=list)
    # Every token's logprobs so far; under RequestOutputKind.DELTA only those not yet handed out.
    logprobs: list[dict[int, Logprob]] | None = None
    # Tokens handed out in delta outputs so far.
    num_sent: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: list[_Sample]
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    finished_time: float | None = None
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # in a delta output

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def fail(self, message: str, when: float) -> None:
        """End every sample that is still running with finish reason "error"."""
        self.error = message
        self.finished_time = when
        for s in self.samples:
            if s.finish_reason is None:
                s.finish_reason = "error"


class OutputProcessor:
    """Turns the core's token deltas into `RequestOutput`s; finds stop strings."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, _RequestGroup] = {}

    def add(self, req: EngineCoreRequest, prompt_text: str | None) -> None:
        params = req.params
        backend = self.tokenizer.backend
        samples = [
            _Sample(
                index=i,
                detok=IncrementalDetokenizer(backend, req.prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        self.groups[req.request_id] = _RequestGroup(
            req.request_id,
            prompt_text,
            req.prompt_token_ids,
            params,
            req.arrival_time,
            samples,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.groups.pop(rid, None)

    def process(
        self, updates: list[SampleOutput], emit_unfinished: bool = True
    ) -> tuple[list[RequestOutput], list[tuple[str, int, str]], list[str]]:
        """Apply a step's deltas. Returns the outputs to emit, the samples to stop (id, index, stop
        string), and the requests this front end failed (the core must abort them).

        A request whose text processing raises fails alone (its output carries the error); the
        other requests of the step are processed as usual."""
        now = time.monotonic()
        touched: dict[str, _RequestGroup] = {}
        stops: list[tuple[str, int, str]] = []
        failed: list[str] = []
        for up in updates:
            group = self.groups.get(up.request_id)
            if group is None:
                continue
            if up.error is not None:
                group.fail(up.error, up.finished_time or now)
                touched[group.request_id] = group
                continue
            sample = group.samples[up.index]
            if sample.finish_reason is not None:
                continue  # the front end already ended it (stop string); the core may lag a step
            touched[group.request_id] = group
            try:
                if up.prompt_logprobs:
                    self._add_prompt_logprobs(group, up.prompt_logprobs_start, up.prompt_logprobs)
                self._apply(group, sample, up, now, stops)
                if group.finished:
                    self._check_prompt_logprobs(group)
            except Exception as exc:
                logger.exception("request %s failed in the front end", group.request_id)
                group.fail(f"{type(exc).__name__}: {exc}", now)
                failed.append(group.request_id)
        outputs = []
        for g in touched.values():
            finished = g.finished
            if finished or (emit_unfinished and g.params.output_kind != RequestOutputKind.FINAL_ONLY):
                outputs.append(self._output(g, finished))
            if finished:
                del self.groups[g.request_id]
        return outputs, stops, failed

    def _apply(
        self, group: _RequestGroup, sample: _Sample, up: SampleOutput, now: float, stops: list[tuple[str, int, str]]
    ) -> None:
        if up.first_scheduled_time is not None and group.first_scheduled_time is None:
            group.first_scheduled_time = up.first_scheduled_time
            group.num_cached_tokens = up.num_cached_tokens
        for k, token in enumerate(up.new_token_ids):
            last = k == len(up.new_token_ids) - 1
            finishing = last and up.finish_reason is not None
            sample.token_ids.append(token)
            sample.token_times.append(now)
            if sample.first_token_time is None:
                sample.first_token_time = up.first_token_time or now
            if sample.logprobs is not None and up.new_logprobs:
                self._add_logprobs(sample, sample.logprobs, token, up.new_logprobs[k])
            # A stop token (EOS or one of stop_token_ids) ends the text without being part of it.
            by_stop_token = finishing and up.finish_reason == "stop" and not isinstance(up.stop_reason, str)
            hit = sample.detok.update(token, decode=not by_stop_token)
            if hit is not None:
                sample.finish_reason, sample.stop_reason = "stop", hit
                if not finishing:
                    stops.append((group.request_id, up.index, hit))
                break
            if finishing:
                sample.detok.flush()
                sample.finish_reason, sample.stop_reason = up.finish_reason, up.stop_reason
        if not up.new_token_ids and up.finish_reason is not None and sample.finish_reason is None:
            # Ended without a new token (its constraints left none to choose).
            sample.detok.flush()
            sample.finish_reason, sample.stop_reason = up.finish_reason, up.stop_reason
        if sample.finish_reason is not None:
            sample.num_preemptions = up.num_preemptions
            group.finished_time = up.finished_time or now

    def _add_prompt_logprobs(self, group: _RequestGroup, start: int, lps: list[SampledLogprobs]) -> None:
        """Append prompt logprobs from prompt token `start` on. Tokens already held are skipped (a
        run resumed elsewhere computes its prompt again); a gap is an error, never a silent hole."""
        held = group.prompt_logprobs
        if held is None:
            return
        if start > len(held):
            raise RuntimeError(f"prompt logprobs from token {start} arrived while {len(held)} are held")
        for j in range(len(held), start + len(lps)):
            held.append(self._entry(group.prompt_token_ids[j], lps[j - start]))

    @staticmethod
    def _check_prompt_logprobs(group: _RequestGroup) -> None:
        held = group.prompt_logprobs
        completed = any(s.finish_reason in ("stop", "length") for s in group.samples)
        if held is not None and completed and len(held) != len(group.prompt_token_ids):
            raise RuntimeError(
                f"the request finished with {len(held)} of {len(group.prompt_token_ids)} prompt logprobs"
            )

    def _add_logprobs(
        self, sample: _Sample, logprobs: list[dict[int, Logprob]], token: int, lp: SampledLogprobs
    ) -> None:
        """Append a token's logprobs to `logprobs` (the sample's list: it keeps them)."""
        logprobs.append(self._entry(token, lp))
        sample.cumulative_logprob += lp.logprob

    def _entry(self, token: int, lp: SampledLogprobs) -> dict[int, Logprob]:
        """One position's logprobs: the top-k alternatives, led by `token` where it is not among them."""
        decode = self.tokenizer.decode_token
        entry = {
            tid: Logprob(val, rank + 1, decode(tid))
            for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs))
        }
        if token not in entry:
            entry = {token: Logprob(lp.logprob, lp.rank, decode(token)), **entry}
        return entry

    def _output(self, group: _RequestGroup, finished: bool) -> RequestOutput:
        delta = group.params.output_kind == RequestOutputKind.DELTA
        completions = [self._delta(s) if delta else self._cumulative(s) for s in group.samples]
        lead = group.samples[0]
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_scheduled_time=group.first_scheduled_time,
            first_token_time=lead.first_token_time,
            last_token_time=lead.token_times[-1] if lead.token_times else None,
            finished_time=group.finished_time if finished else None,
            num_preemptions=sum(s.num_preemptions for s in group.samples),
            num_cached_tokens=group.num_cached_tokens,
            token_times=list(lead.token_times) if finished else [],
            num_generation_tokens=sum(len(s.token_ids) for s in group.samples),
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            error=group.error,
            prompt_logprobs=self._prompt_logprobs(group, finished, delta),
            delta=delta,
        )

    @staticmethod
    def _cumulative(s: _Sample) -> CompletionOutput:
        return CompletionOutput(
            index=s.index,
            text=s.detok.visible_text(s.finish_reason is not None),
            token_ids=list(s.token_ids),
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            logprobs=s.logprobs,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )

    @staticmethod
    def _delta(s: _Sample) -> CompletionOutput:
        """What is new in a sample since its last delta: the logprobs gathered since are handed
        over whole and a fresh list started, so nothing already sent is read again."""
        logprobs = s.logprobs
        if logprobs is not None:
            s.logprobs = []
        new_ids = s.token_ids[s.num_sent :]
        s.num_sent = len(s.token_ids)
        return CompletionOutput(
            index=s.index,
            text=s.detok.take_text(s.finish_reason is not None),
            token_ids=new_ids,
            cumulative_logprob=s.cumulative_logprob if logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )

    @staticmethod
    def _prompt_logprobs(group: _RequestGroup, finished: bool, delta: bool) -> list[dict[int, Logprob] | None] | None:
        """Cumulative outputs carry the prompt logprobs held so far; deltas carry them once, when
        all have arrived (or the request ends without them)."""
        held = group.prompt_logprobs
        if held is None:
            return None
        if not delta:
            return list(held)
        if group.prompt_logprobs_sent or (len(held) < len(group.prompt_token_ids) and not finished):
            return None
        group.prompt_logprobs_sent = True
        return held
