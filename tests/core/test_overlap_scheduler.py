"""The scheduler's half of overlap scheduling (tandem/core/overlap.py): placeholders from `advance`,
their tokens and stop checks from `resolve`, one step late; no block left behind."""

from __future__ import annotations

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import PLACEHOLDER, Request, RequestStatus
from tandem.core.scheduler import Scheduler
from tandem.core.step_io import RunnerOutput, SchedulerOutput
from tandem.sampling_params import SamplingParams

EOS = 2


def setup(max_tokens: int = 3, num_blocks: int = 8) -> tuple[Scheduler, KVCacheManager, Request]:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    req = Request("r", [5, 6, 7, 8, 9], SamplingParams(), max_tokens=max_tokens, eos_token_ids=(EOS,))
    s.add_request(req)
    return s, kv, req


def test_a_placeholder_lets_the_next_step_be_planned_and_its_token_lands_in_place():
    s, _, req = setup()
    first = s.schedule()
    placed = s.advance(first)
    assert placed == [req] and req.token_ids[-1] == PLACEHOLDER and req.num_placeholders == 1
    assert req.num_computed_tokens == 5
    second = s.schedule()  # planned before the first step's token is known
    assert second.requests == [req] and second.num_tokens == [1]
    assert s.resolve(placed, RunnerOutput(sampled={"r": 40})) == [req]
    assert req.output_token_ids == [40] and req.num_placeholders == 0
    placed = s.advance(second)
    assert req.token_ids[-2:] == [40, PLACEHOLDER]
    s.resolve(placed, RunnerOutput(sampled={"r": 41}))
    assert req.output_token_ids == [40, 41] and not req.is_finished


def test_a_request_that_stops_with_a_step_in_flight_gets_nothing_from_that_step():
    s, kv, req = setup(max_tokens=10)
    placed = s.advance(s.schedule())
    in_flight = s.schedule()  # the next step is launched before the stop is known
    s.resolve(placed, RunnerOutput(sampled={"r": EOS}))
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [EOS]
    assert s.advance(in_flight) == []  # its token from the step in flight is never placed
    assert req.output_token_ids == [EOS]
    kv.check_invariants()
    assert kv.num_available == kv.num_blocks and not s.running


def test_a_request_sure_to_end_by_length_is_not_scheduled_again():
    s, kv, req = setup(max_tokens=1)
    placed = s.advance(s.schedule())
    assert s.schedule().is_empty  # its one output token is in flight: nothing left to compute
    s.resolve(placed, RunnerOutput(sampled={"r": 40}))
    assert req.status == RequestStatus.FINISHED_LENGTH and req.output_token_ids == [40]
    assert kv.num_available == kv.num_blocks


def test_a_victim_whose_token_was_in_flight_gets_it_and_may_stop_in_the_queue():
    for token, ends in ((EOS, True), (40, False)):
        s, kv, req = setup(max_tokens=10)
        placed = s.advance(s.schedule())
        s._preempt(req, SchedulerOutput())  # as a step planned meanwhile would
        assert req in s.waiting and req.num_computed_tokens == 0
        s.resolve(placed, RunnerOutput(sampled={"r": token}))
        assert req.output_token_ids == [token] and req.num_placeholders == 0
        assert (req in s.waiting) is not ends and req.is_finished is ends
        kv.check_invariants()
        if ends:
            assert kv.num_available == kv.num_blocks and not s.has_unfinished()


def test_an_aborted_request_drops_its_token_in_flight():
    s, kv, _ = setup(max_tokens=10)
    placed = s.advance(s.schedule())
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert s.resolve(placed, RunnerOutput(sampled={"r": 40})) == []
    assert kv.num_available == kv.num_blocks
