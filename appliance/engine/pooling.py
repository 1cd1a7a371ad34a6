"""A prompt's embedding: the mean of its tokens' last hidden states (after the final
norm), L2-normalized, as llama.cpp's server pools a model without a pooling type of its
own and as OpenAI's embeddings come (unit length: a dot product is the cosine).

Computed at prefill, chunk by chunk: a prompt's chunks may span several steps, so the
sum of each embedding sequence's rows is kept until its last prompt chunk runs."""

from __future__ import annotations

import torch

from appliance.engine.scheduler import SchedulerOutput


class PromptPooling:
    """Sums of the hidden rows of the sequences that asked for an embedding."""

    def __init__(self) -> None:
        self._sums: dict[int, torch.Tensor] = {}  # seq_id -> float32 [hidden]

    def add(self, out: SchedulerOutput, hidden: torch.Tensor) -> dict[int, list[float]]:
        """Take this step's rows ([rows, hidden], in the step's chunk order); the
        embeddings of the sequences whose prompt this step completed."""
        done: dict[int, list[float]] = {}
        start = 0
        for chunk in out.chunks:
            seq = chunk.seq
            rows = slice(start, start + chunk.num_tokens)
            start += chunk.num_tokens
            if not seq.params.embed or chunk.start >= seq.num_prompt_tokens:
                continue
            # Only the prompt's rows (an embedding's request makes one token and ends, so
            # no chunk of it holds more; SamplingParams holds it to that).
            end = min(chunk.num_tokens, seq.num_prompt_tokens - chunk.start)
            total = hidden[rows][:end].float().sum(0)  # [hidden]
            if chunk.start > 0:  # (a prompt recomputed after preemption starts at 0)
                total += self._sums[seq.seq_id]
            if chunk.start + chunk.num_tokens < seq.num_prompt_tokens:
                self._sums[seq.seq_id] = total
                continue
            self._sums.pop(seq.seq_id, None)
            mean = total / seq.num_prompt_tokens
            done[seq.seq_id] = torch.nn.functional.normalize(mean, dim=0).tolist()
        return done

    def forget(self, seq_id: int) -> None:
        """The sequence ended (finished, aborted): drop its partial sum."""
        self._sums.pop(seq_id, None)
