"""Prefix caching end to end through `LLM` on the tiny random Llama.

Greedy outputs must not depend on whether KV came from the cache: every test compares caching on
against caching off (and a few prompts against transformers), across block sizes, chunked prefill,
preemption and `cache_salt` isolation, and checks the hit accounting exactly.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from fractions import Fraction

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.kv_cache_manager import KVCacheManager

VOCAB = 512  # the tiny checkpoints' (tests/tiny_checkpoints.py)
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(model_dir, caching: bool, block_size: int, **engine_args) -> LLM:
    engine_args.setdefault("num_kv_blocks", 4096 // block_size)  # ample: nothing is evicted
    return LLM(str(model_dir), enable_prefix_caching=caching, block_size=block_size, **engine_args)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    return [list(o.outputs[0].token_ids) for o in outs]


def cached_part(prompt_len: int, block_size: int) -> int:
    """Tokens a fully cached prompt reuses: its whole blocks, always leaving at least the last token."""
    return (prompt_len - 1) // block_size * block_size


def assert_released(llm: LLM) -> None:
    """No request holds a block, the invariants hold, and evicting the idle cache frees the whole pool."""
    kv = llm.engine.kv
    assert not llm.engine.has_unfinished_requests()
    kv.check_invariants()
    assert kv.usage == 0
    cached = kv.cache.num_cached_blocks if kv.cache else 0
    assert kv.pool.num_free + cached == kv.pool.num_blocks
    if kv.cache:
        assert kv.cache.num_unlocked_blocks == cached
        assert kv.cache.evict(kv.num_blocks) == cached
        kv.check_invariants()
        assert kv.cache.num_cached_blocks == 0
    assert kv.pool.num_free == kv.pool.num_blocks


class Tokens:
    """Seeded random token ids (special ids 0-2 left out)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, n: int, avoid: Collection[int] = ()) -> list[int]:
        out = []
        while len(out) < n:
            t = self.rng.randrange(3, VOCAB)
            if not out and t in avoid:
                continue  # the first token decides where a prompt leaves a shared prefix
            out.append(t)
        return out


# -- parity: caching on vs off vs transformers --------------------------------------------------


def parity_prompts() -> list[list[int]]:
    toks = Tokens(1234)
    base = toks(50)
    left_30 = base[:30] + toks(14, avoid={base[30]})
    return [
        base,
        left_30,  # leaves `base` at 30: mid-block for block size 4 (30 % 4 = 2) and 16 (30 % 16 = 14)
        base[:37] + toks(9, avoid={base[37]}),  # leaves at 37
        base[:21],  # a strict prefix of `base`, not on a block boundary
        base[:16],  # a strict prefix on a block boundary for every block size
        list(base),  # an exact duplicate
        toks(23),  # unrelated
        left_30[:40] + toks(5, avoid={left_30[40]}),  # shares 40 tokens with left_30, 30 with base
        [*base, *toks(11)],  # extends `base`
        base[:1],  # one token
    ]


# A few of parity_prompts() checked against transformers too: base, the mid-block divergence,
# the strict prefix, the extension.
HF_PROMPTS = [0, 1, 3, 8]


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(g[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def hf_reference(llama_dir) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy tokens for the HF_PROMPTS and for them extended by their own output."""
    prompts = parity_prompts()
    first = [prompts[i] for i in HF_PROMPTS]
    first_out = hf_greedy(llama_dir, first, MAX_TOKENS)
    follow = [continuation(p, o, k) for k, (p, o) in enumerate(zip(first, first_out))]
    follow_out = hf_greedy(llama_dir, follow, MAX_TOKENS)
    return {tuple(p): o for p, o in zip(first + follow, first_out + follow_out)}


def continuation(prompt: list[int], output: list[int], k: int) -> list[int]:
    """A follow-up turn: the prompt, its answer, then a few new tokens (reuses the answer's KV)."""
    return [*prompt, *output, *Tokens(100 + k)(3)]


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prefill", "chunked-7"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_identical_with_and_without_caching(llama_dir, hf_reference, block_size, chunk):
    """Two generate calls on one engine: the second reuses the first's KV (prompts and answers);
    with a 7-token budget, requests admitted later reuse what earlier ones computed in the same call."""
    prompts = parity_prompts()
    engine_args = {} if chunk is None else {"max_num_batched_tokens": chunk}
    results = {}
    for caching in (False, True):
        llm = make_llm(llama_dir, caching, block_size, **engine_args)
        first = run(llm, prompts)
        hits_first = llm.engine.counters.prefix_cache_hits
        # The follow-up turns first, then every prompt again in reverse order.
        second_prompts = [continuation(prompts[i], first[i], k) for k, i in enumerate(HF_PROMPTS)]
        second_prompts += prompts[::-1]
        second = run(llm, second_prompts)
        results[caching] = (first, second_prompts, second)
        hits = llm.engine.counters.prefix_cache_hits
        if caching:
            if chunk is not None:
                assert hits_first > 0, "requests admitted later in the call reused nothing"
            assert hits - hits_first >= sum(cached_part(len(p), block_size) for p in prompts), (
                "the repeated prompts did not reuse the first call's KV"
            )
        else:
            assert hits == 0
        assert_released(llm)

    off_first, off_prompts, off_second = results[False]
    on_first, on_prompts, on_second = results[True]
    assert on_prompts == off_prompts
    for i, (a, b) in enumerate(zip(off_first, on_first)):
        assert a == b, f"first call, prompt {i}: caching changed the greedy tokens"
    for i, (a, b) in enumerate(zip(off_second, on_second)):
        assert a == b, f"second call, prompt {i}: caching changed the greedy tokens"
    # Against transformers: the first call (KV computed here) and the follow-ups (KV from the cache).
    checked = set()
    for prompts_, outs in ((prompts, on_first), (on_prompts, on_second)):
        for p, o in zip(prompts_, outs):
            ref = hf_reference.get(tuple(p))
            if ref is not None:
                assert o == ref, f"prompt of {len(p)} tokens differs from transformers"
                checked.add(tuple(p))
    assert checked == set(hf_reference)


# -- a second call reuses the first ---------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_second_call_computes_only_the_uncached_tail(llama_dir, block_size):
    toks = Tokens(7)
    lengths = [1, 4, 5, 16, 17, 33, 64, 100, 128]
    prompts = [toks(n) for n in lengths]  # no shared prefixes: the first call reuses nothing
    llm = make_llm(llama_dir, True, block_size)
    stats = llm.engine.counters

    before = stats.num_batched_tokens
    outs1 = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    computed1 = stats.num_batched_tokens - before
    # Every prompt token, then one token per step for all but the last output token.
    assert computed1 == sum(n + MAX_TOKENS - 1 for n in lengths)
    assert stats.prefix_cache_hits == 0
    assert [o.metrics.num_cached_tokens for o in outs1] == [0] * len(prompts)

    before, hits, queries = stats.num_batched_tokens, stats.prefix_cache_hits, stats.prefix_cache_queries
    outs2 = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    computed2 = stats.num_batched_tokens - before
    expected_cached = [cached_part(n, block_size) for n in lengths]
    assert [o.metrics.num_cached_tokens for o in outs2] == expected_cached
    assert stats.prefix_cache_hits - hits == sum(expected_cached)
    assert stats.prefix_cache_queries - queries == sum(lengths)
    assert computed2 == sum(n - c + MAX_TOKENS - 1 for n, c in zip(lengths, expected_cached))
    assert computed2 * 3 < computed1
    for a, b in zip(outs1, outs2):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_released(llm)


def test_duplicate_prompts_computed_together_hold_one_copy(llama_dir):
    """Two requests with the same prompt prefill in the same step, so neither reuses the other; the
    cache keeps one copy. Once the short one finishes, caching must not hold more KV blocks than no
    caching does (the survivor must not hold its own copy while keeping the cached one locked)."""
    prompt = Tokens(5)(40)  # 10 blocks of 4
    used = {}
    for caching in (False, True):
        llm = make_llm(llama_dir, caching, 4, num_kv_blocks=64)
        engine = llm.engine
        engine.add_request("short", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        finished = engine.step(emit_unfinished=False)
        assert [o.request_id for o in finished] == ["short"]
        used[caching] = (engine.kv.pool.num_used, engine.kv.usage)
        while engine.has_unfinished_requests():
            finished += engine.step(emit_unfinished=False)
        assert [o.request_id for o in finished] == ["short", "long"]
        assert finished[0].outputs[0].token_ids == finished[1].outputs[0].token_ids[:1]
        assert_released(llm)
    assert used[True] == used[False] == (10, 10 / 64)


# -- preemption ---------------------------------------------------------------------------------


def test_preempted_requests_resume_from_the_cache(llama_dir, monkeypatch):
    """A KV cache too small for the batch: requests are preempted and resume from cached blocks
    (the shared prefix other requests hold, and their own blocks not yet evicted), with the same
    greedy tokens as without caching and as with an ample cache."""
    toks = Tokens(99)
    prefix = toks(24)
    prompts: list[list[int]] = []
    for _ in range(6):
        prompts.append(prefix + toks(10, avoid={p[24] for p in prompts}))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine_args = dict(block_size=4, num_kv_blocks=30, max_num_batched_tokens=64)

    # Cached tokens each preempted request resumed from (an admission whose blocks could not all be
    # had is undone and retried later: only the attempt that got its blocks counts).
    resumed_hits: list[int] = []
    matched: dict[str, int] = {}
    match_prefix, allocate_slots = KVCacheManager.match_prefix, KVCacheManager.allocate_slots

    def spy_match(self, req):
        n = match_prefix(self, req)
        if req.num_preemptions > 0:
            matched[req.request_id] = n
        return n

    def spy_allocate(self, req, num_new_tokens, copies):
        ok = allocate_slots(self, req, num_new_tokens, copies)
        if ok and req.request_id in matched:
            resumed_hits.append(matched.pop(req.request_id))
        return ok

    monkeypatch.setattr(KVCacheManager, "match_prefix", spy_match)
    monkeypatch.setattr(KVCacheManager, "allocate_slots", spy_allocate)

    results, computed, preemptions, resumed = {}, {}, {}, {}
    for caching in (False, True):
        resumed_hits.clear()
        llm = LLM(str(llama_dir), enable_prefix_caching=caching, **engine_args)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[caching] = [list(o.outputs[0].token_ids) for o in outs]
        computed[caching] = llm.engine.counters.num_batched_tokens
        preemptions[caching] = llm.engine.counters.num_preemptions
        resumed[caching] = list(resumed_hits)
        assert len(resumed_hits) == preemptions[caching]  # every preempted request resumed once
        assert sum(o.metrics.num_preemptions for o in outs) == preemptions[caching]
        assert_released(llm)
    assert preemptions[True] > 0
    assert preemptions[False] > 0
    assert results[True] == results[False]
    assert resumed[False] == [0] * preemptions[False]
    assert any(n > 0 for n in resumed[True]), "no resumed request reused a cached block"
    # Reuse (on first admission and on resumption) saves work overall.
    assert computed[True] < computed[False]

    ample = LLM(str(llama_dir), enable_prefix_caching=True, block_size=4, num_kv_blocks=256)
    ample_out = run(ample, prompts, params)
    assert ample.engine.counters.num_preemptions == 0
    assert ample_out == results[True]
    assert_released(ample)


# -- a shared system prompt -----------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_shared_system_prompt_hit_rate_is_ideal(llama_dir, block_size):
    """N requests share a 1000-token system prompt and differ in a short question.

    The ideal: warm the cache with one request (system prompt + a question of its own), then each
    of the N requests reuses exactly the whole blocks of the system prompt, floor(1000 / block_size)
    * block_size tokens. No more, because every question starts with a token no other prompt has
    there (the block straddling the end of the system prompt differs); no less, because nothing is
    evicted. So the second call's hit rate is N * that / (total prompt tokens of the N requests),
    an exact fraction. Fits the tiny model's 1024 positions: 1000 + 8..15 + MAX_TOKENS.
    """
    toks = Tokens(2024)
    system = toks(1000)
    n = 8
    firsts = random.Random(5).sample(range(3, VOCAB), n + 1)
    questions = [[f, *toks(7 + i)] for i, f in enumerate(firsts)]
    warm, prompts = system + questions[0], [system + q for q in questions[1:]]
    llm = make_llm(llama_dir, True, block_size)
    stats = llm.engine.counters

    run(llm, [warm])
    assert stats.prefix_cache_hits == 0 and stats.prefix_cache_queries == len(warm)

    hits, queries, before = stats.prefix_cache_hits, stats.prefix_cache_queries, stats.num_batched_tokens
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    hit_tokens, query_tokens = stats.prefix_cache_hits - hits, stats.prefix_cache_queries - queries
    per_request = len(system) // block_size * block_size
    assert [o.metrics.num_cached_tokens for o in outs] == [per_request] * n
    assert hit_tokens == n * per_request
    assert query_tokens == sum(len(p) for p in prompts)
    assert Fraction(hit_tokens, query_tokens) == Fraction(n * per_request, sum(len(p) for p in prompts))
    # Over the whole run, the warm-up request counts as a miss.
    assert Fraction(stats.prefix_cache_hits, stats.prefix_cache_queries) == Fraction(
        n * per_request, len(warm) + sum(len(p) for p in prompts)
    )
    assert stats.num_batched_tokens - before == sum(len(p) - per_request + MAX_TOKENS - 1 for p in prompts)
    assert_released(llm)

    off = make_llm(llama_dir, False, block_size)  # a few only: each computes all 1000 tokens
    assert run(off, prompts[:3]) == [list(o.outputs[0].token_ids) for o in outs[:3]]
    assert off.engine.counters.prefix_cache_hits == 0
    assert_released(off)


# -- cache_salt isolation ------------------------------------------------------------------------


def test_cache_salt_isolates_prefixes(llama_dir):
    toks = Tokens(31)
    bs = 4
    prompt = toks(42)
    sibling = prompt[:30] + toks(9, avoid={prompt[30]})  # shares 30 tokens: 28 in whole blocks
    llm = make_llm(llama_dir, True, bs)
    stats = llm.engine.counters
    reference = None

    def gen(p: list[int], salt: str | None) -> tuple[int, int]:
        """Run one prompt; return (cached tokens reported, tokens computed)."""
        nonlocal reference
        item = {"prompt_token_ids": p} if salt is None else {"prompt_token_ids": p, "cache_salt": salt}
        hits, before = stats.prefix_cache_hits, stats.num_batched_tokens
        out = llm.generate(item, GREEDY, use_tqdm=False)[0]
        if p is prompt:  # the salt never changes the tokens
            reference = reference or out.outputs[0].token_ids
            assert out.outputs[0].token_ids == reference
        assert stats.prefix_cache_hits - hits == out.metrics.num_cached_tokens
        return out.metrics.num_cached_tokens, stats.num_batched_tokens - before

    full = len(prompt) + MAX_TOKENS - 1
    assert gen(prompt, "a") == (0, full)
    assert gen(prompt, "b") == (0, full), "salt b reused salt a's prefix"
    assert gen(prompt, None) == (0, full), "an unsalted request reused a salted prefix"
    hit = cached_part(len(prompt), bs)
    for salt in ("a", "b", None):
        assert gen(prompt, salt) == (hit, full - hit), f"salt {salt!r} did not reuse its own prefix"
    assert gen(sibling, "a") == (28, len(sibling) - 28 + MAX_TOKENS - 1)
    assert gen(sibling, "c") == (0, len(sibling) + MAX_TOKENS - 1)

    # Salted requests running side by side (the same step) under chunked prefill do not share
    # either, while two requests with the same salt do.
    chunked = make_llm(llama_dir, True, bs, max_num_batched_tokens=16)
    items = [
        {"prompt_token_ids": prompt, "cache_salt": "x"},
        {"prompt_token_ids": prompt, "cache_salt": "y"},
        {"prompt_token_ids": prompt, "cache_salt": "x"},
    ]
    outs = chunked.generate(items, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference] * 3
    assert outs[0].metrics.num_cached_tokens == 0
    assert outs[1].metrics.num_cached_tokens == 0
    assert outs[2].metrics.num_cached_tokens > 0
    # Through the engine API too.
    chunked.engine.add_request("direct", prompt, GREEDY, cache_salt="y")
    done = []
    while chunked.engine.has_unfinished_requests():
        done += chunked.engine.step(emit_unfinished=False)
    assert len(done) == 1
    assert done[0].metrics.num_cached_tokens == hit
    assert done[0].outputs[0].token_ids == reference
    assert_released(llm)
    assert_released(chunked)
