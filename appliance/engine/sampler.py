"""Picking next tokens from logits: greedy, temperature, top-k, top-p, per-request seeds.

A step's rows are sampled together with batched tensor ops, whatever mix of greedy and
random rows and of settings it holds: per-row temperature, top-k and top-p travel as
tensors, and the draw is an exponential race, argmax(probs / E) with E ~ Exp(1) drawn
per vocabulary entry, which picks token i with probability probs[i] (it is the Gumbel-max
trick in probability space). Nothing reads the device until the step's token ids are
complete: `sample` reads them once with one `.tolist()`, the step's only host sync.
"""

from __future__ import annotations

import torch

from appliance.engine.sequence import SamplingParams


class Sampler:
    """Holds one random generator per seeded request, so a seed gives the same output
    whatever else shares the batch; unseeded requests share one generator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        # Unseeded rows need no stream of their own: one generator draws all their noise
        # in one call, seeded from the OS so runs differ.
        self._shared = torch.Generator(device=device)
        self._shared.seed()

    def sample(self, logits: torch.Tensor, requests: list[tuple[int, SamplingParams]]) -> list[int]:
        """logits float32 [rows, vocab], one row per (seq_id, params); returns a token per row.

        Reads the device once: the step's token ids, together."""
        return self.sample_tensor(logits, requests).tolist()

    def sample_tensor(
        self, logits: torch.Tensor, requests: list[tuple[int, SamplingParams]]
    ) -> torch.Tensor:
        """Like `sample`, but the token ids stay on the logits' device ([rows] int64): no
        host sync, so a caller (or a CUDA graph later) can queue more work behind them."""
        greedy = logits.argmax(dim=-1)
        if all(params.greedy for _, params in requests):
            return greedy  # the common case costs one argmax, as it always did
        settings = self._settings(requests, logits.device)
        probs = batch_probabilities(logits, *settings, cuts=_cuts(requests, logits.shape[-1]))
        noise = self._noise(probs, requests)
        drawn = probs.div_(noise).argmax(dim=-1)
        # Greedy rows took a placeholder temperature of 1 above; their argmax wins here.
        return torch.where(settings[0] == 0, greedy, drawn)

    @staticmethod
    def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[vocab] logits -> [vocab] probabilities after temperature, top-k and top-p: one
        row of what `sample` draws from."""
        if params.greedy:
            return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
        vocab = logits.shape[-1]
        settings = (
            torch.tensor([params.temperature], dtype=torch.float32, device=logits.device),
            torch.tensor([params.top_k], dtype=torch.int64, device=logits.device),
            torch.tensor([params.top_p], dtype=torch.float32, device=logits.device),
        )
        return batch_probabilities(logits[None], *settings, cuts=_cuts([(0, params)], vocab))[0]

    def _settings(
        self, requests: list[tuple[int, SamplingParams]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row temperature (0 for greedy rows), top_k and top_p as [rows] tensors on
        `device`."""
        # Greedy rows (temperatures below GREEDY_BELOW too) travel as 0: the mark that
        # picks their argmax, and no division by a tiny temperature.
        temperature = [0.0 if params.greedy else params.temperature for _, params in requests]
        top_k = [params.top_k for _, params in requests]
        top_p = [params.top_p for _, params in requests]
        return (
            _upload(temperature, torch.float32, device),
            _upload(top_k, torch.int64, device),
            _upload(top_p, torch.float32, device),
        )

    def _noise(
        self, probs: torch.Tensor, requests: list[tuple[int, SamplingParams]]
    ) -> torch.Tensor:
        """Exp(1) noise [rows, vocab]: a seeded row's from its own generator (so its draw
        depends on nothing else in the batch), the others' from the shared one in one call."""
        noise = torch.empty_like(probs)
        seeded = [
            (row, seq_id, params)
            for row, (seq_id, params) in enumerate(requests)
            if params.seed is not None and not params.greedy
        ]
        if len(seeded) < len(requests):
            noise.exponential_(generator=self._shared)
        for row, seq_id, params in seeded:
            # One launch per seeded row, but no sync: the row's generator advances on the
            # device like the row's tokens do.
            noise[row].exponential_(generator=self._generator(seq_id, params))
        # Exp(1) can round to 0: 0/0 would be NaN, which argmax prefers. The smallest
        # normal float keeps every quotient finite and a zero probability at zero.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

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


def _cuts(requests: list[tuple[int, SamplingParams]], vocab: int) -> tuple[int, bool]:
    """What the batch's rows cut, known on the host without reading the device: the
    largest top-k that cuts anything (0: none does), and whether any row has top-p."""
    sampled = [params for _, params in requests if not params.greedy]
    top_k = max((p.top_k for p in sampled if 0 < p.top_k < vocab), default=0)
    return top_k, any(p.top_p < 1.0 for p in sampled)


def batch_probabilities(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    cuts: tuple[int, bool],
) -> torch.Tensor:
    """[rows, vocab] logits -> probabilities, each row after its own temperature [rows]
    (0, a greedy row, counts as 1), top_k [rows] (0 or >= vocab: no cut) and top_p [rows]
    (1: no cut). `cuts` (from _cuts) lets a batch skip the sort or the top-k it does not
    need. A row's result depends on nothing else in the batch, whatever the others cut."""
    max_k, any_top_p = cuts
    vocab = logits.shape[-1]
    logits = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if not max_k and not any_top_p:
        return logits.softmax(-1)
    # Rows without a top-k keep everything: their threshold is -inf.
    has_k = (top_k > 0) & (top_k < vocab)
    kth_index = (top_k.clamp(1, max(max_k, 1)) - 1)[:, None]
    if not any_top_p:
        # Only top-k: the largest max_k values suffice, not a sort of the vocabulary.
        kth = torch.topk(logits, max_k).values.gather(1, kth_index)
        kth = torch.where(has_k[:, None], kth, float("-inf"))
        # Ties with the k-th value stay, like torch.topk's threshold always kept them.
        return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
    # Stable: equal logits keep their vocabulary order, so which of them a top-p cut
    # drops never depends on the sort algorithm a batch shape picks (~10% slower on CPU).
    sorted_logits, order = torch.sort(logits, descending=True, stable=True)
    if max_k:
        kth = torch.where(has_k[:, None], sorted_logits.gather(1, kth_index), float("-inf"))
        # Sorted, the cut entries are the tail: masking them keeps the order descending.
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = sorted_logits.softmax(-1)
    # Drop a token once the ones before it already reach top_p (the first always stays).
    # Rows with top_p 1 drop nothing, even where rounding lifts the sum past 1.
    before = sorted_probs.cumsum(-1) - sorted_probs
    drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`. To CUDA through pinned memory without
    blocking: a pageable copy would wait for every kernel queued before it."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
