"""Speculative verification (`rejection_sample`): greedy matching, edge cases, seeded reproducibility, and
the losslessness of the rejection rule checked statistically (chi-square goodness of fit, seeded so every
run draws the same numbers), with a deliberately wrong rule failing the same check to show it has power.
Then losslessness through the runner's `_verify_sampled`, whose target distribution carries temperature,
top-k, top-p, min-p, the penalties and min_tokens (with the drafts before a position counted as output),
against the plain sampler's distribution, again with wrong targets failing the same check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2, chisquare

from tandem.core.request import Request
from tandem.sampling_params import SamplingParams
from tandem.spec.rejection import rejection_sample
from tandem.worker.batch import SampleRow
from tandem.worker.model_runner import ModelRunner
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


# ---------------------------------------------------------------------------------------------------------
# Losslessness through the runner, for every sampling parameter
# ---------------------------------------------------------------------------------------------------------
#
# The checks above feed `rejection_sample` a given p. Here p comes from where the engine takes it:
# `ModelRunner._verify_sampled` builds it with `Sampler.distribution` from the logits rows and the
# `SamplingBatch` of `SampleRow(request, drafts before the row)` (as `execute` builds them), so
# temperature, top-k, top-p, min-p, the penalties (which count the drafts before a row as output) and
# `min_tokens` masking all act on it. The emitted token at position i, over the trials whose drafts d_<i
# were accepted, must then follow the distribution the plain (non-speculative) sampler uses for a request
# whose output already ends in d_<i, computed here through a second runner for a request holding d_<i as
# real output tokens and no drafts. The logits depend on the context's last token (a bigram "model"), so p_i
# depends on the drafts even without penalties, as with a real model.

R_TRIALS, R_VOCAB, R_K = 12000, 6, 3
PROMPT = [0, 1]
EARLIER = [3, 3]  # output tokens sampled before this step: penalized like the accepted drafts
STOP = 4  # the stop token of the min_tokens modes, which the proposal favours at position 0


def bigram_logits() -> torch.Tensor:
    """Next-token logits [V, V] given the last token: both signs (repetition divides positive logits and
    multiplies negative ones), spread enough for min-p, top-k and top-p to cut."""
    return torch.randn(R_VOCAB, R_VOCAB, generator=torch.Generator().manual_seed(20))


def proposal_table() -> torch.Tensor:
    """The drafter's next-token distribution [V, V] given the last token: the target's logits with noise,
    close enough that both acceptance and rejection are common."""
    noise = torch.randn(R_VOCAB, R_VOCAB, generator=torch.Generator().manual_seed(24))
    return torch.softmax(bigram_logits() + 1.5 * noise, dim=-1)


# name: (sampling parameters, verification mode); each mode's rule is checked on its own above, so most
# parameters are run under one of them.
RUNNER_CASES = {
    "temperature 0.5": (dict(temperature=0.5), "q"),
    "temperature 1.7": (dict(temperature=1.7), "onehot"),
    "min_p=0.2": (dict(min_p=0.2), "onehot"),
    "min_p=0.15, temperature 1.3": (dict(min_p=0.15, temperature=1.3), "q"),
    "presence": (dict(presence_penalty=1.5), "q"),
    "frequency": (dict(frequency_penalty=0.7), "onehot"),
    "repetition 1.8": (dict(repetition_penalty=1.8), "q"),
    "repetition 0.6": (dict(repetition_penalty=0.6), "onehot"),
    # STOP is blocked at positions 0 and 1, allowed from position 2 on.
    "min_tokens": (dict(min_tokens=len(EARLIER) + 2, stop_token_ids=[STOP]), "q"),
    **{
        f"everything, {mode}": (
            dict(
                temperature=0.8,
                top_k=5,
                top_p=0.95,
                min_p=0.05,
                presence_penalty=0.5,
                frequency_penalty=0.3,
                repetition_penalty=1.3,
                min_tokens=len(EARLIER) + 1,
                stop_token_ids=[STOP],
            ),
            mode,
        )
        for mode in ("q", "onehot")
    },
}


# Parameters through which the drafts before a row change its distribution.
DRAFT_DEPENDENT = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")


def bare_runner() -> ModelRunner:
    """A ModelRunner without a model: only what `sampling_batch` and `_verify_sampled` read."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    runner.vocab_size = R_VOCAB
    runner.sampler = Sampler(torch.Generator().manual_seed(21))
    runner.generators = {}
    return runner


def make_request(rid: str, sampling: dict, output: list[int], seed: int | None = None) -> Request:
    sp = SamplingParams(max_tokens=64, ignore_eos=True, seed=seed, **sampling)
    return Request(rid, list(PROMPT), sp, 64, token_ids=[*PROMPT, *output], seed=seed)


def verify_through_runner(runner, sampling, mode, history=True):
    """R_TRIALS trials of one verification step of R_K drafts, drawn one after the other from the
    proposal given the last token, passed to the verifier as the draft's q in mode "q" and hidden from it
    in mode "onehot"; a quarter of the trials seeded. Trials with the same drafts share one request (one
    set of logits rows). `history=False` builds the rows without the drafts before them (a bug)."""
    table, proposal = bigram_logits(), proposal_table()
    first = proposal[EARLIER[-1]].clone()
    first[STOP] += 0.3  # drafts of the stop token are common where min_tokens blocks it
    first /= first.sum()
    gen = torch.Generator().manual_seed(23)
    drafts = torch.empty(R_TRIALS, R_K, dtype=torch.long)
    for i in range(R_K):
        drafts[:, i] = draw(first.expand(R_TRIALS, R_VOCAB) if i == 0 else proposal[drafts[:, i - 1]], gen)
    seeded = torch.arange(R_TRIALS) % 4 == 0
    unique, inverse = torch.unique(torch.cat([drafts, seeded[:, None].long()], 1), dim=0, return_inverse=True)
    reqs, rows, logits, draft_lists, q = [], [], [], {}, {}
    for u, key in enumerate(unique.tolist()):
        d, is_seeded = key[:R_K], key[R_K]
        req = make_request(f"r{u}", sampling, EARLIER, seed=1000 + u if is_seeded else None)
        reqs.append(req)
        draft_lists[req.request_id] = d
        q[req.request_id] = torch.stack([first, *(proposal[t] for t in d[:-1])])
        last = [EARLIER[-1], *d]  # the context's last token at each verify position
        for j in range(R_K + 1):
            rows.append(SampleRow(req, d[:j] if history else []))
            logits.append(table[last[j]])
    spans = [(reqs[u], u * (R_K + 1), R_K) for u in inverse.tolist()]
    sb = runner.sampling_batch(rows)
    tokens, accepted = runner._verify_sampled(
        torch.stack(logits), sb, spans, draft_lists, q if mode == "q" else {}
    )
    tokens, accepted = torch.tensor(tokens), torch.tensor(accepted)
    check_structure(tokens, accepted, drafts, torch.full((R_TRIALS,), R_K))
    return tokens, accepted, drafts


def plain_distribution(runner, sampling, prefix: tuple[int, ...]) -> torch.Tensor:
    """What the non-speculative sampler samples from once `prefix` has been emitted after EARLIER."""
    output = [*EARLIER, *prefix]
    req = make_request("plain", sampling, output)
    sb = runner.sampling_batch([SampleRow(req, [])])
    return runner.sampler.distribution(bigram_logits()[output[-1]][None], sb)[0]


def pooled_cells(expected: np.ndarray, observed: np.ndarray) -> tuple[list[float], list[int]]:
    """Cells merged, smallest expected first, until each expects at least 5 (the leftover joins the last)."""
    exp_cells, obs_cells, e_acc, o_acc = [], [], 0.0, 0
    for c in np.argsort(expected, kind="stable"):
        e_acc, o_acc = e_acc + expected[c], o_acc + observed[c]
        if e_acc >= 5:
            exp_cells.append(e_acc)
            obs_cells.append(o_acc)
            e_acc, o_acc = 0.0, 0
    if exp_cells:
        exp_cells[-1] += e_acc
        obs_cells[-1] += o_acc
    return exp_cells, obs_cells


def grouped_pvalues(tokens, num_accepted, drafts, dist) -> list[tuple[float, int]]:
    """Per position i: (p-value, degrees of freedom) of the emitted tokens against dist(d_<i), summing the
    chi-square statistics of the groups of trials with the same accepted prefix d_<i (each group with its
    cells pooled to at least 5 expected; groups too small for two cells are left out). A token of
    probability zero gives p-value 0."""
    out = []
    for i in range(R_K + 1):
        reached = (num_accepted >= i).nonzero().squeeze(1)
        if i:
            prefixes, group = torch.unique(drafts[reached, :i], dim=0, return_inverse=True)
        else:  # torch.unique cannot group by an empty prefix
            prefixes, group = drafts[:1, :0], torch.zeros(len(reached), dtype=torch.long)
        stat, dof, impossible = 0.0, 0, False
        for g, prefix in enumerate(prefixes.tolist()):
            emitted = tokens[reached[group == g], i]
            p = dist(tuple(prefix)).double().numpy()
            counts = np.bincount(emitted.numpy(), minlength=R_VOCAB)
            impossible |= bool(counts[p == 0].any())
            exp_cells, obs_cells = pooled_cells(p[p > 0] * len(emitted), counts[p > 0])
            if len(exp_cells) >= 2:
                e, o = np.array(exp_cells), np.array(obs_cells)
                stat += float(((o - e) ** 2 / e).sum())
                dof += len(exp_cells) - 1
        out.append((0.0 if impossible else float(chi2.sf(stat, dof)) if dof else 1.0, dof))
    return out


def runner_pvalues(name, broken=None):
    sampling, mode = RUNNER_CASES[name]
    runner, plain_runner = bare_runner(), bare_runner()  # the second one computes the expected
    dists: dict[tuple[int, ...], torch.Tensor] = {}

    def dist(prefix):
        if prefix not in dists:
            dists[prefix] = plain_distribution(plain_runner, sampling, prefix)
        return dists[prefix]

    # Every case changes the distribution from the plain softmax, at position 0 and (penalties and
    # min_tokens) through the drafts before a row: a parameter the check does not see would make it vacuous.
    table = bigram_logits()
    assert (dist(()) - torch.softmax(table[EARLIER[-1]], -1)).abs().max() > 0.02
    if any(sampling.get(k) for k in DRAFT_DEPENDENT):
        assert max((dist((t,)) - dist(())).abs().max() for t in range(R_VOCAB) if t != EARLIER[-1]) > 0.02
    if sampling.get("min_p"):  # min-p cuts tokens
        assert any((dist((t,)) == 0).any() for t in range(R_VOCAB))

    if broken == "unprocessed":  # the target taken as the plain softmax of the logits
        runner.sampler.distribution = lambda logits, sb: torch.softmax(logits.float(), dim=-1)
    tokens, accepted, drafts = verify_through_runner(runner, sampling, mode, history=broken != "history")
    result = grouped_pvalues(tokens, accepted, drafts, dist)
    print(name, broken, "p-values (dof) per position:", result)
    return result, accepted


@pytest.mark.parametrize("name", list(RUNNER_CASES))
def test_verification_through_the_runner_is_lossless(name):
    result, accepted = runner_pvalues(name)
    # Positions 0 to 2 are tested, and both outcomes of the acceptance test are common at the first two.
    assert all(dof >= 2 for _, dof in result[:3]), result
    assert all(pv > ALPHA for pv, _ in result), result
    for i in (0, 1):
        reached, passed = int((accepted >= i).sum()), int((accepted > i).sum())
        assert 0.1 * reached < passed < 0.9 * reached, (i, reached, passed)


@pytest.mark.parametrize(
    "broken, name",
    [
        ("unprocessed", "temperature 0.5"),
        ("unprocessed", "min_p=0.2"),
        ("history", "presence"),
        ("history", "repetition 1.8"),
        ("history", "min_tokens"),
    ],
)
def test_wrong_targets_fail_the_runner_check(broken, name):
    """The same check fails on a verifier whose target ignores the sampling parameters, or whose penalties
    and min_tokens ignore the drafts before a row (position 0, which has none, is then still right)."""
    result, _ = runner_pvalues(name, broken)
    if broken == "unprocessed":
        assert all(pv < ALPHA for pv, _ in result[:2]), result
    else:
        assert result[0][0] > ALPHA and min(pv for pv, _ in result[1:]) < ALPHA, result
