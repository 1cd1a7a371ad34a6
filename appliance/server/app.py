"""The Starlette app: routes, error handlers, and a lifespan that starts the workers in
the background so /health can answer 503 while they load."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.admin.device_stats import DeviceStats
from appliance.admin.latency_window import LatencyWindow
from appliance.admin.snapshot import SnapshotBuilder
from appliance.admin.token import remove_token, write_token
from appliance.appliance import Appliance
from appliance.server import routes
from appliance.server.admin import AdminState, admin_routes
from appliance.server.errors import APIError, api_error, http_error, unexpected_error
from appliance.server.metrics import Metrics
from appliance.server.sd_notify import Notifier, heartbeat
from appliance.server.state import ServerState
from appliance.topology.nvml import import_nvml

log = logging.getLogger("appliance.server")


def build_app(
    appliance: Appliance, on_start_failed: Callable[[], None] = lambda: None
) -> Starlette:
    """The HTTP app around a prepared (tokenizer loaded) appliance; starting the app
    starts the appliance's workers, stopping it stops them."""
    latency = LatencyWindow()
    metrics = Metrics(CollectorRegistry(), appliance.state, latency, appliance.autopilot.counts)
    state = ServerState(appliance, metrics)
    admin = _admin_state(appliance, latency)
    notifier = Notifier(appliance.settings.notify_socket)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        starting = asyncio.create_task(appliance.start())
        starting.add_done_callback(lambda task: _started(task, state, notifier, on_start_failed))
        beat = asyncio.create_task(heartbeat(notifier, _beat_interval(state), state.status_line))
        try:
            yield
        finally:
            notifier.stopping(f"stopping: {state.in_flight} generations still in flight")
            beat.cancel()
            if admin.token is not None:
                remove_token(admin.token_path, admin.token)
            if not starting.done():
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            await appliance.stop()
            notifier.close()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            *admin_routes(),
        ],
        exception_handlers={
            APIError: _counted(api_error),
            HTTPException: _counted(http_error),
            Exception: _counted(unexpected_error),
        },
        lifespan=lifespan,
    )
    app.state.server = state
    app.state.admin = admin
    app.state.on_listening = lambda: _write_token(admin)  # the server calls it once bound
    return app


def _admin_state(appliance: Appliance, latency: LatencyWindow) -> AdminState:
    devices = appliance.state.topology.devices
    nvml = import_nvml() if any(d.kind == "cuda" for d in devices) else None
    snapshots = SnapshotBuilder(appliance, latency, DeviceStats(nvml))
    return AdminState(appliance, snapshots, appliance.settings.admin_token_path())


def _write_token(admin: AdminState) -> None:
    try:
        admin.token = write_token(admin.token_path)
    except OSError as exc:  # serve anyway: the admin API then refuses everyone
        log.error("cannot write the admin token %s (%s): /admin is disabled", admin.token_path, exc)
        return
    log.info("admin token written to %s", admin.token_path)


def _counted(handler: Callable) -> Callable:
    async def handle(request: Request, exc: Exception) -> Response:
        response = await handler(request, exc)
        request.app.state.server.metrics.errors.labels(str(response.status_code)).inc()
        return response

    return handle


def _beat_interval(state: ServerState) -> float:
    """Half systemd's watchdog period, as sd_watchdog_enabled(3) advises; else every 5 s."""
    usec = state.settings.watchdog_usec
    return usec / 2e6 if usec else 5.0


def _started(
    task: asyncio.Task,
    state: ServerState,
    notifier: Notifier,
    on_start_failed: Callable[[], None],
) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is None:
        views = state.appliance.state.views()
        pools = ", ".join(f"{v.role} worker on {v.device}" for v in views)
        log.info("ready: %s (%s)", state.appliance.model_name, pools)
        notifier.ready(state.status_line())
        return
    state.startup_error = str(error)
    log.error("the workers could not start: %s", error)
    on_start_failed()
