"""Dispatch policies over instance reports (pure Python: no Ray, no engine)."""

from __future__ import annotations

import pytest

from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import Dispatcher
from tandem.core.block_pool import BlockPool
from tandem.core.prefix_cache import PrefixCache, prefix_block_hashes
from tandem.engine.messages import EngineCoreRequest, Stats
from tandem.sampling_params import SamplingParams

BS = 4


def req(rid: str, prompt: list[int], max_tokens: int = 8, n: int = 1, priority: int = 0, salt=None):
    return EngineCoreRequest(
        rid,
        prompt,
        SamplingParams(n=n, max_tokens=max_tokens),
        max_tokens,
        0.0,
        priority=priority,
        cache_salt=salt,
    )


def report(prefix_hashes=None, num_blocks=100) -> Stats:
    return Stats(0, 0, 0.0, num_blocks=num_blocks, prefix_hashes=prefix_hashes)


def test_round_robin_cycles_over_live_instances():
    d = Dispatcher(ClusterConfig(num_instances=3, dispatch_policy="round_robin"), [100] * 3, BS)
    assert [d.choose(req(str(i), [1]), {0, 1, 2}) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert {d.choose(req("x", [1]), {0, 2}) for _ in range(4)} == {0, 2}
    with pytest.raises(ValueError, match="no engine instance"):
        d.choose(req("y", [1]), set())


def test_least_load_counts_future_kv_demand_and_releases_it():
    d = Dispatcher(ClusterConfig(num_instances=2, dispatch_policy="least_load"), [100, 100], BS)
    big = req("big", [1] * 40, max_tokens=200)  # 60 blocks
    d.routed(big, d.choose(big, {0, 1}))
    small = [req(f"s{i}", [1] * 4, max_tokens=4) for i in range(10)]  # 2 blocks each
    chosen = []
    for r in small:
        i = d.choose(r, {0, 1})
        d.routed(r, i)
        chosen.append(i)
    assert chosen == [1] * 10  # the instance holding the big request is avoided until it evens out
    d.release("big")
    assert d.choose(req("next", [1]), {0, 1}) == 0
    # n samples and high priority count more.
    assert Dispatcher(ClusterConfig(), [100], BS).instances[0].load == 0
    d2 = Dispatcher(ClusterConfig(num_instances=2), [100, 100], BS)
    d2.routed(req("a", [1] * 4, max_tokens=4, n=3), 0)
    d2.routed(req("b", [1] * 4, max_tokens=4, priority=-1), 1)
    assert d2.instances[0].demand == 6 and d2.instances[1].demand == 2 * ClusterConfig().high_priority_weight


def test_least_load_gives_equally_loaded_instances_turns():
    """Requests that each end before the next arrives leave every instance idle: they go round the
    instances rather than all to the lowest index, and a dead one is skipped."""
    d = Dispatcher(ClusterConfig(num_instances=3, dispatch_policy="least_load"), [100] * 3, BS)
    chosen = []
    for i in range(6):
        r = req(f"r{i}", [1] * 8)
        chosen.append(d.choose(r, {0, 1, 2}))
        d.routed(r, chosen[-1])
        d.release(r.request_id)
    assert chosen == [0, 1, 2, 0, 1, 2]
    assert [d.choose(req("x", [1]), {0, 2}) for _ in range(4)] == [0, 2, 0, 2]


def test_prefix_aware_follows_the_cached_prefix_within_the_balance_bound():
    cfg = ClusterConfig(num_instances=2, dispatch_policy="prefix_aware", balance_abs_threshold=4)
    d = Dispatcher(cfg, [100, 100], BS)
    system = list(range(10, 42))  # 8 blocks
    # Instance 1 reports the system prompt cached (as its prefix cache summarises it).
    pool = BlockPool(16)
    cache = PrefixCache(pool, BS)
    cache.insert(system, pool.allocate(8), None)
    d.observe(1, report(cache.block_hashes(1000)))
    assert cache.block_hashes(1000)[:8] == prefix_block_hashes([*system, 1, 2], BS, None)[:8]
    assert d.choose(req("a", [*system, 7, 7, 7]), {0, 1}) == 1
    # Another tenant's salt never matches.
    assert d.choose(req("b", [*system, 7], salt="t"), {0, 1}) == 0
    # A prompt dispatched to instance 0 counts as cached there before any report says so.
    other = list(range(100, 132))
    d.routed(req("c", other), 0)
    assert d.choose(req("d", [*other, 5]), {0, 1}) == 0
    # Out of balance (6 requests in flight against 1: more than 4 more, and over 1.5 times as
    # many): the instance with the prefix is passed over.
    for i in range(5):
        d.routed(req(f"load{i}", [1] * 4, max_tokens=4), 1)
    assert d.choose(req("e", [*system, 9]), {0, 1}) == 1  # 5 against 1: still in balance
    d.routed(req("load5", [1] * 4, max_tokens=4), 1)
    assert d.choose(req("e", [*system, 9]), {0, 1}) == 0
    d.release("load5")
    assert d.choose(req("e", [*system, 9]), {0, 1}) == 1


def test_dispatch_never_picks_a_dead_instance():
    for policy in ("round_robin", "least_load", "prefix_aware"):
        d = Dispatcher(ClusterConfig(num_instances=3, dispatch_policy=policy), [100] * 3, BS)
        for i in range(6):
            assert d.choose(req(str(i), [1, 2, 3, 4, 5]), {1}) == 1


def test_cluster_config_is_validated():
    with pytest.raises(ValueError, match="num-instances"):
        ClusterConfig(num_instances=0)
    with pytest.raises(ValueError, match="dispatch-policy"):
        ClusterConfig(dispatch_policy="random")
    with pytest.raises(ValueError, match="balance"):
        ClusterConfig(balance_rel_threshold=0.5)
