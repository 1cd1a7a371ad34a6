"""vLLM's repetition, presence and frequency penalties, on a batch of logits at once.

Repetition penalises every token seen in the prompt or the output: a positive logit is
divided by the penalty, a negative one multiplied (so > 1 always makes it less likely).
Presence subtracts its value once from every token the output holds; frequency subtracts
its value times how often the output holds it. The prompt does not count for those two."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's ids: [rows, vocab] int64, from one
    scatter_add over the rows padded to the longest (pads count into a dropped bin)."""
    width = max((len(row) for row in ids), default=0)
    rows = [list(row) + [vocab] * (width - len(row)) for row in ids]
    padded = torch.tensor(rows, dtype=torch.int64).reshape(len(ids), width)  # [rows, width]
    if device.type == "cuda":
        # Pinned and non-blocking: a pageable copy would wait for the queued step.
        padded = padded.pin_memory().to(device, non_blocking=True)
    counts = torch.zeros(len(ids), vocab + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    prompt_counts: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """logits [rows, vocab] after each row's penalties: presence, frequency, repetition
    [rows] float32 (0, 0 and 1 are off); token counts [rows, vocab] of the prompt and of
    the output so far (token_counts). Returns a new tensor."""
    seen = (prompt_counts > 0) | (output_counts > 0)
    scale = torch.where(seen, repetition[:, None], 1.0)  # [rows, vocab]
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0)
