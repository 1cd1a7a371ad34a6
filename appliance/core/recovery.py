"""What a lost worker means for each request it held: plain decisions on the request
table's data. The supervisor carries them out (appliance/pools/supervisor.py, `_recover`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from appliance.core.request_table import Phase, Request


class Action(Enum):
    """What to do with a request whose worker is gone."""

    REROUTE = "reroute"  # its handoff went to the lost decode worker: send the parked KV on
    RERUN = "rerun"  # its work is lost: run it again from its prompt + the tokens streamed
    FAIL = "fail"  # its work is lost and it was run again too often: end it with an error


@dataclass(frozen=True)
class Recovery:
    """One request's fate after its worker was lost."""

    request_id: int
    action: Action


def retry_action(request: Request, max_retries: int) -> Action:
    """A lost attempt runs again, unless the request has used up its retries."""
    return Action.RERUN if request.retries < max_retries else Action.FAIL


def after_worker_lost(held: Iterable[Request], worker_id: int, max_retries: int) -> list[Recovery]:
    """The fate of each request lost worker `worker_id` held (`RequestTable.held_by`)."""
    plan = []
    for request in held:
        action = _lost_action(request, worker_id, max_retries)
        if action is not None:
            plan.append(Recovery(request.request_id, action))
    return plan


def _lost_action(request: Request, worker_id: int, max_retries: int) -> Action | None:
    if request.phase is Phase.HANDING_OFF:
        if request.decode_worker == worker_id:
            return Action.REROUTE  # the KV is still parked in the prefill pool
        # Its source is gone, but the decode worker may have copied the KV already: its
        # answer decides (refused, the handoff finds the source gone and it runs again).
        return None
    if request.phase.terminal or request.phase is Phase.WAITING:
        return None  # a worker holds neither
    return retry_action(request, max_retries)
