"""Verification of draft tokens against the target model: greedy matching and lossless rejection sampling.

Non-greedy rows follow Leviathan et al. / Chen et al. (2023): draft token x_i, proposed from q_i, is
accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection j the emitted token is drawn
from normalize(max(0, p_j - q_j)); if every draft is accepted a bonus token is drawn from p_K. Each emitted
token is then distributed exactly as p at its position, whatever q is. With deterministic proposals
(`draft_probs=None`) q is one-hot at the draft token: accept with probability p(x); on rejection draw from
p with x zeroed. That is lossless for any way of choosing x (conditionally on x the output is
p(x)·[y = x] + (1 - p(x)) · p(y)[y != x] / (1 - p(x)) = p(y)).

Randomness: a uniform u_i per draft token (accept iff u_i * q_i(x_i) < p_i(x_i), with u in [0, 1), which is
probability min(1, p/q) and never accepts a token with p_i(x_i) = 0) and one exponential-race draw
(argmax of w / E, E ~ Exp(1), samples proportionally to w >= 0 with no normalization) for the final token.
A seeded row draws num_draft[b] uniforms and then V exponentials from its own generator, so its tokens do
not depend on the other rows or on the batch's padded width K; with num_draft 0 it makes the very draw
`Sampler` makes, so it emits the token the plain sampler would. Greedy rows draw nothing.
"""

from __future__ import annotations

import torch

from tandem.core.draft_tree import DraftTree


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, K+1] int64 padded with -1, num_accepted [B]). Row b emits
    num_accepted[b] accepted draft tokens followed by exactly one more token (recovered on rejection, bonus
    if all num_draft[b] were accepted), so it emits num_accepted[b] + 1 tokens.

    target_probs: [B, K+1, V] float32, the target's processed distribution at each verify position.
    draft_tokens: [B, K] int64 proposed tokens (padding beyond num_draft[b] is ignored).
    num_draft: [B] int64, 0..K draft tokens per row.
    draft_probs: [B, K, V] draft distribution per proposal, or None: deterministic proposals (q one-hot).
    greedy: [B] bool; greedy rows accept draft i while it equals argmax(target_probs[b, i]) and then emit
    argmax(target_probs[b, num_accepted[b]]).
    generators: per row; None uses default_generator."""
    batch, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    if draft_tokens.shape != (batch, k):
        raise ValueError(f"draft_tokens must have shape {(batch, k)}, got {tuple(draft_tokens.shape)}")
    if num_draft.shape != (batch,) or greedy.shape != (batch,) or len(generators) != batch:
        raise ValueError("num_draft, greedy and generators must have one entry per row")
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs must have shape {(batch, k, vocab)}, got {tuple(draft_probs.shape)}")
    device = target_probs.device
    num_draft = num_draft.to(device=device, dtype=torch.long)
    greedy = greedy.to(device=device, dtype=torch.bool)
    positions = torch.arange(k, device=device)
    valid = positions[None, :] < num_draft[:, None]  # [B, K]
    tokens_in = torch.where(valid, draft_tokens.to(device=device, dtype=torch.long), 0)

    greedy_list = greedy.tolist()
    sampled_rows = [b for b in range(batch) if not greedy_list[b]]
    uniforms, noise = _draw(sampled_rows, generators, default_generator, num_draft, batch, k, vocab, device)

    # Acceptance of each draft token; a row accepts the prefix up to its first rejection.
    p_draft = target_probs[:, :k].gather(2, tokens_in[:, :, None]).squeeze(2)  # [B, K] p_i(x_i)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, tokens_in[:, :, None]).squeeze(2).to(p_draft.dtype)
    accept_sampled = uniforms * q_draft < p_draft
    accept_greedy = tokens_in == target_probs[:, :k].argmax(dim=2)
    accept = torch.where(greedy[:, None], accept_greedy, accept_sampled) & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]

    # The one more token, at position a = num_accepted.
    p_next = target_probs.gather(1, num_accepted[:, None, None].expand(batch, 1, vocab)).squeeze(1)  # [B, V]
    extra = p_next.argmax(dim=1)
    if sampled_rows:
        weights = p_next
        rejected = num_accepted < num_draft
        if k > 0:
            at = num_accepted.clamp(max=k - 1)[:, None]
            if draft_probs is None:
                q_next = torch.zeros_like(p_next).scatter_(1, tokens_in.gather(1, at), 1.0)
            else:
                q_next = draft_probs.gather(1, at[:, :, None].expand(batch, 1, vocab)).squeeze(1)
            residual = (p_next - q_next.to(p_next.dtype)).clamp(min=0.0)
            # An all-zero residual means p <= q everywhere, i.e. p == q for normalized p and q; then
            # rejection has probability sum_x q(x)(1 - min(1, p(x)/q(x))) = 1 - sum_x min(p, q) = 0, and the
            # branch is reached only through rounding (or an under-normalized p). Any distribution is then
            # correct to within that rounding; p is the natural one, and argmax over an all-zero row would
            # instead emit token 0, which may have p = 0.
            use_residual = rejected & (residual.sum(dim=1) > 0)
            weights = torch.where(use_residual[:, None], residual, p_next)
        race = (weights / noise).argmax(dim=1)
        extra = torch.where(greedy, extra, race)

    out = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    out[:, :k] = torch.where(positions[None, :] < num_accepted[:, None], tokens_in, -1)
    out.scatter_(1, num_accepted[:, None], extra[:, None])
    return out, num_accepted


def _draw(
    rows: list[int],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
    num_draft: torch.Tensor,
    batch: int,
    k: int,
    vocab: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [B, K] for the acceptance tests and Exp(1) noise [B, V] for the final draw, filled on `rows`.

    Unseeded rows draw together from the default generator; each seeded row draws its own num_draft[b]
    uniforms, then V exponentials, from its own generator."""
    uniforms = torch.zeros(batch, k, device=device)
    noise = torch.ones(batch, vocab, device=device)
    if not rows:
        return uniforms, noise
    unseeded = [b for b in rows if generators[b] is None]
    seeded = [b for b in rows if generators[b] is not None]
    if len(unseeded) == batch:
        uniforms.uniform_(generator=default_generator)
        noise.exponential_(generator=default_generator)
    elif unseeded:
        idx = torch.tensor(unseeded, device=device)
        uniforms[idx] = torch.rand(len(unseeded), k, device=device, generator=default_generator)
        noise[idx] = torch.empty(len(unseeded), vocab, device=device).exponential_(
            generator=default_generator
        )
    if seeded:
        counts = num_draft.tolist()
        for b in seeded:
            gen = generators[b]
            if counts[b] > 0:
                uniforms[b, : counts[b]].uniform_(generator=gen)
            noise[b].exponential_(generator=gen)
    # A zero draw would turn a zero-weight token into 0/0.
    return uniforms, noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def verify_tree_sampled(
    tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Recursive rejection sampling over a draft tree (SpecInfer's multi-branch form, deterministic
    proposals). probs [1 + len(tree), V]: the target's distribution after each query token (the
    root, then each node). At a node with target distribution p, each child x in turn is accepted
    with probability p(x); on rejection p loses x (p(x) = 0, renormalized) and the next child is
    tried; with every child rejected the step's last token is drawn from what is left of p. The
    token leaving each node is then distributed exactly as p, whichever children were drafted and
    in whatever order (the rejections sample p without replacement). Returns the accepted nodes and
    the token after them."""
    accepted: list[int] = []
    node = -1
    while True:
        p = probs[node + 1].double().clone()
        moved = False
        for child in tree.children(node):
            x = tree.tokens[child]
            total = float(p.sum())
            if total <= 0.0:
                break
            u = float(torch.rand((), generator=generator, dtype=torch.float64, device=p.device))
            if u * total < float(p[x]):  # probability p(x) / sum(p)
                accepted.append(child)
                node = child
                moved = True
                break
            p[x] = 0.0
        if not moved:
            if float(p.sum()) <= 0.0:  # rounding left nothing: fall back to the full distribution
                p = probs[node + 1].double()
            noise = torch.empty_like(p).exponential_(generator=generator).clamp_(min=1e-300)
            return accepted, int((p / noise).argmax())
