"""Sampling: seeds, filters, penalties, stops, logprobs and parameter validation.

Two levels: the batched `Sampler` on synthetic logits (allowed sets and reference penalties computed here
independently, penalties checked against transformers' processors), and the public `LLM` API on a tiny
random-weight llama, compared with transformers' `generate` where the semantics match.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.worker.sampler import Sampler, SamplingBatch

PROMPTS = [
    "def foo(x):\n    return x + x + x",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "héllo wörld — 你好，世界 🙂",
    "import os\nimport sys\n",
]


# ---------------------------------------------------------------------------------------------------------
# Sampler on synthetic logits
# ---------------------------------------------------------------------------------------------------------


def make_batch(
    rows: list[dict],
    vocab: int,
    *,
    prompt_ids: list[list[int]] | None = None,
    output_ids: list[list[int]] | None = None,
    blocked: list[list[int]] | None = None,
) -> SamplingBatch:
    """A SamplingBatch as the runner would build it; each row is a dict of SamplingParams-like fields."""
    n = len(rows)
    temps = [float(r.get("temperature", 1.0)) for r in rows]
    greedy = [t == 0.0 for t in temps]
    ks = [int(r.get("top_k", 0)) for r in rows]
    ps = [float(r.get("top_p", 1.0)) for r in rows]
    mps = [float(r.get("min_p", 0.0)) for r in rows]
    pres = [float(r.get("presence", 0.0)) for r in rows]
    freq = [float(r.get("frequency", 0.0)) for r in rows]
    rep = [float(r.get("repetition", 1.0)) for r in rows]
    penalties = any(p != 0.0 for p in pres + freq) or any(p != 1.0 for p in rep)
    counts = mask = None
    if penalties:
        counts = torch.zeros(n, vocab, dtype=torch.int32)
        mask = torch.zeros(n, vocab, dtype=torch.bool)
        for i in range(n):
            for t in (output_ids or [[]] * n)[i]:
                counts[i, t] += 1
            for t in (prompt_ids or [[]] * n)[i]:
                mask[i, t] = True
    block = None
    if blocked is not None:
        block = torch.zeros(n, vocab, dtype=torch.bool)
        for i, ids in enumerate(blocked):
            block[i, ids] = True
    gens = []
    for r, g in zip(rows, greedy):
        seed = r.get("seed")
        gens.append(None if seed is None or g else torch.Generator().manual_seed(seed))
    return SamplingBatch(
        temperature=torch.tensor([1.0 if g else t for t, g in zip(temps, greedy)]),
        greedy=torch.tensor(greedy),
        all_greedy=all(greedy),
        top_k=torch.tensor([k or vocab for k in ks]) if any(ks) else None,
        top_p=torch.tensor(ps) if any(p < 1.0 for p in ps) else None,
        min_p=torch.tensor(mps) if any(m > 0.0 for m in mps) else None,
        presence=torch.tensor(pres) if penalties else None,
        frequency=torch.tensor(freq) if penalties else None,
        repetition=torch.tensor(rep) if penalties else None,
        output_counts=counts,
        prompt_mask=mask,
        blocked=block,
        generators=gens,
        num_logprobs=[r.get("logprobs") for r in rows],
    )


TOL = 1e-5  # probability slack at a top-p / min-p boundary (the sampler works in float32)


def allowed_probs(logits: np.ndarray, row: dict) -> tuple[np.ndarray, np.ndarray]:
    """Reference filters in float64: (surely allowed mask, renormalized probabilities) for one row.

    Tokens within TOL of a top-p / min-p boundary count as allowed (float32 may fall either way)."""
    x = logits.astype(np.float64) / row.get("temperature", 1.0)
    keep = np.ones_like(x, dtype=bool)
    k = row.get("top_k", 0)
    if k:
        keep &= np.argsort(np.argsort(-x)) < k
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    top_p = row.get("top_p", 1.0)
    if top_p < 1.0:
        order = np.argsort(-p)
        before = np.empty_like(p)
        before[order] = np.cumsum(p[order]) - p[order]
        keep &= before < top_p + TOL
        p = np.where(before < top_p, p, 0.0)
        p /= p.sum()
    min_p = row.get("min_p", 0.0)
    if min_p > 0.0:
        keep &= p >= min_p * p.max() - TOL
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return keep, p


def random_logits(rows: int, vocab: int, seed: int, scale: float = 2.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


FILTERS = [
    dict(top_k=1),
    dict(top_k=5),
    dict(top_k=5, temperature=0.5),
    dict(top_p=0.3),
    dict(top_p=0.9, temperature=1.7),
    dict(min_p=0.1),
    dict(min_p=0.5, temperature=0.7),
    dict(top_k=8, top_p=0.6),
    dict(top_k=10, min_p=0.2),
    dict(top_k=12, top_p=0.8, min_p=0.05, temperature=1.3),
]


@pytest.mark.parametrize("row", FILTERS, ids=[str(f) for f in FILTERS])
def test_filters_never_leave_allowed_set(row):
    rows, vocab = 3000, 64
    logits = random_logits(rows, vocab, seed=len(str(row)))
    tokens, lps = Sampler(torch.Generator().manual_seed(1))(logits, make_batch([row] * rows, vocab))
    assert lps == [None] * rows
    excluded_somewhere = False
    for i, tok in enumerate(tokens):
        keep, _ = allowed_probs(logits[i].numpy(), row)
        assert keep[tok], f"row {i}: token {tok} is outside the allowed set for {row}"
        excluded_somewhere |= not keep.all()
    assert excluded_somewhere
    if row.get("top_k") != 1:
        assert len(set(tokens)) > 10  # really sampling, not argmax


@pytest.mark.parametrize(
    "row",
    [dict(), dict(temperature=0.5), dict(temperature=2.0), *FILTERS[1:]],
    ids=lambda r: str(r),
)
def test_sampling_distribution_matches_filtered_softmax(row):
    draws, vocab = 20000, 16
    logits = torch.linspace(2.0, -2.0, vocab)[
        torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    ]
    _, expected = allowed_probs(logits.numpy(), row)
    tokens, _ = Sampler(torch.Generator().manual_seed(2))(
        logits.expand(draws, vocab).clone(), make_batch([row] * draws, vocab)
    )
    freq = np.bincount(tokens, minlength=vocab) / draws
    assert np.all(freq[expected == 0] == 0)
    np.testing.assert_allclose(freq, expected, atol=0.015)


def test_mixed_rows_in_one_batch():
    vocab = 48
    kinds = [
        dict(temperature=0.0),
        dict(top_k=3),
        dict(top_p=0.5),
        dict(min_p=0.3),
        dict(temperature=0.0, top_k=2, top_p=0.1),  # greedy ignores filters
        dict(top_k=6, top_p=0.7, temperature=0.8),
        dict(),
        dict(seed=11, top_k=4),
    ]
    rows = [kinds[i % len(kinds)] for i in range(800)]
    logits = random_logits(len(rows), vocab, seed=5)
    tokens, _ = Sampler(torch.Generator().manual_seed(4))(logits, make_batch(rows, vocab))
    argmax = logits.argmax(dim=-1).tolist()
    for i, (row, tok) in enumerate(zip(rows, tokens)):
        if row.get("temperature", 1.0) == 0.0:
            assert tok == argmax[i]
        else:
            keep, _ = allowed_probs(logits[i].numpy(), row)
            assert keep[tok], (i, row, tok)
    sampled = [t for r, t, a in zip(rows, tokens, argmax) if r == dict()]
    assert any(t != a for t, a in zip(sampled, argmax[6 :: len(kinds)]))


def test_greedy_rows_unaffected_by_other_rows():
    vocab, n = 40, 64
    logits = random_logits(n, vocab, seed=6)
    argmax = logits.argmax(dim=-1).tolist()
    alone, _ = Sampler(torch.Generator().manual_seed(0))(
        logits, make_batch([dict(temperature=0.0)] * n, vocab)
    )
    assert alone == argmax
    others = [
        dict(top_k=2, temperature=1.5),
        dict(top_p=0.2),
        dict(min_p=0.9),
        dict(repetition=3.0, presence=2.0, frequency=2.0),
        dict(seed=1, logprobs=5),
    ]
    rows = [dict(temperature=0.0) if i % 2 == 0 else others[i % len(others)] for i in range(n)]
    prompt = [[int(a)] for a in argmax]  # penalties on other rows would hit exactly the argmax tokens
    tokens, _ = Sampler(torch.Generator().manual_seed(0))(
        logits, make_batch(rows, vocab, prompt_ids=prompt, output_ids=prompt)
    )
    assert [t for i, t in enumerate(tokens) if i % 2 == 0] == argmax[::2]
    penalized = [i for i in range(n) if rows[i].get("repetition")]
    assert any(tokens[i] != argmax[i] for i in penalized)  # the penalties did act on their own rows


def test_seeded_row_independent_of_batch_and_position():
    vocab, steps = 64, 12
    step_logits = random_logits(steps, vocab, seed=7, scale=0.5)  # flat: many tokens likely
    target = dict(seed=1234, top_k=40)

    def run(make_rows, index):
        sampler = Sampler(torch.Generator().manual_seed(99))
        rows = make_rows()
        sb = make_batch(rows, vocab)  # generators are created once and carried across steps
        out = []
        for s in range(steps):
            logits = random_logits(len(rows), vocab, seed=100 + s)
            logits[index] = step_logits[s]
            tokens, _ = sampler(logits, sb)
            out.append(tokens[index])
        return out

    alone = run(lambda: [target], 0)
    assert alone == run(lambda: [target], 0)
    crowd = lambda: [dict(), dict(temperature=0.0), target, dict(seed=5, top_p=0.5), dict(min_p=0.2), dict()]
    assert run(crowd, 2) == alone
    crowd2 = lambda: [dict(seed=8), target, dict(top_k=3)]
    assert run(crowd2, 1) == alone
    other_seed = run(lambda: [dict(seed=1235, top_k=40)], 0)
    assert other_seed != alone
    assert len(set(alone)) > 3


def _hf_repetition(logits: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    proc = RepetitionPenaltyLogitsProcessor(penalty=penalty)
    return proc(torch.tensor([ids], dtype=torch.long), logits[None].clone())[0]


def _penalty_case(seed: int = 8):
    vocab, n = 50, 40
    rng = np.random.default_rng(seed)
    logits = random_logits(n, vocab, seed=seed)
    # Push tokens to both signs and give every row a few repeats, some tokens in both prompt and output.
    prompt = [rng.integers(0, vocab, size=rng.integers(1, 12)).tolist() for _ in range(n)]
    output = [
        (rng.integers(0, vocab, size=rng.integers(0, 10)).tolist() + prompt[i][:2] * 2) for i in range(n)
    ]
    rows = []
    for _ in range(n):
        rows.append(
            dict(
                temperature=0.0,
                repetition=float(rng.choice([1.0, 0.5, 1.3, 2.5])),
                presence=float(rng.choice([0.0, -1.0, 0.7, 2.0])),
                frequency=float(rng.choice([0.0, -0.5, 0.4, 2.0])),
            )
        )
    return vocab, logits, prompt, output, rows


def _reference_penalized(logits, prompt, output, rows):
    ref = []
    for i, row in enumerate(rows):
        # Repetition: HF's processor over prompt + output tokens.
        x = _hf_repetition(logits[i], prompt[i] + output[i], row["repetition"])
        # Presence / frequency: OpenAI / vLLM, over output tokens only.
        counts = torch.bincount(torch.tensor(output[i], dtype=torch.long), minlength=x.shape[0]).float()
        x = x - row["frequency"] * counts - row["presence"] * (counts > 0).float()
        ref.append(x)
    return torch.stack(ref)


def test_penalties_match_reference_values():
    vocab, logits, prompt, output, rows = _penalty_case()
    sb = make_batch(rows, vocab, prompt_ids=prompt, output_ids=output)
    got = Sampler._penalize(logits.clone(), sb)
    ref = _reference_penalized(logits, prompt, output, rows)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # Tokens only in the prompt get the repetition penalty but never presence / frequency.
    i = next(
        i
        for i, r in enumerate(rows)
        if r["repetition"] == 1.0 and r["presence"] != 0.0 and set(prompt[i]) - set(output[i])
    )
    t = next(iter(set(prompt[i]) - set(output[i])))
    assert got[i, t] == logits[i, t]


def test_greedy_with_penalties_is_argmax_of_hf_processed_logits():
    vocab, logits, prompt, output, rows = _penalty_case(seed=9)
    ref = _reference_penalized(logits, prompt, output, rows).argmax(dim=-1).tolist()
    tokens, _ = Sampler(torch.Generator())(
        logits, make_batch(rows, vocab, prompt_ids=prompt, output_ids=output)
    )
    assert tokens == ref
    assert sum(a != b for a, b in zip(ref, logits.argmax(dim=-1).tolist())) >= 5


def test_blocked_tokens_never_chosen():
    vocab, n = 32, 400
    logits = random_logits(n, vocab, seed=10)
    top2 = logits.topk(2, dim=-1).indices
    # Block each row's most likely token (and token 0): greedy takes the runner-up, sampling never picks them.
    blocked = [[int(top2[i, 0]), 0] for i in range(n)]
    rows = [dict(temperature=0.0) if i % 2 else dict(top_k=3) for i in range(n)]
    tokens, _ = Sampler(torch.Generator().manual_seed(0))(logits, make_batch(rows, vocab, blocked=blocked))
    for i, t in enumerate(tokens):
        assert t not in blocked[i]
        if i % 2:
            masked = logits[i].clone()
            masked[blocked[i]] = float("-inf")
            assert t == int(masked.argmax())


def test_held_stop_tokens_yield_only_where_nothing_else_is_allowed():
    vocab, n = 16, 4
    logits = random_logits(n, vocab, seed=11)
    eos = int(logits[0].argmax())
    # Rows 0 and 2: every token but EOS forbidden (a finished grammar); rows 1 and 3: free.
    blocked = [[t for t in range(vocab) if t != eos] if i % 2 == 0 else [] for i in range(n)]
    rows = [dict(temperature=0.0) if i < 2 else dict(top_k=3) for i in range(n)]
    sb = make_batch(rows, vocab, blocked=blocked)
    held = torch.zeros(n, vocab, dtype=torch.bool)
    held[:, eos] = True
    sb.held_stops = held
    tokens, _ = Sampler(torch.Generator().manual_seed(0))(logits, sb)
    assert tokens[0] == eos and tokens[2] == eos
    assert tokens[1] != eos and tokens[3] != eos


def test_sampler_logprobs_are_raw_with_correct_ranks():
    vocab = 40
    rows = [
        dict(temperature=0.0, logprobs=3),
        dict(logprobs=None),
        dict(temperature=0.3, top_k=5, logprobs=0),
        dict(temperature=1.5, logprobs=20, repetition=2.0, presence=1.0),
        dict(min_p=0.5, logprobs=1, seed=3),
    ]
    logits = random_logits(len(rows), vocab, seed=11)
    sb = make_batch(rows, vocab, prompt_ids=[[1, 2, 3]] * len(rows), output_ids=[[4, 4]] * len(rows))
    tokens, lps = Sampler(torch.Generator().manual_seed(0))(logits, sb)
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, row in enumerate(rows):
        k = row["logprobs"]
        if k is None:
            assert lps[i] is None
            continue
        lp = lps[i]
        tok = tokens[i]
        assert math.isclose(lp.logprob, raw[i, tok].item(), abs_tol=1e-5)
        assert lp.rank == 1 + int((raw[i] > raw[i, tok]).sum())
        assert lp.top_ids == raw[i].topk(k).indices.tolist()
        np.testing.assert_allclose(lp.top_logprobs, raw[i].topk(k).values.numpy(), atol=1e-5)
    assert lps[0].rank == 1


# ---------------------------------------------------------------------------------------------------------
# SamplingParams validation
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(n=1.5), "n"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(logprobs=100), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(stop=""), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(stop=5), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(stop_token_ids=7), "stop_token_ids"),
        (dict(seed="x"), "seed"),
        (dict(seed=2**64), "seed"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else None,
)
def test_invalid_params_raise_naming_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def test_valid_edge_params_accepted():
    sp = SamplingParams(
        top_k=-1, top_p=1.0, min_p=1.0, temperature=0, stop="x", stop_token_ids=(1,), seed=-(2**63)
    )
    assert sp.top_k == 0 and sp.stop == ["x"] and sp.stop_token_ids == [1] and sp.greedy
    assert SamplingParams(max_tokens=None, min_tokens=10).max_tokens is None
    assert SamplingParams(logprobs=0).logprobs == 0


# ---------------------------------------------------------------------------------------------------------
# End to end through LLM
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(model=str(llama_dir), seed=0)


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()


def gen(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


REF_TOKENS = 24


@pytest.fixture(scope="module")
def ref(llm) -> dict:
    """Greedy reference for every prompt (one batched call): prompt -> RequestOutput with top-2 logprobs."""
    outs = gen(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=REF_TOKENS, logprobs=2))
    return dict(zip(PROMPTS, outs))


def prompt_ids(llm: LLM, prompt: str) -> list[int]:
    return llm.get_tokenizer().encode(prompt)


def test_seeded_sampling_reproducible_and_batch_invariant(llm, ref):
    p = PROMPTS[0]
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)
    first = gen(llm, p, sp)[0].outputs[0].token_ids
    assert len(first) == 16
    assert gen(llm, p, sp)[0].outputs[0].token_ids == first
    assert first != ref[p].outputs[0].token_ids[:16]  # really sampled
    others = [
        SamplingParams(temperature=0.0, max_tokens=8),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3, max_tokens=20),
        SamplingParams(temperature=1.0, seed=99, min_p=0.1, max_tokens=5, logprobs=2),
        SamplingParams(temperature=1.2, max_tokens=12, presence_penalty=1.0),
    ]
    outs = gen(
        llm, [PROMPTS[1], PROMPTS[2], p, PROMPTS[3], "x"], [others[0], others[1], sp, others[2], others[3]]
    )
    assert outs[2].outputs[0].token_ids == first
    outs = gen(llm, [p, PROMPTS[3] * 3], [sp, others[1]])
    assert outs[0].outputs[0].token_ids == first
    assert gen(llm, p, sp.clone(seed=1235))[0].outputs[0].token_ids != first


def test_greedy_rows_unaffected_by_other_requests(llm, ref):
    params = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=1.5, top_k=3, repetition_penalty=2.0, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=12, top_k=2, top_p=0.1, min_p=0.9),  # filters ignored
        SamplingParams(temperature=0.9, min_p=0.2, frequency_penalty=2.0, seed=4, max_tokens=6),
    ]
    outs = gen(llm, [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]], params)
    assert outs[0].outputs[0].token_ids == ref[PROMPTS[0]].outputs[0].token_ids[:12]
    assert outs[2].outputs[0].token_ids == ref[PROMPTS[1]].outputs[0].token_ids[:12]
    # The greedy reference really is the argmax: each token has rank 1.
    for out in ref.values():
        comp = out.outputs[0]
        assert all(lp[t].rank == 1 for t, lp in zip(comp.token_ids, comp.logprobs))


def test_n_samples_with_seed(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    a = gen(llm, PROMPTS[1], sp)[0]
    samples = [c.token_ids for c in a.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) >= 2
    b = gen(llm, [PROMPTS[0], PROMPTS[1]], [SamplingParams(temperature=1.0, max_tokens=7), sp])[1]
    assert [c.token_ids for c in b.outputs] == samples
    assert [c.text for c in b.outputs] == [c.text for c in a.outputs]


def test_seed_at_64_bit_edges(llm):
    outs = gen(llm, PROMPTS[:2], [SamplingParams(n=2, seed=s, max_tokens=3) for s in (2**63 - 1, -(2**63))])
    assert [[len(c.token_ids) for c in o.outputs] for o in outs] == [[3, 3], [3, 3]]


def _hf_generate(hf_model, ids: list[int], max_new: int, **kw):
    out = hf_model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        pad_token_id=2,
        return_dict_in_generate=True,
        output_logits=True,
        **kw,
    )
    return out.sequences[0, len(ids) :].tolist(), [lg[0].double() for lg in out.logits]


@pytest.mark.parametrize("penalty", [0.7, 1.8])
def test_repetition_penalty_matches_hf_generate(llm, hf_model, ref, penalty):
    p = PROMPTS[1]
    max_new = 16
    # min_tokens=max_tokens blocks EOS like HF's min_new_tokens.
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, min_tokens=max_new, repetition_penalty=penalty)
    ours = gen(llm, p, sp)[0].outputs[0]
    hf_tokens, _ = _hf_generate(hf_model, prompt_ids(llm, p), max_new, repetition_penalty=penalty)
    assert ours.token_ids == hf_tokens
    assert ours.token_ids != ref[p].outputs[0].token_ids[:max_new]  # the penalty changed the output


@pytest.mark.parametrize(
    "pen",
    [
        dict(presence_penalty=2.0),
        dict(frequency_penalty=1.5),
        dict(frequency_penalty=-2.0, presence_penalty=0.5),
        dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3),
    ],
    ids=str,
)
def test_presence_frequency_penalties_match_reference(llm, hf_model, ref, pen):
    p = PROMPTS[3]  # its greedy output repeats tokens within a few steps
    steps = 16
    ours = gen(llm, p, SamplingParams(temperature=0.0, max_tokens=steps, min_tokens=steps, **pen))[0]
    out = ours.outputs[0].token_ids
    assert out != ref[p].outputs[0].token_ids[:steps]  # the penalties changed the output
    # Teacher-force our tokens through HF: each must be the argmax of HF's logits after the reference
    # penalties given the tokens before it (by induction, the same as a reference greedy loop).
    ids = ours.prompt_token_ids + out
    with torch.no_grad():
        all_logits = hf_model(torch.tensor([ids])).logits[0].float()
    n_prompt = len(ours.prompt_token_ids)
    for s in range(steps):
        logits = _hf_repetition(
            all_logits[n_prompt - 1 + s], ids[: n_prompt + s], pen.get("repetition_penalty", 1.0)
        )
        counts = torch.bincount(torch.tensor(out[:s], dtype=torch.long), minlength=logits.shape[0]).float()
        logits = logits - pen.get("frequency_penalty", 0.0) * counts
        logits = logits - pen.get("presence_penalty", 0.0) * (counts > 0).float()
        logits[2] = float("-inf")  # EOS, blocked by min_tokens
        assert out[s] == int(logits.argmax()), f"step {s}"


def test_greedy_logprobs_match_hf(llm, hf_model):
    p = PROMPTS[2]
    max_new, k = 12, 5
    out = gen(llm, p, SamplingParams(temperature=0.0, max_tokens=max_new, min_tokens=max_new, logprobs=k))[0]
    comp = out.outputs[0]
    hf_tokens, hf_logits = _hf_generate(hf_model, out.prompt_token_ids, max_new)
    assert comp.token_ids == hf_tokens
    assert len(comp.logprobs) == max_new
    total = 0.0
    for tok, entry, logits in zip(comp.token_ids, comp.logprobs, hf_logits):
        want = torch.log_softmax(logits, dim=-1)
        assert tok == int(want.argmax())  # greedy is argmax
        assert len(entry) == k and tok in entry
        assert entry[tok].rank == 1
        top = want.topk(k)
        assert list(entry) == top.indices.tolist()
        assert [entry[t].rank for t in entry] == list(range(1, k + 1))
        for t, lp in entry.items():
            assert abs(lp.logprob - want[t].item()) < 1e-4
        total += entry[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_logprobs_ranks_and_values(llm, hf_model, k):
    p = PROMPTS[3]
    sp = SamplingParams(temperature=1.3, seed=5, max_tokens=16, logprobs=k, ignore_eos=True)
    out = gen(llm, p, sp)[0]
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    want = torch.log_softmax(logits[len(out.prompt_token_ids) - 1 : -1], dim=-1)
    ranks = []
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        rank = 1 + int((want[i] > want[i, tok]).sum())
        ranks.append(rank)
        assert entry[tok].rank == rank
        assert (
            abs(entry[tok].logprob - want[i, tok].item()) < 1e-4
        )  # raw model logprob, not temperature-scaled
        top = want[i].topk(k).indices.tolist()
        assert set(entry) == (set(top) if rank <= k else {*top, tok})
        for r, t in enumerate(top, start=1):
            assert entry[t].rank == r
            assert abs(entry[t].logprob - want[i, t].item()) < 1e-4
    assert max(ranks) > 1  # sampled, not greedy


def _clean(s: str) -> bool:
    return "\ufffd" not in s and s.strip() == s and len(s) > 0


def test_stop_string_cuts_exactly(llm, ref):
    p = PROMPTS[1]
    full = ref[p].outputs[0]
    text = full.text
    n = len(text)
    i = next(
        i for i in range(n // 3, 2 * n // 3) if _clean(text[i : i + 3]) and text.find(text[i : i + 3]) == i
    )
    stop = text[i : i + 3]
    outs = gen(
        llm,
        [p, p],
        [
            SamplingParams(temperature=0.0, max_tokens=REF_TOKENS, stop=[stop]),
            SamplingParams(
                temperature=0.0, max_tokens=REF_TOKENS, stop=stop, include_stop_str_in_output=True
            ),
        ],
    )
    cut, incl = outs[0].outputs[0], outs[1].outputs[0]
    assert cut.text == text[:i]
    assert incl.text == text[: i + 3]
    for c in (cut, incl):
        assert c.finish_reason == "stop"
        assert c.stop_reason == stop
        assert len(c.token_ids) < REF_TOKENS
        assert c.token_ids == full.token_ids[: len(c.token_ids)]
    assert cut.token_ids == incl.token_ids


def test_stop_string_spanning_two_tokens(llm, ref):
    tok = llm.get_tokenizer()
    p = PROMPTS[0]
    full = ref[p].outputs[0]
    text, ids = full.text, full.token_ids
    candidates = []
    for j in range(2, len(ids) - 2):
        a, b = tok.decode(ids[:j]), tok.decode(ids[: j + 1])
        if not (text.startswith(a) and text.startswith(b)):
            continue
        cut = len(a)  # tokens before j end here, token j's text starts here
        stop = text[cut - 2 : cut + 2]
        if len(b) - len(a) >= 2 and _clean(stop) and text.find(stop) == cut - 2:
            candidates.append((cut - 2, stop))
    assert candidates, "no clean token boundary in the greedy text"
    pos, stop = candidates[len(candidates) // 2]
    assert not any(stop in tok.decode([t]) for t in ids)  # no single token holds it
    out = gen(llm, p, SamplingParams(temperature=0.0, max_tokens=REF_TOKENS, stop=[stop]))[0].outputs[0]
    assert out.text == text[:pos]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_stop_token_ids(llm, ref):
    p = PROMPTS[2]
    g = ref[p].outputs[0].token_ids
    j = next(j for j in range(4, 20) if g[j] not in g[:j])
    outs = gen(
        llm,
        [p, p],
        [
            SamplingParams(temperature=0.0, max_tokens=REF_TOKENS, stop_token_ids=[g[j], 511]),
            SamplingParams(temperature=0.0, max_tokens=j),
        ],
    )
    stopped, short = outs[0].outputs[0], outs[1].outputs[0]
    assert stopped.token_ids == g[: j + 1]  # the stop token is kept in token_ids ...
    assert stopped.text == short.text  # ... but not in the text
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", g[j])
    assert (short.finish_reason, short.stop_reason) == ("length", None)
    assert short.token_ids == g[:j]


def test_min_tokens_suppresses_stop_token(llm, ref):
    p = PROMPTS[0]
    first = ref[p].outputs[0]
    g0 = first.token_ids[0]
    runner_up = next(t for t in first.logprobs[0] if t != g0)
    outs = gen(
        llm,
        [p, p],
        [
            SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[g0]),
            SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[g0], min_tokens=4),
        ],
    )
    now, later = outs[0].outputs[0], outs[1].outputs[0]
    assert (now.token_ids, now.text, now.finish_reason, now.stop_reason) == ([g0], "", "stop", g0)
    assert later.token_ids[0] == runner_up
    assert g0 not in later.token_ids[:4]
    assert len(later.token_ids) >= 4
    if later.finish_reason == "stop":
        assert later.token_ids[-1] == g0 and g0 not in later.token_ids[:-1]
    else:
        assert later.finish_reason == "length" and len(later.token_ids) == 16


def test_min_tokens_suppresses_eos(model_factory, ref):
    p = PROMPTS[0]
    g = ref[p].outputs[0].token_ids[:8]
    # Same weights (same init seed), but the greedy first token is now the EOS token.
    eos_llm = LLM(model=str(model_factory("llama", eos_token_id=g[0])), seed=0)
    outs = gen(
        eos_llm,
        [p, p, p],
        [
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=8),
            SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3),
        ],
    )
    ignored, now, later = (o.outputs[0] for o in outs)
    assert ignored.token_ids == g and ignored.finish_reason == "length"
    assert (now.token_ids, now.text, now.finish_reason, now.stop_reason) == ([g[0]], "", "stop", None)
    assert g[0] not in later.token_ids[:3]
    assert len(later.token_ids) >= 3
    assert later.token_ids[0] == next(t for t in ref[p].outputs[0].logprobs[0] if t != g[0])


def test_min_tokens_defers_stop_strings(llm, ref):
    p = PROMPTS[3]
    full = ref[p].outputs[0]
    text = full.text
    i = next(
        i for i in range(2, len(text) // 2) if _clean(text[i : i + 2]) and text.count(text[i : i + 2]) == 1
    )
    stop = text[i : i + 2]
    outs = gen(
        llm,
        [p, p],
        [SamplingParams(temperature=0.0, max_tokens=REF_TOKENS, stop=[stop], min_tokens=m) for m in (0, 1)],
    )
    stopped = outs[0].outputs[0]
    assert stopped.text == text[:i]
    k = len(stopped.token_ids)  # the token completing the stop string
    assert stop not in llm.get_tokenizer().decode(full.token_ids[: k - 1])
    deferred = gen(llm, p, SamplingParams(temperature=0.0, max_tokens=REF_TOKENS, stop=[stop], min_tokens=k))
    out = deferred[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (
        text,
        full.token_ids,
        "length",
        None,
    )
    if k > 1:  # min_tokens below the completing token does not defer it
        assert outs[1].outputs[0].text == text[:i]


def test_max_tokens_gives_length(llm):
    outs = gen(llm, PROMPTS[:2], [SamplingParams(max_tokens=1, seed=1), SamplingParams(max_tokens=7, seed=2)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 7]
    assert all(o.outputs[0].finish_reason == "length" and o.outputs[0].stop_reason is None for o in outs)
    assert all(o.finished for o in outs)


def test_stop_string_on_last_allowed_token(llm):
    p = PROMPTS[0]
    outs = gen(llm, [p, p], [SamplingParams(temperature=0.0, max_tokens=m) for m in (9, 10)])
    before, text = outs[0].outputs[0].text, outs[1].outputs[0].text
    assert text.startswith(before) and len(text) > len(before)
    # A clean tail that only the last token's text completes, occurring only there.
    stop = next(
        text[i:]
        for i in range(len(text) - 1, len(before) - 1, -1)
        if _clean(text[i:]) and text.find(text[i:]) == i
    )
    out = gen(llm, p, SamplingParams(temperature=0.0, max_tokens=10, stop=[stop]))[0].outputs[0]
    assert out.text == text[: len(text) - len(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
