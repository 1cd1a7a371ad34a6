"""llama.cpp server's answer shapes for /completion, from the engine's chunks: streamed,
one object a piece (`content`, its `tokens`, `stop: false`) and a last one with
`stop: true`; whole, that last object with all the text. The last object says why it
stopped (`stop_type` eos, limit or word, and the `stopping_word`), the counts, the
`generation_settings` in force and the `timings` llama.cpp reports; with `n_probs`,
each token's `completion_probabilities` (`probs` with `post_sampling_probs`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from appliance.api import Chunk, SamplingParams
from appliance.engine.sampling.logprobs import TokenLogprobs
from appliance.model.tokenizer import Tokenizer
from appliance.server.responses import Piece
from appliance.server.stop_reason import stop_reason


@dataclass
class LlamaReply:
    """One /completion's answer. `arrival`: time.monotonic() when the request came."""

    tokenizer: Tokenizer
    pieces: Piece  # a token id's text (replies.token_pieces: decoded once a request)
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    n_probs: int = 0
    probabilities: bool = False  # post_sampling_probs: probabilities, not logprobs
    return_tokens: bool = False
    n_ctx: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    probs: list[dict[str, Any]] = field(default_factory=list)
    cached_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None

    def piece(self, chunk: Chunk) -> dict[str, Any]:
        """A chunk taken in; what a stream sends for it (before the last object)."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        probs = [self._probability(t) for t in chunk.logprobs or []]
        self.probs.extend(probs)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
        line = {
            "index": 0,
            "content": chunk.text,
            "tokens": list(chunk.token_ids),
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": len(self.token_ids),
            "tokens_evaluated": len(self.prompt_ids),
        }
        return line | ({"completion_probabilities": probs} if self.n_probs else {})

    def last(self, streamed: bool) -> dict[str, Any]:
        """The closing object: in a stream without the text the pieces carried."""
        stop_type, word = self._stop_type()
        final = {
            "index": 0,
            "content": "" if streamed else self.text,
            "tokens": [] if streamed or not self.return_tokens else self.token_ids,
            "id_slot": -1,
            "stop": True,
            "model": self.model,
            "tokens_predicted": len(self.token_ids),
            "tokens_evaluated": len(self.prompt_ids),
            "generation_settings": self._settings(),
            "prompt": self.tokenizer.decode(self.prompt_ids, skip_special_tokens=False),
            "has_new_line": "\n" in self.text,
            # the context filled before the limit, the model's end or a stop
            "truncated": self.finish_reason == "length"
            and len(self.prompt_ids) + len(self.token_ids) >= self.n_ctx,
            "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": self.cached_tokens,
            "timings": self._timings(),
        }
        if self.n_probs and not streamed:
            final["completion_probabilities"] = self.probs
        return final

    def _stop_type(self) -> tuple[str, str]:
        """eos, limit (n_predict or the context) or word, and the stop string that ended
        it (a stop token id is an eos to llama.cpp)."""
        if self.finish_reason == "length":
            return "limit", ""
        reason = stop_reason(self.tokenizer, self.params, self.token_ids, self.text)
        return ("word", reason) if isinstance(reason, str) else ("eos", "")

    def _probability(self, token: TokenLogprobs) -> dict[str, Any]:
        """A token's entry of completion_probabilities, as llama.cpp writes it."""
        kind, top = ("prob", "top_probs") if self.probabilities else ("logprob", "top_logprobs")
        entry = self._token(token.token_id, token.logprob, kind)
        alternatives = token.top[: self.n_probs]
        return entry | {top: [self._token(i, lp, kind) for i, lp in alternatives]}

    def _token(self, token_id: int, logprob: float, kind: str) -> dict[str, Any]:
        text, raw = self.pieces(token_id), list(self.pieces.bytes_of(token_id))
        value = math.exp(logprob) if kind == "prob" else max(logprob, -9999.0)
        return {"id": token_id, "token": text, "bytes": raw, kind: value}

    def _settings(self) -> dict[str, Any]:
        """The sampling in force (the request's, the model's defaults where it said none)."""
        p = self.params
        return {
            "n_ctx": self.n_ctx,
            "n_predict": p.max_tokens,
            "model": self.model,
            "seed": -1 if p.seed is None else p.seed,
            "temperature": p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "min_p": p.min_p,
            **llama_samplers(p),
            "repeat_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "stop": list(p.stop),
            "ignore_eos": p.ignore_eos,
            "n_probs": self.n_probs,
            "post_sampling_probs": self.probabilities,
        }

    def _timings(self) -> dict[str, Any]:
        """llama.cpp's timings: the prompt's (to the first token) and the prediction's."""
        now = time.monotonic()
        first = self.first_token_at or now
        prompt_n = max(len(self.prompt_ids) - self.cached_tokens, 0)
        predicted_n = len(self.token_ids)
        prompt_ms = (first - self.arrival) * 1000
        predicted_ms = (now - first) * 1000
        return {
            "cache_n": self.cached_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_ms * 1000 if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": predicted_n / predicted_ms * 1000 if predicted_ms > 0 else 0.0,
        }


def llama_samplers(p: SamplingParams) -> dict[str, Any]:
    """llama.cpp's own samplers' settings in `p`, by llama.cpp's names and "off" values."""
    return {
        "top_n_sigma": p.top_n_sigma if p.top_n_sigma > 0 else -1.0,
        "typical_p": p.typical_p,
        "xtc_probability": p.xtc_probability,
        "xtc_threshold": p.xtc_threshold,
        "dynatemp_range": p.dynatemp_range,
        "dynatemp_exponent": p.dynatemp_exponent,
        "mirostat": p.mirostat,
        "mirostat_tau": p.mirostat_tau,
        "mirostat_eta": p.mirostat_eta,
        "dry_multiplier": p.dry_multiplier,
        "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length,
        "dry_penalty_last_n": p.dry_penalty_last_n,
        "dry_sequence_breakers": list(p.dry_sequence_breakers),
    }
