"""What a box's work costs: one model step on one worker, a KV handoff, the host's share.

Pure data (no torch), stored as versioned JSON under `cache_dir/profiles/`, keyed by what
the costs depend on (model, dtype, weights, device kind). `appliance profile` measures one
(planner/profiler.py); planner/analytic.py derives one from a datasheet.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file is missing, unreadable, of another version, or for other hardware."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StepCost(_Frozen):
    """Seconds of one model step, linear in its work:

    base + per_token * tokens + per_seq * seqs + per_attended * attended + per_context * context

    tokens: query tokens the step runs (every prefill chunk's tokens, one per decode);
    seqs: sequences in the step; attended: query-key pairs of the prefill chunks (a chunk
    of n tokens starting at position s attends n*s + n*(n+1)/2); context: keys the decodes
    read (the sum of each decoding sequence's length).

    Where the worker's quantized products switch kernels (`gemm_rows`: from that many
    prompt tokens in a step they run as a GEMM, cpu_kernels' prefill_gemm_rows) the tokens
    cost two lines: below it `per_token` a token, from it `gemm_base` (dequantizing the
    weights, once a step) plus `per_gemm_token` a token. None: one line (a profile of an
    older appliance, a GPU's, or steps of one regime only).

    `per_draft_s`: what each draft row of a speculative verify step adds beside its
    sequence's decode row, its keys apart (planner/speculation.py counts those in
    context). None: a query token's, per_token_s (what an unmeasured profile assumes)."""

    base_s: float = Field(ge=0)
    per_token_s: float = Field(0.0, ge=0)
    per_seq_s: float = Field(0.0, ge=0)
    per_attended_s: float = Field(0.0, ge=0)
    per_context_s: float = Field(0.0, ge=0)
    gemm_rows: int | None = Field(None, ge=1)
    per_gemm_token_s: float = Field(0.0, ge=0)
    gemm_base_s: float = Field(0.0, ge=0)
    per_draft_s: float | None = Field(None, ge=0)

    @property
    def draft_s(self) -> float:
        """Seconds a draft row adds to a decode step (per_draft_s, else per_token_s)."""
        return self.per_token_s if self.per_draft_s is None else self.per_draft_s

    def seconds(
        self, tokens: int, seqs: int, attended: int, context: int, prompt_tokens: int | None = None
    ) -> float:
        """The step's predicted time; `prompt_tokens`: of `tokens`, those of prompt chunks
        (what decides the regime; None: all of them)."""
        prompt = tokens if prompt_tokens is None else prompt_tokens
        if self.gemm_rows is not None and prompt >= self.gemm_rows:
            token_cost = self.gemm_base_s + self.per_gemm_token_s * tokens
        else:
            token_cost = self.per_token_s * tokens
        return (
            self.base_s
            + token_cost
            + self.per_seq_s * seqs
            + self.per_attended_s * attended
            + self.per_context_s * context
        )


def attended(start: int, num_tokens: int) -> int:
    """Query-key pairs of a prefill chunk of `num_tokens` tokens starting at `start` (causal)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class WorkerCost(_Frozen):
    """How fast one worker of one size runs its steps, and how much KV it holds."""

    prefill: StepCost  # steps of prompt chunks alone (a prefill worker's)
    decode: StepCost  # steps of single-token decodes alone
    mixed: StepCost  # a colocated step: prompt chunks beside decodes
    kv_blocks: int = Field(ge=1)  # the KV pool of one such worker
    # A step's time is multiplied by this while the box's other devices run steps too
    # (on a CPU they share memory bandwidth and caches); 1.0 where they do not interfere.
    contention: float = Field(1.0, ge=1.0)


class HandoffCost(_Frozen):
    """Moving one request's KV from a prefill worker to a decode worker (within a box, or
    as `Profile.network`, over the link between two boxes)."""

    base_s: float = Field(ge=0)
    per_byte_s: float = Field(ge=0)

    def seconds(self, num_bytes: int) -> float:
        """A handoff of `num_bytes` bytes alone: the fixed latency plus the bytes' time."""
        return self.base_s + self.per_byte_s * num_bytes


class HostCost(_Frozen):
    """What the supervisor and HTTP server add: per model step a worker reports, and per
    token streamed to a client (worker -> supervisor -> SSE)."""

    per_step_s: float = Field(0.0, ge=0)
    per_token_s: float = Field(0.0, ge=0)


class ProfileKey(_Frozen):
    """What the costs depend on: another key needs another profile."""

    model: str  # the model file or folder's name and size, see `model_id`
    dtype: str
    weights: str  # dense or quantized
    device_kind: str  # e.g. "cpu: AMD EPYC (avx512_bf16)", "cuda: NVIDIA H200"

    def file_name(self) -> str:
        digest = hashlib.blake2b(self.model_dump_json().encode(), digest_size=8).hexdigest()
        return f"profile-v{PROFILE_VERSION}-{digest}.json"


def worker_unit(device_size: int, tp: int) -> str:
    """The name of a worker's size: `tp` devices of `device_size` atoms each (an atom is a
    core on a CPU box, a GPU on a GPU box). "1x1": one device of one core or GPU."""
    if device_size < 1 or tp < 1:
        raise ValueError(f"a worker needs device_size >= 1 and tp >= 1, got {device_size}, {tp}")
    return f"{device_size}x{tp}"


class Profile(_Frozen):
    """A box's costs for one model: the simulator's input beside a layout and a workload."""

    version: int = PROFILE_VERSION
    key: ProfileKey
    atoms: int = Field(ge=1)  # cores (CPU box) or GPUs the box has to split
    block_size: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=1)  # K and V of every layer, whole model
    max_model_len: int = Field(ge=1)
    workers: dict[str, WorkerCost]  # by worker_unit(device_size, tp)
    handoff: HandoffCost
    host: HostCost
    # The link between two such boxes (KV crossing it through NIXL): what a handoff costs
    # when its prefill and decode workers are on different boxes. None: one box only (a
    # profile of an older appliance has none and still loads).
    network: HandoffCost | None = None
    analytic: bool = False  # derived from a datasheet, not measured
    assumptions: tuple[str, ...] = ()  # what an analytic profile (or a measurement) assumed
    samples: tuple[dict[str, float | int | str], ...] = ()  # raw measurements, for the record

    def worker(self, unit: str) -> WorkerCost:
        """The cost of a worker of this size; ProfileError if it was not profiled."""
        if unit not in self.workers:
            known = ", ".join(sorted(self.workers)) or "none"
            raise ProfileError(f"the profile has no worker of size {unit} (it has {known})")
        return self.workers[unit]

    def save(self, folder: Path) -> Path:
        """Write it as `folder/<key file name>`; returns the path."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / self.key.file_name()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json(indent=1))
        tmp.replace(path)
        return path


def load_profile(path: Path) -> Profile:
    """Read a profile file; ProfileError saying what is wrong with it."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path} is not JSON: {exc}") from None
    # The version first: another version's fields would fail for a reason that misleads.
    version = data.get("version") if isinstance(data, dict) else None
    if version != PROFILE_VERSION:
        raise ProfileError(
            f"{path} is a version {version} profile; this appliance reads version "
            f"{PROFILE_VERSION}: run `appliance profile` again"
        )
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ProfileError(f"{path}: {where}: {error['msg']}") from None


def model_id(path: Path) -> str:
    """How a profile names its model: the file or folder's name and size in bytes."""
    if path.is_file():
        size = path.stat().st_size
    else:
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return f"{path.name} ({size} bytes)"


def newest_profile(folder: Path, model: str, kind: str | None = None) -> Profile | None:
    """The most recently written readable profile of `model` (see `model_id`) in `folder`;
    with `kind` ("cpu" or "cuda"), only a profile of that kind of device (a CPU profile
    does not plan a GPU box)."""
    found = []
    for path in folder.glob(f"profile-v{PROFILE_VERSION}-*.json"):
        try:
            profile = load_profile(path)
        except ProfileError:
            continue  # another version, or half written: not one to plan with
        if profile.key.model == model and (
            kind is None or profile.key.device_kind.startswith(kind)
        ):
            found.append((path.stat().st_mtime, profile))
    return max(found, key=lambda pair: pair[0])[1] if found else None


def profiles_folder(cache_dir: Path) -> Path:
    """Where `appliance profile` writes and the planner looks."""
    return cache_dir / "profiles"
