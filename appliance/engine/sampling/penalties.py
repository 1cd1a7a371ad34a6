"""vLLM's repetition, presence and frequency penalties, on a batch of logits at once.

Repetition penalises every token seen in the prompt or the output: a positive logit is
divided by the penalty, a negative one multiplied (so > 1 always makes it less likely).
Presence subtracts its value once from every token the output holds; frequency subtracts
its value times how often the output holds it. The prompt does not count for those two.

Only the seen tokens change, so the work is over each row's ids (gathered, penalised,
scattered back), not over the vocabulary: a decode step pays for the ids it penalises."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence


def apply_penalties(
    logits: torch.Tensor,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Each row's penalties on logits [rows, vocab], in place (returned too): presence,
    frequency, repetition [rows] float32 (0, 0 and 1 are off); each row's prompt and
    output ids so far (a row whose repetition is off may pass an empty prompt)."""
    device = logits.device
    seen, seen_valid = padded([[*p, *o] for p, o in zip(prompts, outputs, strict=True)], device)
    # A row with no ids at all pads with token 0: its scale stays 1 there.
    scale = torch.where(seen_valid[:, :1], repetition[:, None], 1.0)  # [rows, 1]
    values = logits.gather(1, seen)  # [rows, width]
    # Repeated ids (and pads, copies of the row's first id) write the same value.
    logits.scatter_(1, seen, torch.where(values > 0, values / scale, values * scale))
    out, out_valid = padded(outputs, device)
    counts = torch.zeros_like(logits)  # [rows, vocab]: how often the output holds each
    counts.scatter_add_(1, out, out_valid.to(logits.dtype))
    times = counts.gather(1, out)  # [rows, width]: each output id's count (0 at pads of empty rows)
    penalty = frequency[:, None] * times + presence[:, None] * (times > 0)
    logits.scatter_(1, out, logits.gather(1, out) - penalty)
    return logits


def padded(ids: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids as [rows, width] int64 (width: the longest row, at least 1), each row
    padded with its own first id (0 when empty), and [rows, width] bool: which are real.
    Built from one flat tensor (pad_sequence), not per-id Python lists."""
    lengths = [len(row) for row in ids]
    flat = torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.int64)
    if device.type == "cuda":
        # Pinned and non-blocking: a pageable copy would wait for the queued step.
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    rows = list(flat.split(lengths)) or [flat]
    width = max(1, max(lengths, default=0))
    grid = pad_sequence(rows, batch_first=True)  # [rows, longest], zero-padded
    if grid.shape[1] < width:  # every row empty
        grid = torch.zeros(len(ids), width, dtype=torch.int64, device=device)
    lengths_t = torch.tensor(lengths, dtype=torch.int64).to(device)
    valid = torch.arange(width, device=device)[None, :] < lengths_t[:, None]  # [rows, width]
    return torch.where(valid, grid, grid[:, :1]), valid
