"""Batched sampling over one step's logits rows.

Every transform is a tensor op over all rows at once; the only per-row Python
is drawing noise from a request's own seeded generator (seeded requests must
not depend on what else is in the batch). Order: penalties, logit_bias, the token
masks (allowed_token_ids, bad_words, the grammar), the stop tokens held back under
`min_tokens` (unless nothing else is left), then greedy argmax, or temperature,
top-k, top-p, min-p and an exponential-race draw (argmax of p / E, E ~ Exp(1), is a sample from p).
Returned logprobs are those of the raw model distribution, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tandem.core.request import Request
from tandem.core.step_io import SampledLogprobs


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first highest index, as `argmax(dim=-1)`: `max` finds the same index (ties and
    NaN alike) in a third of argmax's time on CPU, a millisecond a step at 32 rows of 32k."""
    return logits.max(dim=-1).indices


@dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [R] float, 1.0 on greedy rows
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [R] int, vocab size where disabled
    top_p: torch.Tensor | None  # [R] float
    min_p: torch.Tensor | None  # [R] float
    presence: torch.Tensor | None  # [R] float; the three penalties are None together
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    output_counts: torch.Tensor | None  # [R, V] occurrences of each token in the output so far
    prompt_mask: torch.Tensor | None  # [R, V] token occurs in the prompt
    blocked: torch.Tensor | None  # [R, V] tokens forbidden this step (allowed_token_ids, bad_words)
    generators: list[torch.Generator | None]  # per row; None uses the engine's generator
    num_logprobs: list[int | None]  # per row
    # [R, V] tokens a row's grammar forbids (structured output); None when no row is constrained.
    grammar_forbidden: torch.Tensor | None = None
    # [R, V] added to the logits (logit_bias).
    bias: torch.Tensor | None = None
    # [R, V] stop tokens held back while a row has fewer than min_tokens outputs: yielded where
    # nothing else is allowed (a finished grammar, an allowed set of stop tokens only), since
    # min_tokens cannot be met there without breaking a hard constraint.
    held_stops: torch.Tensor | None = None
    # `greedy` as the host knows it: where given, the sampler finds the rows to draw for without
    # reading the device (overlap scheduling launches a step with no read back).
    greedy_rows: list[bool] | None = None


@dataclass(slots=True)
class _Counted:
    """One request's penalty inputs, as of its first `num_counted` output tokens."""

    # The request object counted: one that left and came back (moved, resumed elsewhere and back)
    # is a new object under the same id, whose tokens these counts know nothing about.
    request: Request
    counts: torch.Tensor  # [V] int32: occurrences of each token in the output
    prompt_mask: torch.Tensor  # [V] bool: token occurs in the prompt
    num_counted: int


class PenaltyState:
    """The penalties' per-request inputs, kept across steps: each step adds only the output tokens
    appended since the last, so a row costs O(V) whatever the request's length (rebuilt from the
    whole output and prompt every step, it cost O(L) a token and O(L^2) a request).

    Only requests using penalties have an entry ([V] int32 plus [V] bool, 5 bytes a vocabulary
    entry); the runner drops it when the request ends. Output tokens are only ever appended
    (rejected drafts never join them; drafts before a row are added to that row alone), so an entry
    stays valid across preemption and resumption; a request object it has not seen, or one with
    fewer outputs than counted, is counted afresh.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.entries: dict[str, _Counted] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.entries.pop(rid, None)

    def _entry(self, req: Request) -> _Counted:
        e = self.entries.get(req.request_id)
        num_out = req.num_output_tokens
        if e is None or e.request is not req or e.num_counted > num_out:
            dev, vocab = self.device, self.vocab_size
            prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=dev)
            prompt_mask[torch.tensor(req.prompt_token_ids, device=dev)] = True
            e = _Counted(req, torch.zeros(vocab, dtype=torch.int32, device=dev), prompt_mask, 0)
            self.entries[req.request_id] = e
        if e.num_counted < num_out:
            new = torch.tensor(req.token_ids[req.num_prompt_tokens + e.num_counted :], device=self.device)
            e.counts.index_add_(0, new, torch.ones_like(new, dtype=torch.int32))
            e.num_counted = num_out
        return e

    def rows(
        self, members: list[tuple[Request, list[int]]], penalized: list[bool]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[R, V]` output counts and prompt masks for rows of (request, draft tokens before the
        row): a row counts its drafts as output. Rows not `penalized` stay zero (their penalties
        are neutral, so what they count changes nothing)."""
        dev, vocab = self.device, self.vocab_size
        counts = torch.zeros(len(members), vocab, dtype=torch.int32, device=dev)
        prompt_mask = torch.zeros(len(members), vocab, dtype=torch.bool, device=dev)
        for i, ((req, history), on) in enumerate(zip(members, penalized)):
            if not on:
                continue
            e = self._entry(req)
            counts[i] = e.counts
            prompt_mask[i] = e.prompt_mask
            if history:
                ids = torch.tensor(history, device=dev)
                counts[i].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return counts, prompt_mask


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(
        self, logits: torch.Tensor, sb: SamplingBatch
    ) -> tuple[list[int], list[SampledLogprobs | None]]:
        logits = logits.float()
        want_lp = any(k is not None for k in sb.num_logprobs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None
        tokens = self.sample_tokens(logits, sb)
        token_list = tokens.tolist()
        lps: list[SampledLogprobs | None] = [None] * len(token_list)
        if raw_logprobs is not None:
            lps = self.logprobs(raw_logprobs, tokens, sb.num_logprobs)
        return token_list, lps

    def sample_tokens(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """Each row's token as a device tensor; with `sb.greedy_rows` given, nothing is read back
        to the host on the way."""
        logits = self._process(logits.float(), sb)
        tokens = row_argmax(logits)
        if not sb.all_greedy:
            if sb.greedy_rows is None:
                rows = torch.nonzero(~sb.greedy).squeeze(1)
                row_list = rows.tolist()
            else:
                row_list = [i for i, g in enumerate(sb.greedy_rows) if not g]
                rows = torch.tensor(row_list, dtype=torch.long, device=logits.device)
            probs = self._probs(logits[rows], sb, rows)
            tokens[rows] = self._draw(probs, sb, rows, row_list)
        return tokens

    def greedy_tokens(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """The argmax of each row after penalties and `min_tokens` masking."""
        return row_argmax(self._process(logits.float(), sb))

    def distribution(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """The distribution each row samples from, [R, V]: one-hot at the argmax on greedy rows."""
        logits = self._process(logits.float(), sb)
        probs = torch.zeros_like(logits)
        probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        if not sb.all_greedy:
            rows = torch.nonzero(~sb.greedy).squeeze(1)
            p = self._probs(logits[rows], sb, rows)
            probs[rows] = p / p.sum(dim=-1, keepdim=True)
        return probs

    def draw(self, probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """One token per row from (possibly unnormalized) `probs`, with each row's generator."""
        return self._draw(probs, sb, torch.arange(probs.shape[0], device=probs.device))

    def _process(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        if sb.repetition is not None:
            logits = self._penalize(logits, sb)
        if sb.bias is not None:
            logits = logits + sb.bias
        if sb.blocked is not None:
            logits = logits.masked_fill(sb.blocked, float("-inf"))
        if sb.grammar_forbidden is not None:
            logits = logits.masked_fill(sb.grammar_forbidden, float("-inf"))
        if sb.held_stops is not None:
            held = logits.masked_fill(sb.held_stops, float("-inf"))
            stuck = torch.isneginf(held).all(dim=-1, keepdim=True)
            logits = torch.where(stuck, logits, held)
        return logits

    @staticmethod
    def _penalize(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        mask, output_counts = sb.prompt_mask, sb.output_counts
        repetition, frequency, presence = sb.repetition, sb.frequency, sb.presence
        if mask is None or output_counts is None or repetition is None or frequency is None or presence is None:
            raise RuntimeError("a SamplingBatch's penalty tensors are set together or not at all")
        seen = mask | (output_counts > 0)
        rep = repetition[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        counts = output_counts.to(logits.dtype)
        logits = logits - frequency[:, None] * counts
        return logits - presence[:, None] * (counts > 0).to(logits.dtype)

    def _probs(self, logits: torch.Tensor, sb: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p: unnormalized probabilities of the given rows."""
        logits = logits / sb.temperature[rows, None]
        if sb.top_k is not None or sb.top_p is not None:
            logits = self._top_k_top_p(
                logits,
                None if sb.top_k is None else sb.top_k[rows],
                None if sb.top_p is None else sb.top_p[rows],
            )
        probs = torch.softmax(logits, dim=-1)
        if sb.min_p is not None:
            min_p = sb.min_p[rows, None]
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def _draw(
        self, probs: torch.Tensor, sb: SamplingBatch, rows: torch.Tensor, row_list: list[int] | None = None
    ) -> torch.Tensor:
        noise = torch.empty_like(probs)
        if row_list is None:
            row_list = rows.tolist()
        unseeded = [i for i, r in enumerate(row_list) if sb.generators[r] is None]
        if unseeded:
            if len(unseeded) == len(row_list):
                noise.exponential_(generator=self.generator)
            else:
                idx = torch.tensor(unseeded, device=probs.device)
                noise[idx] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                    generator=self.generator
                )
        for i, r in enumerate(row_list):
            gen = sb.generators[r]
            if gen is not None:
                noise[i].exponential_(generator=gen)
        # A zero draw would turn a zero-probability token into 0/0.
        return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    @staticmethod
    def _top_k_top_p(
        logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if top_k is not None:
            ranks = torch.arange(vocab, device=logits.device)
            drop |= ranks[None, :] >= top_k[:, None]
        if top_p is not None:
            probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
            # Rows with top_p == 1 keep everything (the cumulative sum may round past 1).
            drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
            drop[:, 0] = False  # always keep the most likely token
        mask = torch.zeros_like(drop).scatter_(1, order, drop)
        return logits.masked_fill(mask, float("-inf"))

    @staticmethod
    def logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]
    ) -> list[SampledLogprobs | None]:
        return Sampler.logprobs_of(Sampler.logprob_tensors(raw, tokens, num_logprobs), num_logprobs)

    @staticmethod
    def logprob_tensors(
        raw: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where `raw` is: each row's sampled-token logprob and rank, and the top logprobs and ids
        (as many as the most any row asks for)."""
        k_max = max(k for k in num_logprobs if k is not None)
        chosen = raw.gather(1, tokens[:, None]).squeeze(1)
        ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
        top_vals, top_ids = raw.topk(k_max, dim=-1) if k_max > 0 else (raw[:, :0], tokens[:, None][:, :0])
        return chosen, ranks, top_vals, top_ids

    @staticmethod
    def logprobs_of(
        tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], num_logprobs: list[int | None]
    ) -> list[SampledLogprobs | None]:
        """`logprob_tensors`' output read into each row's SampledLogprobs (None where not asked)."""
        chosen, ranks, top_vals, top_ids = tensors
        chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
        vals_l, ids_l = top_vals.tolist(), top_ids.tolist()
        out: list[SampledLogprobs | None] = []
        for i, k in enumerate(num_logprobs):
            if k is None:
                out.append(None)
            else:
                out.append(SampledLogprobs(chosen_l[i], ranks_l[i], ids_l[i][:k], vals_l[i][:k]))
        return out
