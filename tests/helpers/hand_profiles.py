"""Hand-made planner profiles: a box's costs written out so a test's answer is plain (the
planner, the simulator, the autopilot and the online profile are checked on them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.planner.profile import (
    HandoffCost,
    HostCost,
    Profile,
    ProfileKey,
    StepCost,
    WorkerCost,
)

HAND_MADE = ProfileKey(model="hand-made", dtype="float32", weights="dense", device_kind="test")
QUICK_HANDOFF = HandoffCost(base_s=0.0005, per_byte_s=0.0)
# The simulator's tests' step costs (round figures, so an expected time is plain arithmetic).
SIM_PREFILL = StepCost(base_s=0.010, per_token_s=0.001, per_seq_s=0.0005, per_attended_s=1e-6)
SIM_DECODE = StepCost(base_s=0.020, per_token_s=0.0002, per_seq_s=0.001, per_context_s=1e-5)
SIM_HOST = HostCost(per_step_s=0.002, per_token_s=0.0005)


def hand_profile(
    workers: Mapping[str, WorkerCost],
    *,
    atoms: int = 2,
    kv_bytes_per_token: int = 1024,
    max_model_len: int = 4096,
    handoff: HandoffCost = QUICK_HANDOFF,
    host: HostCost | None = None,
    key: ProfileKey = HAND_MADE,
    **fields: Any,
) -> Profile:
    """A profile of these worker costs (by worker_unit, "1x1" a one-core worker) on a box
    of `atoms` cores, blocks of 16 tokens, free host steps unless `host` says otherwise;
    `fields` the Profile's others (network, assumptions)."""
    return Profile(
        key=key,
        atoms=atoms,
        block_size=16,
        kv_bytes_per_token=kv_bytes_per_token,
        max_model_len=max_model_len,
        workers=dict(workers),
        handoff=handoff,
        host=host or HostCost(),
        **fields,
    )
