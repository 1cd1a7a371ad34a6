"""The admin API under /admin, for the console: the pools' state and a stream of it,
moving a device between pools, tuning knobs live, and the planner's recommendation.

Only loopback clients holding the admin token get in; the token is written at start to
a file only the server's user can read. The OpenAI routes under /v1 reach none of this.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from appliance.admin.schema import MoveRequest, TuningPatch
from appliance.api import Appliance, MoveError
from appliance.server.body import read_json_object, validated
from appliance.server.errors import APIError, from_validation
from appliance.server.snapshot import SnapshotBuilder
from appliance.server.state import bearer_is
from appliance.settings.config import is_loopback

SEND_TIMEOUT_S = 30  # a console that stops reading is dropped
MAX_ADMIN_BODY = 16 * 1024


@dataclass
class AdminState:
    appliance: Appliance
    snapshots: SnapshotBuilder
    token_path: Path
    token: str | None = None  # None until the server has started and written it

    def authorize(self, request: Request) -> None:
        """403 for a client off this machine, 401 without the token."""
        host = request.client.host if request.client else ""
        # A client at the very address it connected to is on this machine too (a server
        # bound to a LAN address sees local clients come from that address).
        server = request.scope.get("server") or ("",)
        if not is_loopback(host) and host != server[0]:
            raise APIError(403, "the admin API answers clients on this machine only")
        if self.token is None or not bearer_is(request, self.token):
            raise APIError(
                401,
                "missing or wrong admin token: send 'Authorization: Bearer <token>' with "
                f"the token in {self.token_path}",
                code="invalid_admin_token",
            )


def admin_routes() -> list[Route]:
    return [
        Route("/admin/state", state, methods=["GET"]),
        Route("/admin/events", events, methods=["GET"]),
        Route("/admin/pools", pools, methods=["POST"]),
        Route("/admin/tuning", tuning, methods=["PATCH"]),
        Route("/admin/planner", planner, methods=["GET"]),
        Route("/admin/planner/apply", apply_plan, methods=["POST"]),
        Route("/admin/profile", profile, methods=["GET"]),
        Route("/admin/kv_store/clear", clear_kv_store, methods=["POST"]),
    ]


def _admin(request: Request) -> AdminState:
    admin: AdminState = request.app.state.admin
    admin.authorize(request)
    return admin


async def state(request: Request) -> Response:
    """GET /admin/state: one Snapshot."""
    admin = _admin(request)
    return JSONResponse(admin.snapshots.build().model_dump(mode="json"))


async def events(request: Request) -> Response:
    """GET /admin/events: SSE, a `state` event every interval and an `event` per new event."""
    admin = _admin(request)
    interval = admin.appliance.settings.admin.events_interval_s
    return EventSourceResponse(_stream(admin, interval), send_timeout=SEND_TIMEOUT_S)


async def _stream(admin: AdminState, interval: float) -> AsyncIterator[dict[str, str]]:
    pools = admin.appliance.state
    seen = pools.events[-1].seq if pools.events else 0
    while True:
        for event in [e for e in pools.events if e.seq > seen]:
            seen = event.seq
            yield {"event": "event", "data": event.model_dump_json()}
        yield {"event": "state", "data": admin.snapshots.build().model_dump_json()}
        await asyncio.sleep(interval)


async def pools(request: Request) -> Response:
    """POST /admin/pools {"device": i, "to": "prefill"|"decode"|"colocated"}: 202 with the
    move begun."""
    admin = _admin(request)
    move = validated(MoveRequest, await read_json_object(request, MAX_ADMIN_BODY))
    request.app.state.server.check_ready()
    try:
        started = admin.appliance.pools.start(move.device, move.to)
    except MoveError as exc:
        raise APIError(exc.status, str(exc), param="device", code="move_refused") from None
    return JSONResponse({"move": started.model_dump(mode="json")}, status_code=202)


async def planner(request: Request) -> Response:
    """GET /admin/planner: the rebalancer's PlannerView."""
    admin = _admin(request)
    return JSONResponse(admin.appliance.autopilot.view().model_dump(mode="json"))


async def profile(request: Request) -> Response:
    """GET /admin/profile: the step costs the planner plans with now (the profile on disk
    refined by the steps the workers ran); 404 until a worker size has steps enough."""
    admin = _admin(request)
    current = admin.appliance.profile()
    if current is None:
        raise APIError(404, "no profile yet: the workers have not run steps enough to fit")
    return JSONResponse(current.model_dump(mode="json"))


async def apply_plan(request: Request) -> Response:
    """POST /admin/planner/apply: 202 with the move to the recommended layout begun."""
    admin = _admin(request)
    request.app.state.server.check_ready()
    try:
        started = admin.appliance.autopilot.apply()
    except MoveError as exc:
        raise APIError(exc.status, str(exc), code="move_refused") from None
    return JSONResponse({"move": started.model_dump(mode="json")}, status_code=202)


async def tuning(request: Request) -> Response:
    """PATCH /admin/tuning {knob: value, ...}: the knobs now in force."""
    admin = _admin(request)
    patch = validated(TuningPatch, await read_json_object(request, MAX_ADMIN_BODY))
    request.app.state.server.check_ready()
    try:
        tuning = admin.appliance.tune(patch)
    except ValidationError as exc:
        raise from_validation(exc) from None
    except ValueError as exc:  # knobs that clash with the pools' layout
        raise APIError(422, str(exc), code="invalid_value") from None
    return JSONResponse({"tuning": tuning.model_dump(mode="json")})


# --- kv store (issue 41)


async def clear_kv_store(request: Request) -> Response:
    """POST /admin/kv_store/clear: drop every block of the box's KV store that no worker
    is reading (host and disk tiers); 200 with the blocks each tier lost, 409 while the
    store is off or not open yet."""
    admin = _admin(request)
    if not admin.appliance.settings.kv_store.enabled:
        raise APIError(409, "the KV store is off (kv_store.enabled)", code="kv_store_off")
    cleared = admin.appliance.supervisor.kv_store.clear()
    if cleared is None:
        raise APIError(409, "the KV store opens when the first worker has loaded: not yet")
    return JSONResponse({"cleared": cleared})


# --- end kv store
