"""logit_bias, allowed_token_ids and bad_words: the LLM API on a tiny random-weight llama against a
greedy loop over transformers' logits with the same control applied by hand; validation."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.token_controls import bad_words_token_ids

PROMPTS = ["def foo(x):\n    return x + x", "import os\nimport sys\n"]
STEPS = 10


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), num_kv_blocks=64, max_num_seqs=4, num_threads=1)


@pytest.fixture(scope="module")
def hf(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32).eval()


def hf_greedy(hf, prompt_ids: list[int], control: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> list[int]:
    """Greedy decoding over transformers' logits, `control(logits, output_so_far)` applied each step."""
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            tok = int(control(logits, out).argmax())
            out.append(tok)
            ids.append(tok)
    return out


def run(llm, prompts, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def prompt_ids(llm, prompt):
    return llm.get_tokenizer().encode(prompt)


def test_allowed_token_ids_equal_masked_greedy(llm, hf):
    allowed = [5, 17, 40, 41, 99, 300]
    got = run(llm, PROMPTS, allowed_token_ids=allowed)

    def control(logits, _):
        mask = torch.full_like(logits, float("-inf"))
        mask[allowed] = 0.0
        return logits + mask

    for prompt, tokens in zip(PROMPTS, got):
        assert set(tokens) <= set(allowed)
        assert tokens == hf_greedy(hf, prompt_ids(llm, prompt), control)


def test_allowed_token_ids_hold_when_sampling(llm):
    allowed = [7, 8, 9]
    params = SamplingParams(temperature=1.5, max_tokens=20, ignore_eos=True, seed=3, allowed_token_ids=allowed)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert set(out.outputs[0].token_ids) <= set(allowed)


def test_min_tokens_yields_when_only_stop_tokens_are_allowed(llm):
    """allowed_token_ids of stop tokens only and min_tokens above zero: the hard constraint wins and
    the request stops at once, rather than emitting a token outside the allowed set."""
    stop, other = 9, 11
    only_stop = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, allowed_token_ids=[stop],
                               stop_token_ids=[stop])
    mixed = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, allowed_token_ids=[stop, other],
                           stop_token_ids=[stop])
    a, b = (o.outputs[0] for o in llm.generate([PROMPTS[0]] * 2, [only_stop, mixed], use_tqdm=False))
    assert (a.token_ids, a.finish_reason, a.stop_reason) == ([stop], "stop", stop)
    # Where another allowed token exists, min_tokens still holds the stop token back.
    assert b.token_ids[:4] == [other] * 4


def test_logit_bias_equals_biased_greedy(llm, hf):
    bias = {33: 8.0, 71: 5.5, 200: -100.0}
    got = run(llm, PROMPTS, logit_bias=bias)

    def control(logits, _):
        logits = logits.clone()
        for t, b in bias.items():
            logits[t] += b
        return logits

    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == hf_greedy(hf, prompt_ids(llm, prompt), control)


def test_huge_logit_bias_forces_a_token(llm):
    for tokens in run(llm, PROMPTS, logit_bias={123: 100.0}):
        assert tokens == [123] * STEPS


def test_controls_leave_other_rows_of_the_batch_alone(llm):
    plain = run(llm, PROMPTS)
    params = [
        SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logit_bias={123: 100.0}),
        SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True),
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [123] * STEPS
    assert outs[1].outputs[0].token_ids == plain[1]


def test_bad_words_equal_blocked_greedy(llm, hf):
    tok = llm.get_tokenizer()
    plain = run(llm, PROMPTS)
    # Words the model emits unconstrained: one single-token, one spelled by two of its tokens.
    single = tok.decode([plain[0][0]]).strip() or tok.decode([plain[0][1]]).strip()
    double = tok.decode(plain[1][2:4])
    words = [w for w in (single, double) if w.strip()]
    assert words
    seqs = bad_words_token_ids(words, lambda w: tok.encode(w, add_special_tokens=False))
    got = run(llm, PROMPTS, bad_words=words)

    def control(logits, out):
        logits = logits.clone()
        for seq in seqs:
            ends_with_prefix = len(seq) == 1 or out[len(out) - len(seq) + 1 :] == seq[:-1]
            if ends_with_prefix and len(seq) - 1 <= len(out):
                logits[seq[-1]] = float("-inf")
        return logits

    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == hf_greedy(hf, prompt_ids(llm, prompt), control)
        for seq in seqs:
            assert not any(tokens[i : i + len(seq)] == seq for i in range(len(tokens)))
    assert got != plain


def test_bad_words_tokenized_with_and_without_a_leading_space(llm):
    tok = llm.get_tokenizer()
    encode = lambda w: tok.encode(w, add_special_tokens=False)
    seqs = bad_words_token_ids(["return"], encode)
    assert encode("return") in seqs
    spaced = encode(" return")
    assert (spaced in seqs) == (spaced[0] != encode("return")[0] and len(spaced) == len(encode("return")))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logit_bias", {5: 101.0}, "logit_bias values must be numbers in [-100, 100]"),
        ("logit_bias", {-1: 1.0}, "logit_bias keys must be non-negative token ids"),
        ("allowed_token_ids", [], "allowed_token_ids must be a non-empty list"),
        ("bad_words", [""], "bad_words must be a list of non-empty strings"),
        ("truncate_prompt_tokens", 0, "truncate_prompt_tokens must be -1"),
    ],
)
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="logit_bias token ids"):
        llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("x", SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = prompt_ids(llm, PROMPTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=3)
    (out,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert out.prompt_token_ids == ids[-3:]
    (ref,) = llm.generate({"prompt_token_ids": ids[-3:]}, params.clone(truncate_prompt_tokens=None), use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
