"""Picking next tokens from logits: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from appliance.engine.sequence import SamplingParams


class Sampler:
    """Holds one random generator per sampled request, so a seed gives the same output
    whatever else shares the batch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, requests: list[tuple[int, SamplingParams]]) -> list[int]:
        """logits float32 [rows, vocab], one row per (seq_id, params); returns a token per row."""
        tokens = logits.argmax(dim=-1).tolist()
        for row, (seq_id, params) in enumerate(requests):
            if not params.greedy:
                probs = self.probabilities(logits[row], params)
                draw = torch.multinomial(probs, 1, generator=self._generator(seq_id, params))
                tokens[row] = int(draw)
        return tokens

    @staticmethod
    def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[vocab] logits -> [vocab] probabilities after temperature, top-k and top-p."""
        if params.greedy:
            return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
        logits = logits / params.temperature
        if 0 < params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            # Drop a token once the ones before it already reach top_p (the first always stays).
            drop = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
            logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits.softmax(-1)

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            if params.seed is None:
                gen.seed()
            else:
                gen.manual_seed(params.seed)
            self._generators[seq_id] = gen
        return gen

    def forget(self, seq_id: int) -> None:
        """Drop a finished request's generator."""
        self._generators.pop(seq_id, None)
