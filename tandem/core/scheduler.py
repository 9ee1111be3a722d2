"""Token-budget continuous batching in vLLM v1's style.

There is no prefill phase and no decode phase. Every request has
`num_computed_tokens` and `num_tokens`; each step hands out at most
`max_num_batched_tokens` tokens over at most `max_num_seqs` requests so they
catch up. Running requests are served first (in admission order), then waiting
ones (front first). A long prompt simply takes several steps (chunked prefill)
and shares them with decodes.

Preemption (recompute): when a running request cannot get KV blocks, a victim
is preempted: its blocks are freed, its computed-token count reset, and it is
put back at the front of the waiting queue. Victim rule: the latest-admitted
running request not yet scheduled this step that is not protected; a request
resumed after preemption is protected until it samples one new token, so it
cannot be thrown out again before making progress. If every candidate is
protected, the request asking for blocks gives way itself; if it is protected
too, it keeps its blocks and waits for a later step (the requests ahead of it,
already served this step, give way or finish first). Only when every running
request is protected and the first one cannot go on does the latest one go.
No new request is admitted in a step that preempted or left a request waiting.
"""

from __future__ import annotations

import time
from collections import deque

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.outputs import RunnerOutput, SchedulerOutput
from tandem.core.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    # -- admission -------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int) -> None:
        """Raise ValueError for a request that could never run, before it is queued."""
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens < 1:
            raise ValueError("the prompt must contain at least one token")
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total} tokens, "
                f"beyond max_model_len ({self.max_model_len})"
            )
        if self.kv.blocks_for(total) > self.kv.num_blocks:
            raise ValueError(
                f"prompt plus max_tokens ({total} tokens) needs {self.kv.blocks_for(total)} KV blocks, "
                f"more than the whole KV cache ({self.kv.num_blocks} blocks of {self.kv.block_size})"
            )
        if n > self.max_num_seqs:
            raise ValueError(f"n ({n}) exceeds max_num_seqs ({self.max_num_seqs})")

    def add_request(self, req: Request) -> None:
        self.check_fits(req.num_prompt_tokens, req.max_tokens, 1 + len(req.pending_children))
        seen: set[str] = set()
        for r in (req, *req.pending_children):
            if r.request_id in self.requests or r.request_id in seen:
                raise ValueError(f"request id {r.request_id!r} is already in use")
            seen.add(r.request_id)
        for r in (req, *req.pending_children):
            self.requests[r.request_id] = r
        self.waiting.append(req)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one step --------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.max_num_batched_tokens
        now = time.monotonic()

        i = 0
        stalled = False
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            scheduled = True
            while not self.kv.allocate_slots(req, n, out.block_copies):
                victim = self._pick_victim(i)
                if victim is None:  # protected: it keeps its blocks and waits for a later step
                    stalled = True
                    scheduled = False
                    i += 1
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                continue  # running[i] is now the next request
            out.requests.append(req)
            out.num_tokens.append(n)
            budget -= n
            i += 1

        seats = sum(r.num_seats for r in self.running)
        while self.waiting and budget > 0 and not out.preempted and not stalled:
            req = self.waiting[0]
            if seats + req.num_seats > self.max_num_seqs:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req, n, out.block_copies):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            seats += req.num_seats
            out.requests.append(req)
            out.num_tokens.append(n)
            budget -= n
        return out

    def _pick_victim(self, i: int) -> Request | None:
        """The request to preempt so that running[i] gets its blocks; None: running[i] waits instead."""
        req = self.running[i]
        for j in range(len(self.running) - 1, i, -1):
            if not self.running[j].protected:
                return self.running[j]
        if not req.protected:
            return req
        if i > 0:
            # running[:i] already ran this step: they sample or give way later, so req need not
            # lose its progress (preempting it here made resumed requests thrash).
            return None
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        req.protected_until_outputs = req.num_output_tokens + 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, fork, stop. Returns requests with new tokens."""
        now = time.monotonic()
        for req, n in zip(sched.requests, sched.num_tokens):
            req.num_computed_tokens += n
        changed: list[Request] = []
        for req in sched.requests:
            token = result.sampled.get(req.request_id)
            if token is None or req.is_finished:
                continue
            family = [req]
            if req.pending_children:
                family += self._fork(req, result)
            for r in family:
                tok = result.sampled[r.request_id]
                self._append(r, tok, now)
                changed.append(r)
        return changed

    def _fork(self, leader: Request, result: RunnerOutput) -> list[Request]:
        children = leader.pending_children
        leader.pending_children = []
        idx = self.running.index(leader) + 1
        for child in children:
            if child.request_id not in result.sampled:
                raise RuntimeError(f"runner sampled no first token for forked request {child.request_id}")
            self.kv.fork(leader, child)
            child.num_computed_tokens = leader.num_computed_tokens
            child.status = RequestStatus.RUNNING
            child.first_scheduled_time = leader.first_scheduled_time
        self.running[idx:idx] = children
        return children

    def _append(self, req: Request, token: int, now: float) -> None:
        req.token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        req.token_times.append(now)
        sp = req.sampling
        num_out = req.num_output_tokens
        # The sampler masks stop tokens while fewer than min_tokens have been produced.
        if num_out > sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                self._finish(req, RequestStatus.FINISHED_STOPPED, None)
                return
            if token in sp.stop_token_ids:
                self._finish(req, RequestStatus.FINISHED_STOPPED, token)
                return
        if num_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self._finish(req, RequestStatus.FINISHED_LENGTH, None)

    # -- ending ----------------------------------------------------------

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus, reason: str | None = None
    ) -> None:
        """End requests from outside the step (stop strings, aborts). Unknown or finished ids are ignored."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            else:  # a pending child of a leader that has not forked yet
                for leader in self.running + list(self.waiting):
                    if req in leader.pending_children:
                        leader.pending_children.remove(req)
            self._finish(req, status, reason, already_removed=True)

    def _finish(
        self, req: Request, status: RequestStatus, reason: int | str | None, already_removed: bool = False
    ) -> None:
        if not already_removed and req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        req.status = status
        req.stop_reason = reason
        req.finished_time = time.monotonic()
        self.kv.free(req)
        for child in req.pending_children:
            child.status = status
            child.finished_time = req.finished_time
            self.requests.pop(child.request_id, None)
            self._finished_ids.append(child.request_id)
        req.pending_children = []
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)
