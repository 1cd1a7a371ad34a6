"""A worker's grammar masks: each structured request's matcher (made at its first sampled
row, dropped when the request leaves the worker) and the step's masks on the logits.

The masks of a step can be computed while its model forward runs: `start` hands the rows
about to be sampled to one background thread (llguidance releases the GIL, so it runs
beside torch's threads), and `apply` waits for them and masks the logits in one batched
op. Without `start`, or on a one-core worker, `apply` computes them itself
(benchmarks/results/structured_tpot.md: what each costs)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import llguidance
import numpy as np
import torch

from appliance.engine.sequence import SamplingParams
from appliance.engine.structured.matcher import RequestMatcher
from appliance.engine.structured.vocabulary import grammar_vocabulary
from appliance.model.tokenizer import Tokenizer

BITS = 32  # tokens per bitmask word (int32)


class GrammarRow(Protocol):
    """What the masks read of a row to sample (a Sequence or the sampler's SampleRow)."""

    @property
    def seq_id(self) -> int: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...


class GrammarMasks:
    """Matchers per request of one worker, and the masks of its steps."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, *, background: bool | None = None
    ) -> None:
        """vocab_size: the logits' width. background: compute masks on a thread during the
        forward (default: when this process may run on more than one core)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + BITS - 1) // BITS
        self.background = _several_cores() if background is None else background
        self._vocabulary: llguidance.LLTokenizer | None = None  # built at first use
        self._matchers: dict[int, RequestMatcher] = {}
        self._pool: ThreadPoolExecutor | None = None
        # The started step's rows (seq ids in order) and its mask, being computed.
        self._pending: tuple[tuple[int, ...], Future[torch.Tensor]] | None = None

    def start(self, rows: Sequence[GrammarRow]) -> None:
        """Begin computing the mask of a step's rows to sample, in the order the sampler
        will see them, on the background thread (if masks run there)."""
        self._settle()
        if not self.background or not any(r.params.structured is not None for r in rows):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._pending = (_ids(rows), self._pool.submit(self.banned, list(rows)))

    def apply(self, logits: torch.Tensor, rows: Sequence[GrammarRow]) -> None:
        """Set to -inf, in place and in one op, every token of logits [rows, vocab] that
        its row's grammar forbids; rows without a spec are left alone."""
        if not any(r.params.structured is not None for r in rows):
            return
        pending, banned = self._pending, None
        if pending is not None and pending[0] == _ids(rows):
            banned = self._settle()
        if banned is None:  # not started for exactly these rows: compute it now
            self._settle()
            banned = self.banned(rows)
        logits.masked_fill_(banned.to(logits.device, non_blocking=True), float("-inf"))

    def valid_drafts(self, row: GrammarRow, drafts: Sequence[int]) -> int:
        """How many of a structured row's drafts (proposed to follow row.token_ids) its
        grammar allows in a row: the scheduler truncates the draft there, so a draft the
        grammar rejects is never verified. The matcher catches up with the row's tokens
        (emitted ones only) and is not advanced by the drafts."""
        self._wait()
        matcher = self._matcher(row)
        matcher.catch_up(row.token_ids)
        return matcher.valid_drafts(drafts)

    def apply_drafts(self, logits: torch.Tensor, row: GrammarRow, drafts: Sequence[int]) -> None:
        """Mask a verify chunk's logits [1 + k, vocab] in place: row i by the grammar
        state after the row's tokens and drafts 0..i-1 (RequestMatcher.fill_drafts),
        exactly the mask plain decoding would use had it emitted those drafts."""
        self._wait()
        matcher = self._matcher(row)
        matcher.catch_up(row.token_ids)
        bitmask = np.empty((len(drafts) + 1, self.words), dtype=np.int32)  # [1 + k, words]
        matcher.fill_drafts(bitmask.ctypes.data, self.words * 4, drafts)
        banned = torch.from_numpy(bits(bitmask, self.vocab_size) == 0)  # [1 + k, vocab]
        logits.masked_fill_(banned.to(logits.device, non_blocking=True), float("-inf"))

    def _wait(self) -> None:
        """Let the started mask finish (it may read other matchers) without taking it:
        the step's plain rows still find it."""
        if self._pending is not None:
            self._pending[1].result()

    def forget(self, seq_id: int) -> None:
        """Drop a request's matcher: it finished, was aborted, or left for another worker."""
        self._settle()
        self._matchers.pop(seq_id, None)

    def _settle(self) -> torch.Tensor | None:
        """The mask started earlier (waited for), if any; none is left pending."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending[1].result()

    def banned(self, rows: Sequence[GrammarRow]) -> torch.Tensor:
        """[rows, vocab] bool: True where a row's grammar forbids the token (after its
        matcher took the row's new tokens); all False for a row without a spec.

        numpy, not torch: on the thread a torch op would start a second OpenMP team beside
        the forward's (tens of ms on two cores where numpy takes a fraction of one)."""
        index = [i for i, r in enumerate(rows) if r.params.structured is not None]
        bitmask = np.empty((len(index), self.words), dtype=np.int32)  # [k, words]
        for k, i in enumerate(index):
            matcher = self._matcher(rows[i])
            matcher.catch_up(rows[i].token_ids)
            matcher.fill(bitmask.ctypes.data + k * self.words * 4, self.words * 4)
        if len(index) == len(rows):
            return torch.from_numpy(bits(bitmask, self.vocab_size) == 0)
        banned = np.zeros((len(rows), self.vocab_size), dtype=np.bool_)
        banned[index] = bits(bitmask, self.vocab_size) == 0
        return torch.from_numpy(banned)

    def _matcher(self, row: GrammarRow) -> RequestMatcher:
        matcher = self._matchers.get(row.seq_id)
        if matcher is None:
            assert row.params.structured is not None
            start = row.num_prompt_tokens - row.params.emitted  # a re-run's prompt holds output
            matcher = RequestMatcher(row.params.structured, self.vocabulary, start)
            self._matchers[row.seq_id] = matcher
        return matcher

    @property
    def vocabulary(self) -> llguidance.LLTokenizer:
        if self._vocabulary is None:
            self._vocabulary = grammar_vocabulary(
                self._tokenizer, self.vocab_size, self._tokenizer.stop_token_ids
            )
        return self._vocabulary

    def close(self) -> None:
        """Stop the background thread (a worker shutting down)."""
        self._settle()
        if self._pool is not None:
            self._pool.shutdown()


def _several_cores() -> bool:
    """Whether this process may run on more than one core: then a mask thread beside the
    forward pays (on 2 cores with torch's forward on both, it cut the masks' cost at batch
    16 from +13% to +7% of TPOT); on one core it would only take turns with it."""
    return len(os.sched_getaffinity(0)) > 1


def _ids(rows: Sequence[GrammarRow]) -> tuple[int, ...]:
    return tuple(r.seq_id for r in rows)


def bits(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[rows, words] int32 bitmask -> [rows, vocab_size] uint8 0/1, token t's bit being
    bit t % 32 of word t // 32 (little-endian words, as llguidance writes them)."""
    return np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask tensor -> [rows, vocab_size] bool, True where allowed."""
    return torch.from_numpy(bits(bitmask.numpy(), vocab_size) != 0)


def apply_grammar(
    masks: GrammarMasks | None, logits: torch.Tensor, rows: Sequence[GrammarRow]
) -> None:
    """The sampler's call: `masks.apply`, or an error when a row asks for a structured
    output and the sampler was built without masks (never silently unconstrained)."""
    if masks is not None:
        masks.apply(logits, rows)
    elif any(row.params.structured is not None for row in rows):
        raise ValueError("a structured output needs the engine's grammar masks (Sampler.grammar)")
