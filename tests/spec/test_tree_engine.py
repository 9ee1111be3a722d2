"""Tree verification through the engine: suffix speculation's draft trees (branching where the
text continued several ways) verified in one pass, the accepted path's KV moved into place when it
is not the first branch, and the output identical to a run without speculation: greedy with
penalties, n > 1, structured output, preemption, chunked prefill and prefix caching in the same
run, on the torch backend's grouped path (the kernels are causal). The Triton backend's tree mask:
tests/gpu/test_triton_parity.py."""

from __future__ import annotations

import pytest
from test_spec_decode import ENGINE, TARGET, make_prompts

import tandem.worker.model_runner as model_runner
from tandem import LLM, SamplingParams
from tandem.sampling_params import StructuredOutputsParams

SPEC = {
    "method": "suffix",
    "num_speculative_tokens": 8,
    "suffix_decoding_min_token_prob": 0.0,
    "suffix_decoding_max_spec_factor": 4.0,
    "adaptive": False,
}


def params() -> list[SamplingParams]:
    out = []
    for i in range(8):
        kw: dict = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
        if i == 1:
            kw.update(n=2)
        elif i == 3:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.2, logprobs=2)
        elif i == 5:
            kw.update(structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,30}"))
        out.append(SamplingParams(**kw))
    return out


def run(model_dir, spec, **extra):
    llm = LLM(str(model_dir), speculative_config=spec, **{**ENGINE, **extra})
    outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params(), use_tqdm=False)
    return llm, [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], outs


@pytest.fixture(scope="module")
def target_dir(model_factory):
    return model_factory("llama", **TARGET)


@pytest.fixture
def counted(monkeypatch):
    """Counts tree verifications and the accepted paths moved into place."""
    seen = {"trees": 0, "branched": 0, "moved": 0}
    verify, compact = model_runner.verify_trees, model_runner.compact_accepted

    def verify_trees(sampler, logits, sb, spans, out, used_rows):
        seen["trees"] += len(spans)
        seen["branched"] += sum(any(len(t.children(n)) > 1 for n in range(-1, len(t))) for _, _, t in spans)
        return verify(sampler, logits, sb, spans, out, used_rows)

    def compact_accepted(kv_caches, reqs, paths, out, block_size):
        seen["moved"] += sum(any(node != j for j, node in enumerate(p)) for p in paths.values())
        return compact(kv_caches, reqs, paths, out, block_size)

    monkeypatch.setattr(model_runner, "verify_trees", verify_trees)
    monkeypatch.setattr(model_runner, "compact_accepted", compact_accepted)
    return seen


def test_trees_verify_losslessly_and_move_off_branch_paths(target_dir, counted):
    _, base, base_outs = run(target_dir, None)
    llm, got, outs = run(target_dir, SPEC)
    assert got == base
    assert outs[3].outputs[0].logprobs is not None
    for g, w in zip(outs[3].outputs[0].logprobs, base_outs[3].outputs[0].logprobs):
        assert g.keys() == w.keys()
    assert counted["trees"] >= 5 and counted["branched"] > 0 and counted["moved"] > 0, counted
    engine = llm.engine
    assert engine.counters.num_preemptions > 0 and engine.counters.prefix_cache_hits > 0
    assert engine.kv.usage == 0.0
    engine.kv.check_invariants()
    assert engine.counters.spec_decode_num_accepted_tokens > 0
