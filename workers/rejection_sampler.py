"""Speculative acceptance: which of the draft model's proposed tokens the target keeps.

Greedy requests keep the longest prefix of drafts that equals the target's argmax at each
position, then take the target's own argmax after it (so the output is exactly the target's
greedy continuation). Sampled requests use rejection sampling, which keeps the target's
distribution whatever the draft proposes: draft token x (drawn from q) is accepted with
probability min(1, p(x) / q(x)); at the first rejection the token is drawn from
normalize(max(0, p - q)) instead; when every draft is accepted a bonus token is drawn from the
target's distribution after the last one.

Shapes: B requests, K drafts each, V the tokenizer's vocabulary. Row i of the target's
distributions (i = 0..K) predicts the token after the last accepted token and drafts[:i].

Randomness: unseeded requests share the device's default generator. A request with a seed is
not rejection-sampled (`workers.spec_runner`): at each position it takes the token plain
sampling draws there (the target's distribution and the noise of `seed_for_position(seed,
output position)`, as `workers.sampler` draws it), and keeps its drafts while they equal those
tokens; its draft proposes with the same noise. So its output does not depend on which of its
steps ran as speculative rounds (the batch around it decides that), and equals what it gives
without a draft model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.sampler import seed_for_position
from workers.sampling_params import SamplingParams


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a non-greedy request draws from, normalised: logits [N, V] (float32,
    penalties already applied) through temperature, top-k, top-p and min-p with the same
    semantics as `workers.sampler.Sampler._draw` (top-k keeps exactly k by rank, top-p the
    smallest prefix of the best tokens reaching top_p, min-p drops tokens below min_p times the
    best one's). Returns [N, V] float32 rows summing to 1."""
    N, V = logits.shape
    if N == 0:
        return logits.new_zeros(0, V)
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    x = logits.float() / temp.unsqueeze(1)
    top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
    use_k = any(k < V for k in top_k)
    use_p = any(p.top_p < 1.0 for p in params)
    min_p = [p.min_p for p in params]
    if not (use_k or use_p):
        probs = x.softmax(dim=-1)
    else:
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        if use_k:
            k_t = torch.tensor(top_k, device=dev).unsqueeze(1)
            sorted_x.masked_fill_(torch.arange(V, device=dev) >= k_t, -math.inf)
        sp = sorted_x.softmax(dim=-1)
        if use_p:
            top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=dev)
            sp.masked_fill_(sp.cumsum(dim=-1).sub_(sp) >= top_p.unsqueeze(1), 0.0)
        probs = torch.zeros_like(sp).scatter_(1, order, sp)
    if any(m > 0.0 for m in min_p):
        m_t = torch.tensor(min_p, dtype=torch.float32, device=dev).unsqueeze(1)
        probs.masked_fill_(probs < m_t * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def row_generators(seeds: list[int | None], positions: list[int], salt: int,
                   device: torch.device) -> list[torch.Generator | None]:
    """A generator per row for seeded requests (None: use the default generator)."""
    out: list[torch.Generator | None] = []
    for seed, pos in zip(seeds, positions):
        if seed is None:
            out.append(None)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(seed_for_position(seed ^ salt, pos))
            out.append(g)
    return out


def _exponential(shape: tuple[int, ...], gens: list[torch.Generator | None], device) -> torch.Tensor:
    """i.i.d. Exp(1) noise, row r from gens[r] (or the default generator)."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    if any(g is None for g in gens):
        q.exponential_()
    for r, g in enumerate(gens):
        if g is not None:
            q[r].exponential_(generator=g)
    return q.clamp_min_(torch.finfo(torch.float32).tiny)


def _uniform(shape: tuple[int, ...], gens: list[torch.Generator | None], device) -> torch.Tensor:
    u = torch.empty(shape, dtype=torch.float32, device=device)
    if any(g is None for g in gens):
        u.uniform_()
    for r, g in enumerate(gens):
        if g is not None:
            u[r].uniform_(generator=g)
    return u


def categorical(weights: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of non-negative weights [N, V] (need not be normalised): the exponential
    race argmax(w / E), E ~ Exp(1), picks column t with probability w_t / sum(w)."""
    if weights.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=weights.device)
    return (weights / _exponential(tuple(weights.shape), gens, weights.device)).argmax(dim=-1)


@dataclass
class Verdict:
    """Per request: drafts accepted (0..K) and the tokens to emit (accepted drafts + one)."""

    num_accepted: torch.Tensor  # [B] long
    next_token: torch.Tensor  # [B] long: the target's token after the accepted drafts


def greedy_verify(target_ids: torch.Tensor, draft_ids: torch.Tensor) -> Verdict:
    """target_ids [B, K+1]: the target's argmax at each position; draft_ids [B, K]."""
    K = draft_ids.shape[1]
    n = (draft_ids == target_ids[:, :K]).long().cumprod(dim=1).sum(dim=1)
    return Verdict(n, target_ids.gather(1, n.unsqueeze(1)).squeeze(1))


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    gens: list[torch.Generator | None],
) -> Verdict:
    """target_probs [B, K+1, V] and draft_probs [B, K, V] (rows normalised; draft_ids [B, K]
    were drawn from draft_probs). Accepting draft i with probability min(1, p_i(x) / q_i(x))
    and replacing the first rejected one by a draw from max(0, p - q) makes every emitted token
    distributed as the target's p, whatever q is."""
    B, K1, V = target_probs.shape
    K = K1 - 1
    idx = draft_ids.unsqueeze(2)
    p_x = target_probs[:, :K].gather(2, idx).squeeze(2)
    q_x = draft_probs.gather(2, idx).squeeze(2)
    u = _uniform((B, K), gens, target_probs.device)
    # u < p/q without dividing (q_x > 0: x was drawn from q).
    accept = u * q_x < p_x
    n = accept.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(B, device=target_probs.device)
    p_n = target_probs[rows, n]
    # After K accepted drafts the "residual" is p itself (q of a position past the drafts is 0).
    q_n = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, V)], dim=1)[rows, n]
    residual = (p_n - q_n).clamp_min_(0.0)
    # p == q up to rounding makes a rejection (nearly) impossible and the residual ~0: then
    # the target's own distribution is the right fallback.
    empty = residual.sum(dim=-1, keepdim=True) <= 1e-12
    residual = torch.where(empty, p_n, residual)
    return Verdict(n, categorical(residual, gens))


__all__ = ["Verdict", "categorical", "greedy_verify", "processed_probs", "rejection_sample", "row_generators"]
