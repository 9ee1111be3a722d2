"""The reference the parity tests compare against: greedy decoding through transformers itself."""

from __future__ import annotations

from pathlib import Path

import torch

_CACHE: dict[str, list[tuple[list[int], torch.Tensor]]] = {}


def hf_greedy(
    model_dir: Path | str, prompts: list[list[int]], max_tokens: int, fresh: bool = False
) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt alone through transformers in float32: greedy token ids and per-step
    log-softmax, exactly `max_tokens` of them (EOS masked, as `min_tokens` does). With `fresh`, each
    prompt gets a model loaded for it (dynamic rope keeps state from one call to the next)."""
    from transformers import AutoModelForCausalLM

    key = f"{model_dir}:{max_tokens}:{prompts}"
    if key not in _CACHE:
        results = []
        model = None
        for p in prompts:
            if model is None or fresh:
                model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
            ids = torch.tensor([p])
            with torch.no_grad():
                g = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
            logprobs = torch.log_softmax(torch.stack(g.logits, dim=1)[0].float(), dim=-1)
            results.append((g.sequences[0, len(p) :].tolist(), logprobs))
        _CACHE[key] = results
    return _CACHE[key]


def assert_matches(
    prompts: list[list[int]], outs: list, expected: list[tuple[list[int], torch.Tensor]], label: str = ""
) -> None:
    """Tandem's greedy outputs (RequestOutputs with logprobs) equal the reference's token for token,
    and every returned logprob is within 1e-4 of the reference's."""
    for prompt, out, (ref_ids, ref_lp) in zip(prompts, outs, expected, strict=True):
        got = out.outputs[0]
        assert got.token_ids == ref_ids, f"{label}prompt of {len(prompt)} tokens diverged"
        for step, entry in enumerate(got.logprobs):
            for tid, lp in entry.items():
                assert abs(lp.logprob - ref_lp[step, tid].item()) < 1e-4
