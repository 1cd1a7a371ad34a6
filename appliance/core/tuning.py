"""The knobs the operator turns live (PATCH /admin/tuning, the console), and the
scheduler limits they set in each worker. Plain pydantic, no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from appliance.core.roles import Role
from appliance.settings.config import BatchSettings


class Tuning(BaseModel):
    """The knobs applied live, without restarting workers."""

    model_config = ConfigDict(extra="forbid")

    prefill_token_budget: int = Field(
        ge=16, description="Tokens one prefill (or colocated) step may run."
    )
    chunk_size: int = Field(ge=16, description="Longest piece of one prompt in one step.")
    decode_max_seqs: int = Field(ge=1, description="Most sequences a decode worker runs at once.")
    routing: Literal["least_loaded", "round_robin"] = Field(
        description="How a prompt picks its prefill worker: the shortest wait for its first "
        "token (queued tokens to compute, its part not cached there), or in turn."
    )
    admission: Literal["open", "paused"] = Field(
        description="paused answers new generations 503 until resumed; running ones go on."
    )

    @model_validator(mode="after")
    def _chunk_fits_budget(self) -> Tuning:
        if self.chunk_size > self.prefill_token_budget:
            raise ValueError(
                f"chunk_size ({self.chunk_size}) must not exceed prefill_token_budget "
                f"({self.prefill_token_budget})"
            )
        return self


class TuningPatch(BaseModel):
    """PATCH /admin/tuning: the knobs to change; the rest keep their values."""

    model_config = ConfigDict(extra="forbid")

    prefill_token_budget: int | None = Field(None, ge=16)
    chunk_size: int | None = Field(None, ge=16)
    decode_max_seqs: int | None = Field(None, ge=1)
    routing: Literal["least_loaded", "round_robin"] | None = None
    admission: Literal["open", "paused"] | None = None

    def applied_to(self, tuning: Tuning) -> Tuning:
        """The tuning with this patch's fields set; raises ValueError if the result is bad."""
        changes = self.model_dump(exclude_none=True)
        return Tuning.model_validate({**tuning.model_dump(), **changes})


def batch_limits(batch: BatchSettings, role: Role, tuning: Tuning) -> dict[str, int]:
    """The scheduler limits `tuning` sets for a worker of `role` (`batch`: the configured
    ones, which the tuning overrides)."""
    prefill = {
        "max_num_batched_tokens": tuning.prefill_token_budget,
        "chunk_size": tuning.chunk_size,
    }
    if role == "prefill":
        return prefill
    # A decode step needs a token of budget per running sequence.
    budget = max(batch.max_num_batched_tokens, tuning.decode_max_seqs)
    decode = {"max_num_seqs": tuning.decode_max_seqs, "max_num_batched_tokens": budget}
    return decode if role == "decode" else prefill | {"max_num_seqs": tuning.decode_max_seqs}


def initial_tuning(batch: BatchSettings) -> Tuning:
    """The tuning a fresh appliance starts with: the configured batch limits."""
    return Tuning(
        prefill_token_budget=batch.max_num_batched_tokens,
        chunk_size=min(batch.chunk_size, batch.max_num_batched_tokens),
        decode_max_seqs=batch.max_num_seqs,
        routing="least_loaded",
        admission="open",
    )


def check_for_mode(tuning: Tuning, mode: str) -> Tuning:
    """The tuning, if the pools' mode allows it; raises ValueError otherwise."""
    if mode == "colocated" and tuning.decode_max_seqs > tuning.prefill_token_budget:
        # A step's budget covers one token per running sequence first: fewer tokens
        # than sequences would leave the newest ones waiting every step.
        raise ValueError(
            f"in colocated mode decode_max_seqs ({tuning.decode_max_seqs}) must not "
            f"exceed prefill_token_budget ({tuning.prefill_token_budget})"
        )
    return tuning
