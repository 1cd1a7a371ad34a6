"""The admin API's shapes: what GET /admin/state and /admin/events send, what
POST /admin/pools and PATCH /admin/tuning take.

Plain pydantic, no torch: the console imports these to read what the appliance sends.
Times are Unix seconds; latencies are milliseconds; memory is bytes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Core types the admin API sends as they are (the console reads them from here).
from appliance.core.events import Event as Event
from appliance.core.roles import Role as Role
from appliance.core.tuning import Tuning as Tuning
from appliance.core.tuning import TuningPatch as TuningPatch

WorkerPhase = Literal["starting", "ready", "draining", "stopping", "exited"]
MovePhase = Literal["draining", "stopping", "starting", "done", "failed"]


class WorkerInfo(BaseModel):
    """The worker process serving one device."""

    worker_id: int
    role: Role
    phase: WorkerPhase
    pid: int | None
    waiting: int = Field(description="Requests sent to it that have not started yet.")
    running: int = Field(description="Sequences it is running.")
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_per_s: float = Field(description="Tokens it produced per second, lately.")
    restarts: int
    devices: list[int] = Field(
        default_factory=list,
        description="Every device it runs on: several for a tensor-parallel worker.",
    )
    spec_acceptance_rate: float | None = Field(
        None,
        description="Speculative decoding: draft tokens kept per draft token verified since "
        "the worker started; None before its first verified draft.",
    )
    spec_mean_accepted_length: float | None = Field(
        None,
        description="Speculative decoding: tokens a verify step made on average (kept "
        "drafts + 1); None before its first verified draft.",
    )


class DeviceInfo(BaseModel):
    """One device (a GPU, or a set of CPU cores) and the worker on it, if any."""

    index: int
    name: str
    kind: Literal["cpu", "cuda"]
    box: str = Field("", description="The box it is on: empty for the head's own.")
    pool: Role | None = Field(description="The pool its worker serves; None while it has none.")
    worker: WorkerInfo | None
    utilization: float | None = Field(
        description="Percent busy: the GPU's (NVML), or the worker process's CPU share of "
        "its cores. None where unknown."
    )
    memory_used: int | None = Field(description="GPU memory used (NVML), or the worker's RSS.")
    memory_total: int | None


class Percentiles(BaseModel):
    p50: float | None = None
    p99: float | None = None


class Latency(BaseModel):
    """Requests that finished within the last `window_s` seconds."""

    window_s: float
    finished: int
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    requests_per_s: float
    output_tokens_per_s: float


class RequestRow(BaseModel):
    """A request in flight."""

    request_id: int
    state: Literal["queued", "prefill", "handoff", "decode"]
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float = Field(description="Time to its first token, or waited so far without one.")
    prefill_worker: int | None
    decode_worker: int | None


class MoveRequest(BaseModel):
    """POST /admin/pools: move `device` (its index) to the `to` pool."""

    model_config = ConfigDict(extra="forbid")

    device: int = Field(ge=0)
    to: Role


class Move(BaseModel):
    """A device changing pools: its worker switches role in place (done at once), or, where
    it cannot (appliance/ops/pool_moves.py), drains, stops, and one of the other role starts."""

    move_id: int
    device: int
    from_role: Role
    to_role: Role
    phase: MovePhase
    remaining: int = Field(description="Requests the draining worker still has.")
    started_at: float
    finished_at: float | None = None
    error: str | None = None


class Measured(BaseModel):
    """What the box measured on one window of traffic: how long ago, the fraction of its
    finished requests within the SLO, that as goodput, and the traffic it was."""

    age_s: float = Field(description="Seconds before the decision it was measured.")
    attainment: float = Field(description="Fraction of its finished requests within the SLO.")
    goodput: float = Field(description="Requests/s within the SLO: attainment x rate.")
    rate: float = Field(description="Requests per second.")
    mean_prompt_tokens: float
    mean_output_tokens: float


class Decision(BaseModel):
    """One look of the rebalancer at the last window of traffic: the layout it would
    run (one device moved at most), why it moved or held, the rule that decided and its
    inputs. A layout as a key is each device's role by index, '-' for none
    ('prefill,decode,-'); `remembered` and `barred` key layouts by shape (roles sorted),
    since layouts of one shape serve alike."""

    at: float
    current: list[Role | None] = Field(description="Each device's role, by index.")
    recommended: list[Role | None] = Field(
        description="The best layout one move away (or the current one)."
    )
    move_device: int | None = Field(description="The device to move; None: hold.")
    move_to: Role | None
    predicted_current: float = Field(
        description="Goodput (requests/s within the SLO) of the current layout on the "
        "window's traffic: the simulator's, or the measured one where that is lower."
    )
    predicted_recommended: float
    attainment: float | None = Field(
        description="Measured fraction of the window's finished requests within the SLO."
    )
    window_requests: int
    acted: bool = Field(description="A move of the appliance started from this decision.")
    reason: str
    rule: str = Field(
        "",
        description="The rule that decided, a short name (e.g. margin, cooldown, "
        "measured-stay, rollback; docs/autopilot.md); empty from an appliance that does "
        "not say.",
    )
    simulated: dict[str, float] = Field(
        default_factory=dict,
        description="Each layout simulated on the window's traffic: its goodput (req/s).",
    )
    measured: Measured | None = Field(
        None, description="What the box measured on this window; None: nothing finished."
    )
    remembered: dict[str, Measured] = Field(
        default_factory=dict,
        description="Each layout's latest measurement on traffic similar to this window's.",
    )
    barred: dict[str, str] = Field(
        default_factory=dict, description="The layouts that were no target, and why."
    )


class PlannerView(BaseModel):
    """The rebalancer's state for the console's planner panel (GET /admin/planner)."""

    auto_rebalance: bool = Field(description="Moves devices itself (planner.auto_rebalance).")
    interval_s: float
    profile: str | None = Field(description="The profile it simulates with; None: none.")
    status: str = Field(description="One line: what it is doing or why it cannot plan.")
    current: list[Role | None]
    recommended: list[Role | None] | None
    predicted_current: float | None
    predicted_recommended: float | None
    next_move: tuple[int, Role] | None = Field(
        None,
        description="(device, role): the first move toward the recommended layout, the one "
        "POST /admin/planner/apply starts (a layout two moves away goes one at a time).",
    )
    decisions: list[Decision] = Field(description="The latest decisions, oldest first.")


class KVStoreView(BaseModel):
    """The box's KV store (issue 41): blocks by tier, what it served since it opened."""

    hits: dict[str, int] = Field(description="Blocks workers copied from it, by tier.")
    misses: int = Field(description="Lookups whose stored prefix ended short of the prompt.")
    lookups: int
    bytes_read: dict[str, int] = Field(description="Bytes of the blocks served, by tier.")
    bytes_written: dict[str, int] = Field(description="Bytes put into each tier.")
    blocks: dict[str, int] = Field(description="Blocks held now, by tier.")
    used_bytes: dict[str, int]
    capacity_bytes: dict[str, int]
    refused: int = Field(description="Disk blocks that failed their checks: dropped.")


class Snapshot(BaseModel):
    """Everything the console shows, as of `at`."""

    at: float
    model: str
    mode: Literal["disaggregated", "colocated"]
    ready: bool
    devices: list[DeviceInfo]
    tuning: Tuning
    latency: Latency
    requests: list[RequestRow] = Field(description="In flight, oldest first (at most 50).")
    requests_in_flight: int
    moves: list[Move] = Field(description="The running move and the last few finished.")
    events: list[Event] = Field(description="The most recent events, oldest first.")
    # --- faults (issue 40): each fault and recovery as a structured event
    faults: dict[str, int] = Field(
        default_factory=dict,
        description="Fault and recovery events since the start, by kind (worker_exit, "
        "stall, kill, restart, box_lost, box_joined, rerun, request_failed).",
    )
    fault_events: list[Event] = Field(
        default_factory=list,
        description="The most recent fault and recovery events (with the worker, box, cause "
        "and request ids each touched), oldest first.",
    )
    # --- end faults
    planner: PlannerView | None = Field(
        None, description="The rebalancer's view; None when the appliance has none."
    )
    # --- kv store (issue 41)
    kv_store: KVStoreView | None = Field(
        None, description="The box's KV store; None while it is off or not open yet."
    )
    # --- end kv store
