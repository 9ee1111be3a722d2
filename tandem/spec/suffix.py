"""Suffix speculation (SuffixDecoding, as Snowflake's Arctic Inference ships it for vLLM): drafts
from what the workload repeats, with no model.

Two sources are searched for the longest suffix of a request's context (up to `max_depth`
tokens): the request's own prompt and output, and the outputs of recent requests of the same
isolation key (the request's `cache_salt`, which under API keys begins with its tenant's: one
tenant's outputs never shape another's drafts). From every place the matched suffix occurs, the
draft follows the most frequent continuation token by token while its empirical probability stays
at or above `min_token_prob`, for at most `max_spec_factor` times the match length: a long match
(an agent re-emitting a file it edits) drafts far, a short one little.

A suffix tree over the texts answers the same queries; here a text is a NumPy array and each
query is vectorized over it (the candidates are the positions holding the context's last token,
narrowed by one comparison per further token), which costs a pass over the array and keeps no
per-substring nodes: memory is one int32 per cached token.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tandem.core.draft_tree import DraftTree
from tandem.core.request import Request

# Separates cached outputs in a key's corpus: never a token id, so no match runs across two.
_SEPARATOR = -1


@dataclass(frozen=True, slots=True)
class SuffixConfig:
    """vLLM's `suffix_decoding_*` settings, without the prefix."""

    max_depth: int = 32  # longest context suffix matched (SuffixDecoding's tree depth)
    max_cached_requests: int = 1000  # recent outputs kept per isolation key (0: own context only)
    max_spec_factor: float = 1.0  # draft at most this many tokens per matched token
    min_token_prob: float = 0.1  # stop a draft at a continuation rarer than this
    # Draft a tree of the most probable continuations (verified in one pass), not one chain.
    tree: bool = True


def longest_match(text: np.ndarray, context: np.ndarray, max_depth: int, exclude_tail: bool) -> tuple[int, np.ndarray]:
    """The longest suffix of `context` (at most `max_depth` tokens) occurring in `text`, as its
    length and the positions just past each occurrence; (0, empty) if not even the last token
    occurs. `exclude_tail`: `text` ends with `context`, whose own tail is no occurrence."""
    n = context.shape[0]
    if n == 0 or text.shape[0] == 0:
        return 0, np.empty(0, dtype=np.int64)
    limit = text.shape[0] - 1 if exclude_tail else text.shape[0]
    ends = np.flatnonzero(text[:limit] == context[n - 1])
    best_len, best = 0, ends[:0]
    length = 1
    while ends.size:
        best_len, best = length, ends
        if length in (max_depth, n):
            break
        ends = ends[ends >= length]
        ends = ends[text[ends - length] == context[n - 1 - length]]
        length += 1
    return best_len, best + 1


def continuation(text: np.ndarray, starts: np.ndarray, max_tokens: int, min_prob: float) -> list[int]:
    """The most frequent continuation from these positions, token by token, while the chosen
    token's share of the occurrences still running is at least `min_prob`."""
    return scored_continuation(text, starts, max_tokens, min_prob)[0]


def scored_continuation(
    text: np.ndarray, starts: np.ndarray, max_tokens: int, min_prob: float
) -> tuple[list[int], list[float]]:
    """`continuation`, and each token's empirical probability of being reached: the product of
    the shares along the chain up to it."""
    out: list[int] = []
    probs: list[float] = []
    prob = 1.0
    size = text.shape[0]
    while len(out) < max_tokens:
        starts = starts[starts < size]
        if not starts.size:
            break
        nxt = text[starts]
        tokens, counts = np.unique(nxt[nxt != _SEPARATOR], return_counts=True)
        if not tokens.size:
            break
        best = int(np.argmax(counts))
        if counts[best] < min_prob * starts.size:
            break
        token = int(tokens[best])
        out.append(token)
        prob *= float(counts[best]) / starts.size
        probs.append(prob)
        starts = starts[nxt == token] + 1
    return out, probs


def continuation_tree(
    text: np.ndarray, starts: np.ndarray, max_nodes: int, min_prob: float
) -> tuple[list[int], list[int]]:
    """The most probable continuations from these positions as a tree of at most `max_nodes`
    nodes (tokens, parents; -1: the root): nodes are added best first by their path's empirical
    probability, each child's share of its parent's occurrences at least `min_prob`."""
    tokens, parents, _ = scored_continuation_tree(text, starts, max_nodes, min_prob)
    return tokens, parents


def scored_continuation_tree(
    text: np.ndarray, starts: np.ndarray, max_nodes: int, min_prob: float
) -> tuple[list[int], list[int], list[float]]:
    """`continuation_tree`, and each node's path probability (non-increasing: best first). A
    tree's first j nodes are the tree of j nodes, and its expected accepted length is the sum of
    its nodes' path probabilities (at most one node of each depth is on the accepted path)."""
    size = text.shape[0]
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    # Candidates: (-path probability, tie-break, parent node, token, positions after the token).
    heap: list[tuple[float, int, int, int, np.ndarray]] = []
    order = 0

    def expand(node: int, prob: float, at: np.ndarray) -> None:
        nonlocal order
        at = at[at < size]
        if not at.size:
            return
        nxt = text[at]
        cand, counts = np.unique(nxt[nxt != _SEPARATOR], return_counts=True)
        for token, count in zip(cand.tolist(), counts.tolist()):
            share = count / at.size
            if share >= min_prob and share > 0:
                heapq.heappush(heap, (-prob * share, order, node, token, at[nxt == token] + 1))
                order += 1

    expand(-1, 1.0, starts)
    while heap and len(tokens) < max_nodes:
        neg_prob, _, parent, token, at = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        probs.append(-neg_prob)
        expand(len(tokens) - 1, -neg_prob, at)
    return tokens, parents, probs


class _Corpus:
    """One isolation key's recent outputs, concatenated with separators (rebuilt when changed)."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.outputs: OrderedDict[str, np.ndarray] = OrderedDict()
        self._text: np.ndarray | None = None

    def add(self, request_id: str, tokens: np.ndarray) -> None:
        if self.max_requests <= 0 or not tokens.size:
            return
        self.outputs[request_id] = tokens
        while len(self.outputs) > self.max_requests:
            self.outputs.popitem(last=False)
        self._text = None

    @property
    def text(self) -> np.ndarray:
        if self._text is None:
            parts = []
            for tokens in self.outputs.values():
                parts += [tokens, np.array([_SEPARATOR], dtype=np.int32)]
            self._text = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
        return self._text


class _TokenArray:
    """A request's tokens as an int32 array, kept between lookups and extended by what was added
    since: converting the whole list each step would cost a lookup O(context) in Python objects
    where the match itself runs in numpy. The last cached tokens are copied again each time: with
    overlap scheduling the newest token is a placeholder until its value is read back, in place."""

    REFRESH = 2

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.int32)
        self.n = 0

    def view(self, tokens: list[int]) -> np.ndarray:
        m = len(tokens)
        start = 0 if m < self.n else max(0, self.n - self.REFRESH)
        if m > self.buf.shape[0]:
            grown = np.empty(max(m, 2 * self.buf.shape[0]), dtype=np.int32)
            grown[:start] = self.buf[:start]
            self.buf = grown
        self.buf[start:m] = tokens[start:m]
        self.n = m
        return self.buf[:m]


class SuffixSpeculator:
    """Proposals for the scheduler (`propose`), and the requests' outputs kept for later ones
    (`forget`, when a request ends)."""

    def __init__(self, config: SuffixConfig = SuffixConfig()) -> None:
        self.config = config
        self._corpora: dict[str | None, _Corpus] = {}
        # Requests proposed for and not yet ended: their outputs join the corpus when they end.
        self._live: dict[str, Request] = {}
        self._arrays: dict[str, _TokenArray] = {}

    def propose(self, req: Request, k: int) -> list[int]:
        """A chain of at most k tokens: the most frequent continuation."""
        return self._lookup(req, k, tree=False)[0]

    def propose_tree(self, req: Request, max_nodes: int) -> DraftTree | None:
        """A tree of at most `max_nodes` nodes: the most probable continuations, best first."""
        tokens, parents, _ = self._lookup(req, max_nodes, tree=True)
        return DraftTree(tuple(tokens), tuple(parents)) if tokens and parents is not None else None

    def scored(self, req: Request, k: int) -> tuple[list[int] | DraftTree, list[float]]:
        """The proposal of at most k tokens (a tree when `tree`, else a chain; empty: nothing
        found) and each token's empirical probability of being accepted, in the proposal's order
        (non-increasing). Its first j tokens are the proposal of j tokens."""
        tokens, parents, probs = self._lookup(req, k, self.config.tree)
        if parents is None or not tokens:
            return tokens, probs
        return DraftTree(tuple(tokens), tuple(parents)), probs

    def _lookup(self, req: Request, k: int, tree: bool) -> tuple[list[int], list[int] | None, list[float]]:
        """Tokens, parents (None for a chain) and probabilities of the proposal of at most k."""
        found = self._match(req, k)
        if found is None:
            return [], None, []
        text, starts, budget = found
        if tree:
            return scored_continuation_tree(text, starts, budget, self.config.min_token_prob)
        tokens, probs = scored_continuation(text, starts, budget, self.config.min_token_prob)
        return tokens, None, probs

    def _match(self, req: Request, k: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The text and positions to continue from, and the draft budget; None: nothing to draft."""
        if k <= 0:
            return None
        self._live[req.request_id] = req
        cfg = self.config
        context = self._arrays.setdefault(req.request_id, _TokenArray()).view(req.token_ids)
        own_len, own_starts = longest_match(context, context, cfg.max_depth, exclude_tail=True)
        corpus = self._corpora.get(req.cache_salt)
        other_len, other_starts = 0, own_starts[:0]
        if corpus is not None and corpus.outputs:
            other_len, other_starts = longest_match(corpus.text, context, cfg.max_depth, exclude_tail=False)
        # The longer match predicts better; the request's own context on a tie (it is closer).
        if other_len > own_len:
            text, starts, length = corpus.text, other_starts, other_len  # type: ignore[union-attr]
        else:
            text, starts, length = context, own_starts, own_len
        if length == 0:
            return None
        return text, starts, min(k, math.ceil(cfg.max_spec_factor * length))

    def forget(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)
        req = self._live.pop(request_id, None)
        if req is None or self.config.max_cached_requests <= 0:
            return
        outputs = np.asarray(req.output_token_ids, dtype=np.int32)
        corpus = self._corpora.get(req.cache_salt)
        if corpus is None:
            corpus = self._corpora[req.cache_salt] = _Corpus(self.config.max_cached_requests)
        corpus.add(request_id, outputs)

    @property
    def num_cached_requests(self) -> int:
        return sum(len(c.outputs) for c in self._corpora.values())


def parse_suffix_config(spec: dict, prefix: str = "suffix_decoding_") -> SuffixConfig:
    """A `SuffixConfig` from `speculative_config`'s `suffix_decoding_*` keys (ValueError naming one
    that is out of range)."""
    values = {name: spec[prefix + name] for name in SuffixConfig.__dataclass_fields__ if prefix + name in spec}
    cfg = SuffixConfig(**values)
    checks = [
        ("max_depth", isinstance(cfg.max_depth, int) and 1 <= cfg.max_depth <= 1024, "an integer in [1, 1024]"),
        ("max_cached_requests", isinstance(cfg.max_cached_requests, int) and cfg.max_cached_requests >= 0,
         "an integer >= 0"),
        ("max_spec_factor", isinstance(cfg.max_spec_factor, (int, float)) and cfg.max_spec_factor > 0,
         "a positive number"),
        ("min_token_prob", isinstance(cfg.min_token_prob, (int, float)) and 0 <= cfg.min_token_prob <= 1,
         "a number in [0, 1]"),
        ("tree", isinstance(cfg.tree, bool), "true or false"),
    ]
    for name, ok, what in checks:
        if not ok:
            raise ValueError(f"speculative_config.{prefix}{name} must be {what}, got {getattr(cfg, name)!r}")
    return cfg


def suffix_keys(prefix: str = "suffix_decoding_") -> set[str]:
    return {prefix + name for name in SuffixConfig.__dataclass_fields__}
