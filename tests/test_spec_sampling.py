"""Speculative verification (`rejection_sample`): greedy matching, edge cases, seeded reproducibility, and
the losslessness of the rejection rule checked statistically (chi-square goodness of fit, seeded so every
run draws the same numbers), with a deliberately wrong rule failing the same check to show it has power."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tandem.spec.rejection import rejection_sample
from tandem.worker.sampler import Sampler, SamplingBatch

ALPHA = 1e-3  # significance of every goodness-of-fit test below


def dirichlet(rng: np.random.Generator, shape: tuple[int, ...], alpha: float = 1.0) -> torch.Tensor:
    x = torch.tensor(rng.dirichlet([alpha] * shape[-1], size=shape[:-1]), dtype=torch.float32)
    return x / x.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One categorical sample per row of probs [..., V] (inverse CDF, independent of the code under test)."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand(probs.shape[:-1], generator=gen, dtype=torch.float64)[..., None] * cdf[..., -1:]
    return (cdf <= u).sum(dim=-1).clamp(max=probs.shape[-1] - 1)


def expected_counts(p: torch.Tensor, n: int) -> np.ndarray:
    """n * p in float64, summing to n exactly enough for scipy's chisquare."""
    p64 = p.double().numpy()
    return p64 / p64.sum() * n


def check_structure(tokens, num_accepted, draft_tokens, num_draft):
    batch, width = tokens.shape
    assert tokens.dtype == torch.long and num_accepted.dtype == torch.long
    assert num_accepted.shape == (batch,)
    assert torch.all((num_accepted >= 0) & (num_accepted <= num_draft))
    pos = torch.arange(width)[None, :]
    accepted = pos < num_accepted[:, None]
    assert torch.equal(
        tokens[:, : width - 1][accepted[:, : width - 1]], draft_tokens[accepted[:, : width - 1]]
    )
    assert torch.all(tokens.gather(1, num_accepted[:, None]) >= 0)
    assert torch.all(tokens[pos > num_accepted[:, None]] == -1)


def run(target, drafts, num_draft, q, greedy, gens=None, seed=0):
    batch = target.shape[0]
    gens = gens if gens is not None else [None] * batch
    out = rejection_sample(target, drafts, num_draft, q, greedy, gens, torch.Generator().manual_seed(seed))
    check_structure(*out, drafts, num_draft)
    return out


# ---------------------------------------------------------------------------------------------------------
# Greedy rows, edge cases
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_q", [True, False])
def test_greedy_rows_accept_the_argmax_prefix(with_q):
    rng = np.random.default_rng(0)
    batch, k, vocab = 64, 4, 10
    target = dirichlet(rng, (batch, k + 1, vocab))
    argmax = target.argmax(dim=-1)
    num_draft = torch.tensor(rng.integers(0, k + 1, size=batch))
    match_len = torch.tensor([rng.integers(0, n + 1) for n in num_draft.tolist()])  # intended accepted
    drafts = argmax[:, :k].clone()
    for b in range(batch):
        if match_len[b] < num_draft[b]:
            drafts[b, match_len[b]] = (argmax[b, match_len[b]] + 1 + rng.integers(0, vocab - 1)) % vocab
        drafts[b, num_draft[b] :] = -1  # padding
    q = dirichlet(rng, (batch, k, vocab)) if with_q else None
    greedy = torch.tensor([b % 2 == 0 for b in range(batch)])  # odd rows sample, mixed in the same batch
    gens = [torch.Generator().manual_seed(b) if b % 4 == 0 else None for b in range(batch)]
    states = [g.get_state() if g is not None else None for g in gens]

    tokens, num_accepted = run(target, drafts, num_draft, q, greedy, gens)

    for b in range(0, batch, 2):
        a = int(match_len[b])
        assert num_accepted[b] == a
        expected = [*drafts[b, :a].tolist(), int(argmax[b, a])] + [-1] * (k - a)
        assert tokens[b].tolist() == expected
        if gens[b] is not None:
            assert torch.equal(gens[b].get_state(), states[b])  # greedy rows draw nothing


def test_greedy_bonus_token_when_all_accepted():
    target = torch.tensor([[[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]]])
    tokens, num_accepted = run(target, torch.tensor([[1, 0]]), torch.tensor([2]), None, torch.tensor([True]))
    assert tokens.tolist() == [[1, 0, 2]] and num_accepted.tolist() == [2]
    tokens, num_accepted = run(target, torch.tensor([[1, 2]]), torch.tensor([2]), None, torch.tensor([True]))
    assert tokens.tolist() == [[1, 0, -1]] and num_accepted.tolist() == [1]  # recovered: argmax of p_1


@pytest.mark.parametrize("k", [0, 3])
def test_num_draft_zero_samples_from_p0(k):
    rng = np.random.default_rng(1)
    trials, vocab = 20000, 6
    p = dirichlet(rng, (k + 1, vocab), alpha=2.0)
    target = p.expand(trials, k + 1, vocab).contiguous()
    drafts = torch.full((trials, k), -1, dtype=torch.long)
    q = torch.full((trials, k, vocab), float("nan")) if k else None
    tokens, num_accepted = run(
        target,
        drafts,
        torch.zeros(trials, dtype=torch.long),
        q,
        torch.zeros(trials, dtype=torch.bool),
        seed=3,
    )
    assert tokens.shape == (trials, k + 1)
    assert torch.all(num_accepted == 0) and torch.all(tokens[:, 1:] == -1)
    counts = np.bincount(tokens[:, 0].numpy(), minlength=vocab)
    assert chisquare(counts, expected_counts(p[0], trials)).pvalue > ALPHA


def test_seeded_row_without_drafts_draws_what_the_sampler_draws():
    rng = np.random.default_rng(2)
    rows, vocab = 16, 50
    probs = dirichlet(rng, (rows, vocab), alpha=0.5)
    seeds = list(range(100, 100 + rows))
    sb = SamplingBatch(
        temperature=torch.ones(rows),
        greedy=torch.zeros(rows, dtype=torch.bool),
        all_greedy=False,
        top_k=None,
        top_p=None,
        min_p=None,
        presence=None,
        frequency=None,
        repetition=None,
        output_counts=None,
        prompt_mask=None,
        blocked=None,
        generators=[torch.Generator().manual_seed(s) for s in seeds],
        num_logprobs=[None] * rows,
    )
    expected, _ = Sampler(torch.Generator().manual_seed(0))(probs.log(), sb)
    tokens, _ = run(
        probs[:, None, :],
        torch.zeros(rows, 0, dtype=torch.long),
        torch.zeros(rows, dtype=torch.long),
        None,
        torch.zeros(rows, dtype=torch.bool),
        [torch.Generator().manual_seed(s) for s in seeds],
    )
    assert tokens[:, 0].tolist() == expected


def test_padding_is_ignored():
    rng = np.random.default_rng(3)
    batch, k, vocab = 200, 5, 8
    target = dirichlet(rng, (batch, k + 1, vocab))
    q = dirichlet(rng, (batch, k, vocab))
    drafts = draw(q, torch.Generator().manual_seed(0))
    num_draft = torch.tensor(rng.integers(0, k + 1, size=batch))
    greedy = torch.tensor(rng.random(batch) < 0.3)
    pad = torch.arange(k)[None, :] >= num_draft[:, None]  # draft positions past num_draft
    beyond = torch.arange(k + 1)[None, :] > num_draft[:, None]  # verify positions past the bonus one

    def once(drafts, target, q, use_q):
        gens = [torch.Generator().manual_seed(b) if b % 3 == 0 else None for b in range(batch)]
        return run(target, drafts, num_draft, q if use_q else None, greedy, gens, seed=9)

    for use_q in (True, False):
        clean = once(drafts, target, q, use_q)
        dirty = once(
            drafts.masked_fill(pad, -7).masked_fill(pad & (torch.arange(k) % 2 == 0), vocab + 3),
            target.masked_fill(beyond[:, :, None], float("nan")),
            q.masked_fill(pad[:, :, None], float("nan")),
            use_q,
        )
        assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    rng = np.random.default_rng(4)
    vocab, k = 12, 3
    seeded = 10
    target = dirichlet(rng, (seeded, k + 1, vocab), alpha=0.7)
    q = dirichlet(rng, (seeded, k, vocab), alpha=0.7)
    drafts = draw(q, torch.Generator().manual_seed(1))
    num_draft = torch.tensor(rng.integers(0, k + 1, size=seeded))

    def alone(b, use_q):
        return run(
            target[b : b + 1],
            drafts[b : b + 1],
            num_draft[b : b + 1],
            q[b : b + 1] if use_q else None,
            torch.tensor([False]),
            [torch.Generator().manual_seed(1000 + b)],
            seed=5,
        )

    def in_batch(others, extra_k, use_q, seed):
        """The seeded rows at random places among `others` other rows, with the batch padded to k + extra_k."""
        total, width = seeded + others, k + extra_k
        order = torch.tensor(rng.permutation(total))
        slots = order[:seeded]  # where seeded row b lands
        big_t = dirichlet(rng, (total, width + 1, vocab))
        big_q = dirichlet(rng, (total, width, vocab))
        big_d = torch.tensor(rng.integers(0, vocab, size=(total, width)))
        big_n = torch.tensor(rng.integers(0, width + 1, size=total))
        greedy = torch.tensor(rng.random(total) < 0.3)
        gens = [torch.Generator().manual_seed(int(s)) if s % 2 else None for s in rng.integers(0, 99, total)]
        big_t[slots, : k + 1] = target
        big_q[slots, :k] = q
        big_d[slots, :k] = drafts
        big_n[slots] = num_draft
        greedy[slots] = False
        for b in range(seeded):
            gens[slots[b]] = torch.Generator().manual_seed(1000 + b)
        tokens, num_accepted = run(big_t, big_d, big_n, big_q if use_q else None, greedy, gens, seed=seed)
        return tokens[slots], num_accepted[slots]

    for use_q in (True, False):
        expected = [alone(b, use_q) for b in range(seeded)]
        for others, extra_k, seed in ((0, 0, 6), (7, 0, 7), (25, 2, 8)):
            tokens, num_accepted = in_batch(others, extra_k, use_q, seed)
            for b, (t, a) in enumerate(expected):
                assert num_accepted[b] == a[0]
                assert tokens[b, : int(a[0]) + 1].tolist() == t[0, : int(a[0]) + 1].tolist()


@pytest.mark.parametrize("with_q", [True, False])
def test_draft_with_zero_target_probability_is_always_rejected(with_q):
    trials, vocab = 2000, 5
    p = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4], [0.2] * 5]).expand(trials, 2, vocab).contiguous()
    q = torch.tensor([[[0.9, 0.025, 0.025, 0.025, 0.025]]]).expand(trials, 1, vocab).contiguous()
    tokens, num_accepted = run(
        p,
        torch.zeros(trials, 1, dtype=torch.long),
        torch.ones(trials, dtype=torch.long),
        q if with_q else None,
        torch.zeros(trials, dtype=torch.bool),
    )
    assert torch.all(num_accepted == 0)
    assert torch.all(tokens[:, 0] != 0) and torch.all(tokens[:, 1] == -1)


def test_all_zero_residual_falls_back_to_p():
    """p <= q everywhere can only come from rounding (normalized p and q would be equal and never reject);
    an under-normalized p makes it happen often. The recovered token must then come from p, not be token 0
    (what an argmax over an all-zero residual would give), which has p = 0 here."""
    trials = 2000
    p = torch.tensor([[0.0, 0.2, 0.3], [0.0, 0.5, 0.5]]).expand(trials, 2, 3).contiguous()
    q = torch.tensor([[[0.0, 0.5, 0.5]]]).expand(trials, 1, 3).contiguous()
    drafts = draw(q[:, 0], torch.Generator().manual_seed(0))[:, None]
    tokens, num_accepted = run(
        p, drafts, torch.ones(trials, dtype=torch.long), q, torch.zeros(trials, dtype=torch.bool)
    )
    rejected = num_accepted == 0
    assert 0.3 * trials < rejected.sum() < 0.8 * trials  # acceptance sum(min(p, q)) = 0.5
    assert torch.all(tokens[:, 0] != 0)


# ---------------------------------------------------------------------------------------------------------
# Losslessness, statistically
# ---------------------------------------------------------------------------------------------------------

TRIALS, VOCAB, K = 40000, 6, 3


def scenario(mode: str):
    """Per-position target p [K+1, V] and proposal distribution [K, V] (the draft's q, or the hidden proposal
    of a deterministic drafter), with a zero in p_0 on a token the proposal likes, and draft tokens drawn
    from the proposal for each of TRIALS rows."""
    rng = np.random.default_rng({"q": 10, "onehot": 11}[mode])
    p = dirichlet(rng, (K + 1, VOCAB), alpha=1.5)
    p[0, 2] = 0.0
    p[0] /= p[0].sum()
    proposal = dirichlet(rng, (K, VOCAB), alpha=1.5)
    proposal[0, 2] += 0.2
    proposal[0] /= proposal[0].sum()
    drafts = draw(proposal.expand(TRIALS, K, VOCAB), torch.Generator().manual_seed(12))
    return p, proposal, drafts


def position_pvalues(tokens: torch.Tensor, num_accepted: torch.Tensor, p: torch.Tensor) -> list[float]:
    """Goodness of fit of emitted token i, over the rows whose first i tokens were accepted drafts, to p_i.

    Positions 0 and 1 are always tested; later ones only while every expected count is at least 5 (the
    chi-square approximation's usual condition)."""
    out = []
    for i in range(K + 1):
        rows = num_accepted >= i
        n = int(rows.sum())
        expected = expected_counts(p[i], n)
        if expected[expected > 0].min() < 5:
            assert i >= 2, "too few samples for the chi-square approximation"
            break
        counts = np.bincount(tokens[rows, i].numpy(), minlength=VOCAB)
        support = expected > 0
        if counts[~support].any():
            out.append(0.0)  # emitted a token with probability zero
            continue
        out.append(float(chisquare(counts[support], expected[support]).pvalue))
    return out


def theoretical_acceptance(mode, p, proposal) -> torch.Tensor:
    """beta_i = sum_x min(p_i, q_i) for a draft distribution q; sum_x r_i(x) p_i(x) for one-hot verification
    of drafts drawn from r."""
    if mode == "q":
        return torch.minimum(p[:K], proposal).sum(dim=-1)
    return (proposal * p[:K]).sum(dim=-1)


@pytest.mark.parametrize("mode", ["q", "onehot"])
def test_rejection_sampling_is_lossless(mode):
    p, proposal, drafts = scenario(mode)
    target = p.expand(TRIALS, K + 1, VOCAB)
    q = proposal.expand(TRIALS, K, VOCAB) if mode == "q" else None
    num_draft = torch.full((TRIALS,), K)
    tokens, num_accepted = run(target, drafts, num_draft, q, torch.zeros(TRIALS, dtype=torch.bool), seed=13)

    pvalues = position_pvalues(tokens, num_accepted, p)
    print(mode, "p-values per position:", pvalues)
    assert len(pvalues) >= 2 and all(pv > ALPHA for pv in pvalues), pvalues

    # Acceptance: P(draft i accepted | drafts before it accepted) = beta_i, within 4.5 standard errors.
    beta = theoretical_acceptance(mode, p, proposal)
    for i in range(K):
        reached = int((num_accepted >= i).sum())
        rate = float((num_accepted >= i + 1).sum()) / reached
        b = float(beta[i])
        se = np.sqrt(b * (1 - b) / reached)
        assert abs(rate - b) < 4.5 * se, (i, rate, b)


def wrong_rule(variant: str, p, proposal, drafts, mode, gen):
    """Deliberately wrong verification, as a bug might make it: `always_accept`, or `recover_from_p`
    (the right acceptance test, but the replacement for a rejected draft drawn from p, not the residual)."""
    trials = drafts.shape[0]
    if variant == "always_accept":
        bonus = draw(p[K].expand(trials, VOCAB), gen)
        return torch.cat([drafts, bonus[:, None]], dim=1), torch.full((trials,), K)
    p_x = p[:K].expand(trials, K, VOCAB).gather(2, drafts[:, :, None]).squeeze(2)
    q_x = proposal.expand(trials, K, VOCAB).gather(2, drafts[:, :, None]).squeeze(2) if mode == "q" else 1.0
    accept = torch.rand(trials, K, generator=gen) * q_x < p_x
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    extra = draw(p[num_accepted], gen)
    tokens = torch.where(torch.arange(K)[None, :] < num_accepted[:, None], drafts, -1)
    tokens = torch.cat([tokens, torch.full((trials, 1), -1)], dim=1)
    return tokens.scatter(1, num_accepted[:, None], extra[:, None]), num_accepted


@pytest.mark.parametrize("variant", ["always_accept", "recover_from_p"])
@pytest.mark.parametrize("mode", ["q", "onehot"])
def test_wrong_rules_fail_the_same_check(mode, variant):
    p, proposal, drafts = scenario(mode)
    tokens, num_accepted = wrong_rule(variant, p, proposal, drafts, mode, torch.Generator().manual_seed(14))
    pvalues = position_pvalues(tokens, num_accepted, p)
    print(mode, variant, "p-values per position:", pvalues)
    assert pvalues[0] < ALPHA and pvalues[1] < ALPHA, pvalues
