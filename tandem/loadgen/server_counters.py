"""The server's own counters over a run, from its Prometheus /metrics text (`tandem:` or `vllm:` names):
prefix-cache hits, speculative acceptance, preemptions, tokens."""

from __future__ import annotations

import re

SERVER_COUNTERS = {
    "prefix_cache_hits": "prefix_cache_hits_total",
    "prefix_cache_queries": "prefix_cache_queries_total",
    "spec_decode_accepted_tokens": "spec_decode_num_accepted_tokens_total",
    "spec_decode_draft_tokens": "spec_decode_num_draft_tokens_total",
    "spec_decode_drafts": "spec_decode_num_drafts_total",
    "preemptions": "num_preemptions_total",
    "swap_outs": "num_swap_outs_total",
    "swap_ins": "num_swap_ins_total",
    "swap_out_bytes": "swap_out_bytes_total",
    "prompt_tokens": "prompt_tokens_total",
    "generation_tokens": "generation_tokens_total",
}
_PREFIXES = ("tandem:", "vllm:")
_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample of each metric name over its labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def server_counters(samples: dict[str, float]) -> dict[str, float]:
    """Our names -> values, from `tandem:` or `vllm:` counters (older vLLMs: `gpu_` prefix-cache names)."""
    out: dict[str, float] = {}
    for ours, theirs in SERVER_COUNTERS.items():
        for prefix in _PREFIXES:
            for name in (prefix + theirs, prefix + theirs.replace("prefix_cache", "gpu_prefix_cache")):
                if name in samples:
                    out[ours] = out.get(ours, 0.0) + samples[name]
                    break
    return out


def counter_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """after - before for counters both scrapes have, plus hit rate and acceptance rate where defined."""
    if not before or not after:
        return {}
    out = {k: after[k] - before[k] for k in after if k in before}
    if out.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0.0) / out["prefix_cache_queries"]
    if out.get("spec_decode_draft_tokens"):
        out["spec_decode_acceptance_rate"] = (
            out.get("spec_decode_accepted_tokens", 0.0) / out["spec_decode_draft_tokens"]
        )
    return out
