"""Token-budget continuous batching in vLLM v1's style.

There is no prefill phase and no decode phase. Every request has
`num_computed_tokens` and `num_tokens`; each step hands out at most
`max_num_batched_tokens` tokens over at most `max_num_seqs` requests so they
catch up. Running requests are served first (in admission order), then waiting
ones (front first). A long prompt simply takes several steps (chunked prefill)
and shares them with decodes.

Preemption: when a running request cannot get KV blocks, a victim is
preempted and put back at the front of the waiting queue, by recompute (its
blocks are freed and its computed-token count reset: it computes everything
again when resumed) or by swap (its blocks are copied to the KV manager's host
swap space and freed, status SWAPPED: resumed before the requests behind it,
it gets fresh blocks the runner copies its KV back into, and goes on where it
was). `PreemptionCost` (core/preemption.py) picks, per victim, whichever moves
or computes less by its constants; without swap space every preemption
recomputes. Victim rule: the latest-admitted
running request not yet scheduled this step that is not protected; a request
resumed after preemption is protected until it samples one new token, so it
cannot be thrown out again before making progress. If every candidate is
protected, the request asking for blocks gives way itself; if it is protected
too, it keeps its blocks and waits for a later step (the requests ahead of it,
already served this step, give way or finish first). Only when every running
request is protected and the first one cannot go on does the latest one go.
No new request is admitted in a step that preempted or left a request waiting.
Under the `priority` policy, running requests are served (and given up) in
priority order, and a waiting request may preempt running requests of lower
priority (larger `priority` value) to get the seats and blocks it needs (only
requests the admission order puts after it, and only when that can make room).

A running request can be paused (`pause`): it leaves the batch but keeps its blocks and seat, while
its KV is copied to another instance; `unpause` puts it back. The other end `adopt`s a request
whose KV arrived from elsewhere straight into the running set, in seats it reserved beforehand
(`reserved_seats`), so a hand-over never waits for admission.

Waiting requests are admitted in the order `core/policy.py` gives (tenant
fair share, then starved requests, then the policy). With prefix caching, an
admitted request first takes its longest cached prefix and computes only the
rest; finished and preempted requests leave their computed blocks in the cache.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tandem.core.draft_tree import DraftTree
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.limits import check_fits
from tandem.core.policy import (
    FCFS,
    LPM,
    PRIORITY,
    SchedulingConfig,
    TenantLedger,
    admission_key,
    order_waiting,
)
from tandem.core.preemption import RECOMPUTE, PreemptionCost
from tandem.core.request import NO_ALLOWED_TOKEN, PLACEHOLDER, Request, RequestStatus
from tandem.core.stats import EngineCounters
from tandem.core.step_io import RunnerOutput, SchedulerOutput, SpecPlan


class SpecHook(Protocol):
    """What the scheduler needs from speculative decoding (tandem.spec.planner.SpecPlanner)."""

    # Asked first each step: a plan that drafts nothing, made in advance (None: ask `plan`).
    def leased(self, running: list[Request]) -> SpecPlan | None: ...

    def plan(self, decoding: list[Request], other_tokens: int, max_model_len: int) -> SpecPlan: ...

    def propose(self, req: Request, k: int) -> list[int] | DraftTree | None: ...

    # Called for each request that verified drafts, before its new tokens are appended.
    def observe(self, req: Request, num_draft: int, num_accepted: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Preemption:
    """One victim choice, told to `Scheduler.on_preempt` before it is carried out."""

    # Whom the room is for: a running request short of KV blocks, or, with `for_priority`, the waiting
    # request the priority policy puts first.
    request: Request
    # The request to preempt; None when `request` (running, protected) waits for a later step instead.
    victim: Request | None
    # Priority preemption: `victim` runs at a lower priority than the waiting `request`.
    for_priority: bool = False


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        config: SchedulingConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        spec: SpecHook | None = None,
        on_preempt: Callable[[Preemption], None] | None = None,
        preemption: PreemptionCost | None = None,
        counters: EngineCounters | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.config = config or SchedulingConfig()
        self.ledger = TenantLedger(self.config)
        self.clock = clock
        self.spec = spec
        # Told of every victim choice before it is carried out, so a caller (the scheduler tests) can
        # check the victim rules from outside; it must leave the scheduler's state alone.
        self.on_preempt = on_preempt
        # Preempted requests go to the front, new ones to the back; `_admission_order` decides.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.paused: list[Request] = []
        # Seats promised to requests whose KV is on its way here (see `adopt`).
        self.reserved_seats = 0
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        # Swap or recompute per victim (None: always recompute; so too without swap space).
        self.preemption = preemption
        # The engine's counters (tandem/core/stats.py, shared with the engine core): the scheduler
        # counts prefix-cache lookups and preemptions there.
        self.counters = counters if counters is not None else EngineCounters()

    # -- admission -------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int) -> None:
        """Raise ValueError for a request that could never run, before it is queued."""
        check_fits(
            num_prompt_tokens,
            max_tokens,
            n,
            max_model_len=self.max_model_len,
            block_size=self.kv.block_size,
            num_blocks=self.kv.num_blocks,
            max_num_seqs=self.max_num_seqs,
        )

    def add_request(self, req: Request) -> None:
        self.check_fits(req.num_prompt_tokens, req.max_tokens, 1 + len(req.pending_children))
        quota = self.config.quota(req.tenant)
        if quota.max_running is not None and req.num_seats > quota.max_running:
            raise ValueError(
                f"n ({req.num_seats}) exceeds the quota of tenant {req.tenant!r} "
                f"({quota.max_running} running sequences)"
            )
        if quota.max_blocks is not None and self._max_blocks(req) > quota.max_blocks:
            raise ValueError(
                f"the request may hold {self._max_blocks(req)} KV blocks, beyond the quota of tenant "
                f"{req.tenant!r} ({quota.max_blocks} blocks)"
            )
        seen: set[str] = set()
        for r in (req, *req.pending_children):
            if r.request_id in self.requests or r.request_id in seen:
                raise ValueError(f"request id {r.request_id!r} is already in use")
            seen.add(r.request_id)
        for r in (req, *req.pending_children):
            self.requests[r.request_id] = r
        self.waiting.append(req)

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not ended: running, or paused while their KV moves elsewhere."""
        return len(self.running) + len(self.paused)

    @property
    def seats_taken(self) -> int:
        """Sequence slots held: running and paused requests (with their pending forks) and reservations."""
        return (
            sum(r.num_seats for r in self.running)
            + sum(r.num_seats for r in self.paused)
            + self.reserved_seats
        )

    # -- hand-over between instances -------------------------------------

    def pause(self, req: Request) -> None:
        """Take a running request out of the batch; it keeps its blocks and its seat."""
        if req.status != RequestStatus.RUNNING:
            raise RuntimeError(f"pause of request {req.request_id} in state {req.status.name}")
        self.running.remove(req)
        self.paused.append(req)
        req.status = RequestStatus.PAUSED

    def unpause(self, req: Request) -> None:
        if req.status != RequestStatus.PAUSED:
            raise RuntimeError(f"unpause of request {req.request_id} in state {req.status.name}")
        self.paused.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING

    def adopt(self, req: Request) -> None:
        """Run a request whose blocks and `num_computed_tokens` were filled elsewhere (it holds its
        blocks already; its seats were reserved). Its pending forks come with it."""
        for r in (req, *req.pending_children):
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        for r in (req, *req.pending_children):
            self.requests[r.request_id] = r
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one step --------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = self._schedule_step()
        # The bytes the runner will move (not those a swap-in takes back from the prefix cache).
        self.counters.swap_out_bytes += len(out.swap_out) * self.kv_block_bytes
        self.counters.swap_in_bytes += len(out.swap_in) * self.kv_block_bytes
        return out

    def _schedule_step(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.max_num_batched_tokens
        now = self.clock()
        self.ledger.decay()
        order = self._admission_order(now)
        if self.config.policy == PRIORITY:
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))
            if order:
                self._preempt_for(order[0], out, now)
        num_priority_preempted = len(out.preempted)
        if num_priority_preempted:
            # Victims rejoin the queue, after the request they made room for: order them now, with the
            # service counts `_preempt_for` compared (the running requests are charged below).
            order = self._admission_order(now)

        drafts = self._plan_drafts(out, budget, order) if self.spec is not None else {}
        i = 0
        stalled = False
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_placeholders and self._ends_by_length(req):
                i += 1  # its token in flight ends it whatever its value: no step to waste on it
                continue
            owed = req.num_tokens - req.num_computed_tokens
            k = min(drafts.get(req.request_id, 0), budget - owed) if owed < budget else 0
            n = min(owed, budget) + k
            scheduled = True
            while not self.kv.allocate_slots(req, n, out.block_copies):
                if k > 0:  # drafts are optional: drop them rather than wait or preempt for their blocks
                    n, k = n - k, 0
                    continue
                if self._release_kept(out):
                    continue
                victim = self._pick_victim(i)
                if self.on_preempt is not None:
                    self.on_preempt(Preemption(req, victim))
                if victim is None:  # protected: it keeps its blocks and waits for a later step
                    stalled = True
                    scheduled = False
                    i += 1
                    break
                self._preempt(victim, out)
                out.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                continue  # running[i] is now the next request
            if k > 0:
                out.num_draft[req.request_id] = k
                if req.request_id in out.draft_tokens:
                    out.draft_tokens[req.request_id] = out.draft_tokens[req.request_id][:k]
                tree = out.draft_trees.get(req.request_id)
                if tree is not None:
                    out.draft_trees[req.request_id] = tree.prefix(k)
            else:
                out.draft_tokens.pop(req.request_id, None)
                out.draft_trees.pop(req.request_id, None)
            self._schedule(out, req, n)
            budget -= n
            i += 1
        for rid in [rid for rid in out.draft_tokens if rid not in out.num_draft]:
            del out.draft_tokens[rid]
        for rid in [rid for rid in out.draft_trees if rid not in out.num_draft]:
            del out.draft_trees[rid]

        if len(out.preempted) > num_priority_preempted or stalled:
            return out
        while not self.running and order and self.kv.blocks_to_admit(order[0]) > self.kv.num_available:
            if not self._release_kept(out):  # nothing runs to free blocks: swapped requests' kept ones go
                break
        seats = self.seats_taken
        quotas = (
            bool(self.config.tenants)
            or self.config.default_quota.max_running is not None
            or (self.config.default_quota.max_blocks is not None)
        )
        tenant_seats: dict[str | None, int] = defaultdict(int)
        tenant_blocks: dict[str | None, int] = defaultdict(int)
        if quotas:
            for r in self.running:
                tenant_seats[r.tenant] += r.num_seats
                tenant_blocks[r.tenant] += self._max_blocks(r)
        for req in order:
            if budget <= 0 or seats + req.num_seats > self.max_num_seqs:
                break
            if quotas and self._over_quota(req, tenant_seats[req.tenant], tenant_blocks[req.tenant]):
                continue
            first_time = req.first_scheduled_time is None
            if req.status == RequestStatus.SWAPPED:
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self.kv.swap_in(req, n, out.block_copies, out.swap_in):
                    break
                self.counters.num_swap_ins += 1
                matched = 0
            else:
                matched = self.kv.match_prefix(req)
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self.kv.allocate_slots(req, n, out.block_copies):
                    self.kv.free(req, cache=False)
                    req.num_computed_tokens = 0
                    break
            if first_time:
                req.first_scheduled_time = now
                req.num_cached_tokens = matched
                self.counters.prefix_cache_queries += req.num_prompt_tokens
                self.counters.prefix_cache_hits += matched
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seats += req.num_seats
            tenant_seats[req.tenant] += req.num_seats
            tenant_blocks[req.tenant] += self._max_blocks(req)
            self._schedule(out, req, n)
            budget -= n
        return out

    def _plan_drafts(self, out: SchedulerOutput, budget: int, order: list[Request]) -> dict[str, int]:
        """Speculation: draft length per decoding running request; n-gram proposals go into `out`.

        Planned before the queue is admitted, so the plan counts the prompt tokens this step is
        about to admit among the step's other tokens: the step is then not a pure-decode one."""
        spec = self.spec
        if spec is None:
            return {}
        leased = spec.leased(self.running)
        if leased is not None:
            out.spec_plan = leased
            return {}
        decoding = [
            r for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and not r.pending_children
        ]
        other = sum(r.num_tokens - r.num_computed_tokens for r in self.running) - len(decoding)
        other += self._expected_admissions(order)
        out.spec_plan = plan = spec.plan(decoding, min(other, budget), self.max_model_len)
        ks = dict(plan.num_draft)  # n-gram may propose fewer; the plan stays as made
        for r in decoding:
            k = ks.get(r.request_id, 0)
            if not k:
                continue
            proposal = spec.propose(r, k)
            if proposal is not None:  # n-gram, suffix: may find fewer tokens than asked
                ks[r.request_id] = len(proposal)
                if isinstance(proposal, DraftTree):
                    if proposal and not proposal.is_chain:
                        out.draft_trees[r.request_id] = proposal
                    proposal = list(proposal.tokens)
                if proposal:
                    out.draft_tokens[r.request_id] = proposal
        return ks

    def _expected_admissions(self, order: list[Request]) -> int:
        """Tokens of the queued requests this step will likely admit: those that fit in the free
        seats and the available blocks now (tenant quotas and running requests' growth aside)."""
        seats = self.seats_taken
        free = self.kv.num_available
        tokens = 0
        for req in order:
            need = self.kv.blocks_to_admit(req)
            if seats + req.num_seats > self.max_num_seqs or need > free:
                break
            seats += req.num_seats
            free -= need
            tokens += req.num_tokens - req.num_computed_tokens
        return tokens

    def _schedule(self, out: SchedulerOutput, req: Request, n: int) -> None:
        out.requests.append(req)
        out.num_tokens.append(n)
        self.ledger.charge(req.tenant, n)

    def _over_quota(self, req: Request, held_seats: int, held_blocks: int) -> bool:
        """Would admitting `req` take its tenant, already at (held_seats, held_blocks), past its quota?"""
        quota = self.config.quota(req.tenant)
        return (quota.max_running is not None and held_seats + req.num_seats > quota.max_running) or (
            quota.max_blocks is not None and held_blocks + self._max_blocks(req) > quota.max_blocks
        )

    def _max_blocks(self, req: Request) -> int:
        """Blocks the request (with its pending forks) holds at its longest: what a tenant quota counts."""
        return self.kv.blocks_for(req.num_prompt_tokens + req.max_tokens) * req.num_seats

    def _admission_order(self, now: float) -> list[Request]:
        cfg = self.config
        if cfg.policy == FCFS and len({r.tenant for r in self.waiting}) <= 1:
            # Plain FCFS admits strictly in order, so the queue (resumed requests in front, then
            # arrivals) is already oldest first: nothing can starve.
            return list(self.waiting)
        prefix_len = None
        if cfg.policy == LPM and len(self.waiting) <= cfg.lpm_max_queue:
            prefix_len = {r.request_id: self.kv.match_len(r) for r in self.waiting}
        return order_waiting(self.waiting, cfg, self.ledger, now, prefix_len)

    def _preempt_for(self, cand: Request, out: SchedulerOutput, now: float) -> None:
        """Priority policy: preempt lower-priority running requests until `cand` could be admitted.

        Only requests the admission order puts after `cand` are victims: a starved one (or one of a
        tenant owed service) would be readmitted at once, ahead of `cand`, its work lost for nothing.
        Nobody is preempted unless giving up every victim could make room, nor for a request its
        tenant's quota holds back (admission would skip it).
        """
        mine = [r for r in self.running if r.tenant == cand.tenant]
        if self._over_quota(cand, sum(r.num_seats for r in mine), sum(self._max_blocks(r) for r in mine)):
            return
        need_blocks = self.kv.blocks_to_admit(cand)
        key = admission_key(self.config, self.ledger, now, None)
        victims = [
            r for r in self.running if r.priority > cand.priority and not r.protected and key(r) > key(cand)
        ]
        victims.sort(key=lambda r: (r.priority, r.arrival_time))

        def fits(freed_seats: int, freed_blocks: int) -> bool:
            seats = self.seats_taken - freed_seats
            return seats + cand.num_seats <= self.max_num_seqs and need_blocks <= (
                self.kv.num_available + freed_blocks
            )

        if not fits(sum(r.num_seats for r in victims), sum(len(r.block_ids) for r in victims)):
            return
        while victims and not fits(0, 0):
            victim = victims.pop()
            if self.on_preempt is not None:
                self.on_preempt(Preemption(cand, victim, for_priority=True))
            self._preempt(victim, out)
            out.preempted.append(victim)

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

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        if self._swap_out(req, out):
            req.status = RequestStatus.SWAPPED
            self.counters.num_swap_outs += 1
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self.counters.num_recompute_preemptions += 1
        req.num_preemptions += 1
        req.protected_until_outputs = req.num_output_tokens + 1
        self.counters.num_preemptions += 1
        self.waiting.insert(0, req)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block, as the cost model has them (0 without one: no swap then)."""
        return self.preemption.block_bytes if self.preemption is not None else 0

    def _release_kept(self, out: SchedulerOutput) -> bool:
        """Blocks are short: the swapped request that resumes last among those still holding device
        blocks (kept because a running request shared them) gives them up, to the swap space with
        the rest of its KV or, without room there, by going to recompute. False if no swapped
        request holds any. Kept blocks are otherwise held until swap-in, and once their sharers have
        left (or been swapped out too) nothing else would ever free them."""
        holders = [r for r in self.waiting if r.status == RequestStatus.SWAPPED and r.block_ids]
        req = holders[-1] if holders else None
        if req is None:
            return False
        if out.swap_in:
            raise RuntimeError("a swap-out planned after a swap-in in the same step")
        if not self.kv.swap_out_kept(req, out.swap_out):
            host = set(req.host_block_ids)
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            # Copies into its host blocks planned this step are moot now (and the blocks may be reused).
            out.swap_out[:] = [(d, h) for d, h in out.swap_out if h not in host]
        return True

    def _swap_out(self, req: Request, out: SchedulerOutput) -> bool:
        """Swap the victim out if the cost model prefers it and the swap space has room."""
        cost, kv = self.preemption, self.kv
        if cost is None or cost.mode == RECOMPUTE or kv.swap_pool is None or req.num_computed_tokens == 0:
            return False
        if out.swap_in:
            # Swap-in frees its host blocks at once: one reused by a later swap-out would be written
            # before it is read. Victims are all chosen before admission, so this never happens.
            raise RuntimeError("a swap-out planned after a swap-in in the same step")
        kv.cache_computed(req)  # as recompute's free would: the swap plan then sees the cached path
        num_blocks, keep = kv.swap_plan(req)
        # Recompute would compute everything again but a kept prefix the prefix cache holds.
        node_end = getattr(req.prefix_node, "end", 0) if kv.cache is not None else 0
        start = min(keep * kv.block_size, node_end)
        if not cost.swaps(num_blocks, start, req.num_computed_tokens):
            return False
        return kv.swap_out(req, out.swap_out)

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, fork, stop. Returns requests with new tokens."""
        now = self.clock()
        for req, n in zip(sched.requests, sched.num_tokens):
            k = sched.num_draft.get(req.request_id, 0)
            if k:
                # Rewind over rejected drafts: their KV slots stay allocated and are overwritten later.
                accepted = len(result.accepted.get(req.request_id, ()))
                n -= k - accepted
                if self.spec is not None:
                    self.spec.observe(req, k, accepted)
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
                dead = r.request_id in result.dead_ends
                tokens = result.accepted.get(r.request_id, [])
                for tok in tokens if dead else (*tokens, result.sampled[r.request_id]):
                    self._append(r, tok, now)
                    if r.is_finished:
                        break
                if dead and not r.is_finished:
                    self._finish(r, RequestStatus.FINISHED_STOPPED, NO_ALLOWED_TOKEN)
                changed.append(r)
        # After the appends: with accepted drafts, computed KV runs past the tokens known before.
        for req in sched.requests:
            if not req.is_finished:
                self.kv.cache_computed(req)
        return changed

    # -- overlap scheduling (tandem/core/overlap.py) ----------------------------

    def advance(self, sched: SchedulerOutput) -> list[Request]:
        """A step was launched and its tokens are not on the host yet: count its tokens computed now,
        so the next step can be planned, and give each request that samples a PLACEHOLDER token (the
        runner feeds the real one to the next step from the device). Requests that ended since the
        step was planned are left alone: what the step computed for them is dropped. Returns the
        requests given a placeholder, for `resolve`. Drafts, forks and prompt logprobs never come
        here (`sync_reason`)."""
        placed: list[Request] = []
        for req, n in zip(sched.requests, sched.num_tokens):
            if req.is_finished:
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                req.token_ids.append(PLACEHOLDER)
                req.num_placeholders += 1
                placed.append(req)
        return placed

    def resolve(self, placed: list[Request], result: RunnerOutput) -> list[Request]:
        """The launched step's tokens are on the host: each placeholder `advance` gave becomes its
        token, and the stop checks run on it (one step late: the request may be in the step launched
        since, whose token for it `advance` then drops). A request that ended meanwhile (aborted, a
        stop string) gets nothing. Returns the requests with a new token."""
        now = self.clock()
        changed: list[Request] = []
        for req in placed:
            if req.is_finished or not req.num_placeholders:
                continue
            token = result.sampled.get(req.request_id)
            if token is None:
                raise RuntimeError(f"no sampled token for request {req.request_id} in a collected step")
            req.token_ids.pop()
            req.num_placeholders -= 1
            self._append(req, token, now)
            changed.append(req)
        for req in placed:
            if not req.is_finished and req.status == RequestStatus.RUNNING:
                self.kv.cache_computed(req)
        return changed

    def _ends_by_length(self, req: Request) -> bool:
        return req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len

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
        # A stop token ends the request even under min_tokens: the sampler holds stop tokens back
        # there, so it chose one only because nothing else was allowed (a finished grammar).
        if not sp.ignore_eos and token in req.eos_token_ids:
            self._finish(req, RequestStatus.FINISHED_STOPPED, None)
            return
        if token in sp.stop_ids:
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
            elif req.status == RequestStatus.PAUSED:
                self.paused.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            else:  # a pending child of a leader that has not forked yet
                for leader in self.running + self.paused + self.waiting:
                    if req in leader.pending_children:
                        leader.pending_children.remove(req)
            self._finish(req, status, reason, already_removed=True)

    def _finish(
        self, req: Request, status: RequestStatus, reason: int | str | None, already_removed: bool = False
    ) -> None:
        if not already_removed and req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not already_removed and req in self.waiting:
            # Overlap scheduling: a victim preempted while its last token was in flight ends when
            # that token arrives (`resolve`).
            self.waiting.remove(req)
        req.status = status
        req.stop_reason = reason
        req.finished_time = self.clock()
        # Tokens after an early stop inside accepted drafts were computed but are not kept.
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        self.kv.free(req)
        for child in req.pending_children:
            child.status = status
            child.finished_time = req.finished_time
            self.requests.pop(child.request_id, None)
            self._finished_ids.append(child.request_id)
        req.pending_children = []
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)
