"""Verifying drafts against the target model's distributions at every drafted position.

Greedy: the longest prefix of drafts equal to the target's argmax, then the target's own
token where they first differ (or, all accepted, its token after the last draft): exactly
what plain greedy decoding makes. Sampling: standard rejection sampling (Leviathan et
al. 2023, Chen et al. 2023), so each emitted token has the target's distribution: draft d
at position i is accepted with probability min(1, p_i(d) / q_i(d)); the first rejected
position draws from the residual max(p_i - q_i, 0), normalized; with every draft accepted
one bonus token comes from p_k. A proposer without a distribution (n-gram lookup) is a
point mass: q_i(d) = 1, so d is kept with probability p_i(d) and the residual is p_i
without d. A draft model passes its q.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from appliance.engine.sampling.categorical import draw, uniforms


def accept_greedy(drafts: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens a greedy verify step emits. `target`: the target's argmax at each of the
    1 + k positions (after the last accepted token, then after each draft)."""
    if len(target) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens")
    emitted: list[int] = []
    for draft, best in zip(drafts, target, strict=False):
        emitted.append(best)
        if draft != best:
            return emitted  # the target's correction ends the run
    emitted.append(target[-1])  # every draft held: the bonus token
    return emitted


def rejection_sample(
    target_probs: torch.Tensor,
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> list[int]:
    """The tokens a sampling verify step emits: the accepted drafts and one token more.

    target_probs [k + 1, vocab]: the target's distribution at each position (after
    temperature and the cuts); draft_probs [k, vocab] the proposer's, or None for a point
    mass on each draft. Random numbers come from `generator` only (a seeded request's
    own), so a seed reproduces the output. Reads the device twice."""
    k = len(drafts)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} rows of target probabilities")
    device = target_probs.device
    accepted = k
    if k:
        rows = torch.arange(k, device=device)
        ids = torch.tensor(list(drafts), dtype=torch.int64, device=device)
        p = target_probs[rows, ids]  # [k]
        q = draft_probs[rows, ids] if draft_probs is not None else torch.ones_like(p)
        u = torch.rand(k, generator=generator, device=device)
        # u < min(1, p/q), without dividing: a draft q gave no mass to is kept if p has it.
        kept = (u * q < p).tolist()
        accepted = kept.index(False) if False in kept else k
    if accepted == k:
        last = _draw(target_probs[k], generator)
    else:
        p_row = target_probs[accepted]
        if draft_probs is None:
            residual = p_row.clone()
            residual[drafts[accepted]] = 0.0  # max(p - onehot(d), 0)
        else:
            residual = (p_row - draft_probs[accepted]).clamp_min(0.0)
        if not bool(residual.sum() > 0):
            residual = p_row  # p == q: rejection had probability 0 (a rounding edge)
        last = _draw(residual, generator)
    return [*drafts[:accepted], last]


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn with probability proportional to `weights` [vocab] (unnormalized),
    as the sampler draws (sampling/categorical.py), from `generator`."""
    return int(draw(weights[None], uniforms(1, generator, weights.device))[0])
