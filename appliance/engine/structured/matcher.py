"""One request's place in its grammar, rebuilt from plain data wherever it goes.

A worker never receives a matcher: it builds one from the request's StructuredOutput and
replays the request's own tokens so far. That covers every way a request arrives: the
decode worker gets the prefill worker's first token as the last prompt token; a re-run
(after a crash or a lost handoff) carries its streamed tokens in the prompt, counted by
SamplingParams.emitted. After that it catches up with each token the worker samples."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence as Ids

import llguidance

from appliance.engine.sequence import StructuredOutput
from appliance.engine.structured.compile import UnsupportedSpec, grammar_text

log = logging.getLogger("appliance.engine")


class RequestMatcher:
    """The grammar state of one request: which tokens may come next.

    A worker never fails a step over one request's grammar: a spec it cannot build (the
    server checks specs before submitting, so only a caller that skipped the check sends
    one) or a token the grammar refuses leaves only the end tokens, and the request ends."""

    def __init__(
        self, spec: StructuredOutput, vocabulary: llguidance.LLTokenizer, output_start: int
    ) -> None:
        self.end_ids = list(vocabulary.eos_tokens)
        self.refused: str | None = None  # why only end tokens remain (None: they do not)
        self.matcher: llguidance.LLMatcher | None = None
        try:
            self.matcher = llguidance.LLMatcher(vocabulary, grammar_text(spec), log_level=0)
            if self.matcher.is_error():
                self._refuse(self.matcher.get_error())
        except UnsupportedSpec as exc:
            self._refuse(str(exc))
        # A re-run's own output starts before the end of its prompt (SamplingParams.emitted).
        self.start = output_start
        if self.start < 1:
            self._refuse("the output starts before any prompt token (emitted too large)")
        self.consumed = 0  # of the output tokens (from `start`), how many the matcher took

    def _refuse(self, reason: str) -> None:
        self.refused = self.refused or reason
        log.warning("structured output: %s; only end tokens remain", reason)

    def catch_up(self, token_ids: Ids[int]) -> None:
        """Feed the matcher the output tokens it has not seen: all of them the first time
        (the replay), the last sampled one at each later step. A token the grammar refuses
        (an end token sampled under ignore_eos, past the document's end) leaves only the end
        tokens allowed from then on: the request ends, the worker carries on."""
        new = list(token_ids[self.start + self.consumed :])
        if not new or self.refused is not None or self.matcher is None:
            return
        self.consumed += len(new)
        if not self.matcher.consume_tokens(new):
            self._refuse(self.matcher.get_error() or "a token the grammar does not allow")

    def fill(self, address: int, nbytes: int) -> None:
        """Write the allowed-token bitmask (one bit per token, int32 words, nbytes long)
        at `address`. llguidance releases the GIL while it computes."""
        if self.refused is None and self.matcher is not None:
            self.matcher.unsafe_compute_mask_ptr(address, nbytes)
            return
        words = [0] * (nbytes // 4)
        for token in self.end_ids:
            words[token // 32] |= 1 << (token % 32)
        packed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as int32
        ctypes.memmove(address, (ctypes.c_int32 * len(packed))(*packed), nbytes)

    def valid_drafts(self, drafts: Ids[int]) -> int:
        """How many of `drafts` (proposed after the tokens caught up with) the grammar
        allows in a row; 0 where only end tokens remain (a refused spec never drafts)."""
        if self.refused is not None or self.matcher is None or not drafts:
            return 0
        return int(self.matcher.validate_tokens(list(drafts)))

    def fill_drafts(self, address: int, nbytes: int, drafts: Ids[int]) -> None:
        """Write 1 + len(drafts) bitmasks, nbytes each, one after another from `address`:
        mask i is the one after the caught-up tokens and drafts 0..i-1. The drafts go to
        a copy of the matcher (llguidance's deep_copy), never to this one: it advances by
        emitted tokens alone (catch_up), and a state only a wrong draft leads to (where
        llguidance may stop with an error that a rollback does not clear) stays in the
        copy. Past a draft the grammar refuses the masks repeat the last one:
        verification rejects that draft (its mask forbids it), so no later position is
        ever emitted."""
        self.fill(address, nbytes)
        valid = self.valid_drafts(drafts)
        filled = 0  # the last mask written
        if valid and self.matcher is not None:
            ahead = self.matcher.deep_copy()
            for i in range(1, valid + 1):
                if not ahead.consume_token(drafts[i - 1]):
                    break  # validated, so not expected: the rows after it are never kept
                ahead.unsafe_compute_mask_ptr(address + i * nbytes, nbytes)
                filled = i
        for i in range(filled + 1, len(drafts) + 1):
            ctypes.memmove(address + i * nbytes, address + filled * nbytes, nbytes)

    @property
    def complete(self) -> bool:
        """Nothing but an end token may follow (the mask then allows only those)."""
        return self.matcher is None or bool(self.matcher.is_stopped())
