"""Suffix speculation: the vectorized suffix match and continuation against brute force, the
draft-length rules (match length times the spec factor, the probability floor), outputs of ended
requests drafting for later ones of the same isolation key and never another's, and, end to end,
a request repeating an earlier one's output drafting it almost whole; and the adaptive controller
giving a copying request the longest draft where verification costs little more than a step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem import LLM, SamplingParams
from tandem.core.request import Request
from tandem.sampling_params import SamplingParams as Params
from tandem.spec.config import SpeculativeConfig
from tandem.spec.suffix import SuffixConfig, SuffixSpeculator, continuation, continuation_tree, longest_match


def brute_match(
    text: list[int], context: list[int], max_depth: int, exclude_tail: bool
) -> tuple[int, list[int]]:
    limit = len(text) - 1 if exclude_tail else len(text)
    for m in range(min(max_depth, len(context)), 0, -1):
        pat = context[-m:]
        ends = [j + 1 for j in range(m - 1, limit) if text[j - m + 1 : j + 1] == pat]
        if ends:
            return m, ends
    return 0, []


tokens = st.lists(st.integers(0, 3), min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(text=tokens, context=st.lists(st.integers(0, 3), min_size=1, max_size=12), depth=st.integers(1, 6))
def test_longest_match_is_the_brute_force_one(text, context, depth):
    got_len, got = longest_match(
        np.array(text, dtype=np.int32), np.array(context, dtype=np.int32), depth, False
    )
    want_len, want = brute_match(text, context, depth, False)
    assert (got_len, sorted(got.tolist())) == (want_len, want)


@settings(max_examples=200, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=1, max_size=40), depth=st.integers(1, 6))
def test_a_context_does_not_match_its_own_tail(seq, depth):
    a = np.array(seq, dtype=np.int32)
    got_len, got = longest_match(a, a, depth, True)
    assert (got_len, sorted(got.tolist())) == brute_match(seq, seq, depth, True)


def test_continuation_follows_the_most_frequent_next_token_above_the_floor():
    text = np.array([1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 5], dtype=np.int32)
    starts = np.array([2, 6, 10, 14])  # after each "1 2"
    assert continuation(text, starts, 4, 0.0) == [3, 9, 1, 2]
    # "3" follows 3 of 4 occurrences, then "9" 2 of 3: a floor of 0.7 keeps only the first.
    assert continuation(text, starts, 4, 0.7) == [3]
    assert continuation(text, starts, 0, 0.0) == []


def request(rid: str, prompt: list[int], output: list[int], salt: str | None = None) -> Request:
    req = Request(request_id=rid, prompt_token_ids=prompt, sampling=Params(), max_tokens=64, cache_salt=salt)
    req.token_ids = [*prompt, *output]
    return req


def test_drafts_from_the_requests_own_context_scale_with_the_match():
    spec = SuffixSpeculator(SuffixConfig(max_spec_factor=1.0, min_token_prob=0.0))
    req = request("a", [5, 6, 7, 8, 9, 10, 11], [5, 6])
    assert spec.propose(req, 16) == [7, 8]  # a 2-token match drafts 2
    req.token_ids += [7, 8]
    assert spec.propose(req, 16) == [9, 10, 11, 5]  # 4 matched, 4 drafted
    assert spec.propose(req, 3) == [9, 10, 11]  # never more than k


def test_ended_outputs_draft_for_later_requests_of_the_same_key_only():
    spec = SuffixSpeculator(SuffixConfig(min_token_prob=0.0, max_spec_factor=4.0))
    earlier = request("e", [1, 2], [40, 41, 42, 43, 44, 45], salt="tenant-a")
    spec.propose(earlier, 4)
    spec.forget("e")
    assert spec.num_cached_requests == 1
    same = request("s", [3, 40, 41], [], salt="tenant-a")
    assert spec.propose(same, 8) == [42, 43, 44, 45]
    other = request("o", [3, 40, 41], [], salt="tenant-b")
    assert spec.propose(other, 8) == []
    unsalted = request("u", [3, 40, 41], [], salt=None)
    assert spec.propose(unsalted, 8) == []


def test_the_cache_keeps_the_most_recent_outputs():
    spec = SuffixSpeculator(SuffixConfig(max_cached_requests=2, min_token_prob=0.0))
    for i in range(3):
        spec.propose(request(f"r{i}", [1], [100 + i, 200 + i]), 1)
        spec.forget(f"r{i}")
    assert spec.num_cached_requests == 2
    assert spec.propose(request("x", [9, 100], []), 4) == []  # r0's output was dropped
    assert spec.propose(request("y", [9, 102], []), 4) == [202]


def test_settings_are_read_and_checked():
    cfg = SpeculativeConfig.from_dict(
        {"method": "suffix", "num_speculative_tokens": 24, "suffix_decoding_max_depth": 16}
    )
    assert cfg is not None and cfg.suffix.max_depth == 16
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob must be a number in"):
        SpeculativeConfig.from_dict(
            {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 2}
        )
    with pytest.raises(ValueError, match="must be in \\[1, 32\\]"):
        SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 33})


def test_a_repeated_request_drafts_the_earlier_output(model_factory):
    """The same greedy request twice: the second one's drafts come from the first's output and are
    accepted nearly whole; both outputs equal a run without speculation."""
    model_dir = model_factory("llama")
    prompt = list(range(20, 44))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    spec = {"method": "suffix", "num_speculative_tokens": 16, "adaptive": False}
    llm = LLM(str(model_dir), speculative_config=spec, num_threads=1)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    counters = llm.engine.counters
    before = (counters.spec_decode_num_draft_tokens, counters.spec_decode_num_accepted_tokens)
    second = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    drafted = counters.spec_decode_num_draft_tokens - before[0]
    accepted = counters.spec_decode_num_accepted_tokens - before[1]
    assert second == first
    assert accepted >= 0.8 * (len(second) - 1) and accepted >= 0.8 * drafted
    plain = LLM(str(model_dir), num_threads=1)
    assert (
        plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        == first
    )


def test_tree_proposals_take_the_most_probable_continuations_first():
    # After "1 2": "3" three times (then "4" twice, "5" once), "6" once.
    text = np.array([1, 2, 3, 4, -1, 1, 2, 3, 4, -1, 1, 2, 3, 5, -1, 1, 2, 6], dtype=np.int32)
    starts = np.array([2, 7, 12, 17])
    tokens, parents = continuation_tree(text, starts, 4, 0.0)
    # Best first: "3" (3/4), then "4" under it (3/4 * 2/3 = 1/2), then "5" and "6" (1/4 each).
    assert tokens[:2] == [3, 4] and parents[:2] == [-1, 0]
    assert sorted(zip(tokens[2:], parents[2:])) == [(5, 0), (6, -1)]
    assert continuation_tree(text, starts, 2, 0.5) == ([3, 4], [-1, 0])
    spec = SuffixSpeculator(SuffixConfig(min_token_prob=0.0, max_spec_factor=4.0))
    tree = spec.propose_tree(request("t", [1, 2, 3, 4, 8, 1, 2, 3, 5, 9, 1, 2], []), 8)
    assert tree is not None and tree.tokens[0] == 3 and tree.parents[0] == -1
    assert {tree.tokens[c] for c in tree.children(0)} == {4, 5}


def test_flat_verification_cost_lets_a_copying_request_draft_the_maximum():
    """On a memory-bound model verifying 32 rows costs little more than one: a request whose drafts
    are accepted as a copy's are gets the longest draft the config allows (an agent's copies run
    20-60 tokens), and a request whose drafts fail gets a short one or none."""
    from tandem.spec.config import MAX_SPECULATIVE_TOKENS
    from tandem.spec.controller import AdaptiveSpeculation

    ctl = AdaptiveSpeculation(MAX_SPECULATIVE_TOKENS)
    # 10 ms a step, +0.05 ms per row: 33 rows cost 1.16x one, a memory-bound model's flat line.
    ctl.seed([(1, 0.010), (33, 0.0116), (64, 0.0132)], [])
    for _ in range(20):
        ctl.observe_acceptance("copy", 32, 30)
        ctl.observe_acceptance("miss", 32, 0)
    plan = ctl.plan(["copy", "miss"], 0, draft_passes_cost=False)
    assert plan.num_draft["copy"] == MAX_SPECULATIVE_TOKENS
    assert plan.num_draft.get("miss", 0) <= 2


def test_scored_proposals_carry_their_probabilities():
    """A tree's nodes come best first with their path probabilities (non-increasing), a prefix
    of it is the smaller tree, and the sum of the probabilities is the expected accepted length
    under the text's own frequencies; a chain's are the products of its shares."""
    import itertools

    import numpy as np

    from tandem.spec.suffix import _SEPARATOR, scored_continuation, scored_continuation_tree

    # After "1": "2 3" three times, "2 4" once, "5" twice.
    s = _SEPARATOR
    text = np.array([1, 2, 3, s, 1, 2, 3, s, 1, 2, 3, s, 1, 2, 4, s, 1, 5, s, 1, 5, s], dtype=np.int32)
    starts = np.flatnonzero(text == 1) + 1
    tokens, parents, probs = scored_continuation_tree(text, starts, 8, 0.0)
    assert tokens[:4] == [2, 3, 5, 4] and parents[:4] == [-1, 0, -1, 0]
    assert [round(p * 6, 9) for p in probs[:4]] == [4, 3, 2, 1]
    assert all(a >= b for a, b in itertools.pairwise(probs))
    small = scored_continuation_tree(text, starts, 3, 0.0)
    assert small == (tokens[:3], parents[:3], probs[:3])
    chain, chain_probs = scored_continuation(text, starts, 3, 0.0)
    assert chain[:2] == [2, 3] and abs(chain_probs[0] - 4 / 6) < 1e-9 and abs(chain_probs[1] - 3 / 6) < 1e-9


def test_a_requests_token_array_follows_its_list():
    """Kept between lookups and extended, the array equals the list after appends, after the
    newest token is filled in place (overlap scheduling's placeholder) and after the list was cut
    back (a request's tokens only grow otherwise)."""
    from tandem.spec.suffix import _TokenArray

    tokens = [5, 6, 7]
    arr = _TokenArray()
    assert arr.view(tokens).tolist() == tokens
    tokens += [8, -1]
    assert arr.view(tokens).tolist() == tokens
    tokens[-1] = 9  # the placeholder's value read back
    tokens += list(range(100, 140))
    assert arr.view(tokens).tolist() == tokens
    shorter = [*tokens[:3], 1, 2]  # cut back, then grown anew
    assert arr.view(tokens[:3]).tolist() == tokens[:3]
    assert arr.view(shorter).tolist() == shorter
