"""The Starlette app: routes, error handlers, and a lifespan that starts the workers in
the background so /health can answer 503 while they load."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from appliance.admin.device_stats import DeviceStats
from appliance.admin.latency_window import LatencyWindow
from appliance.admin.token import remove_token, write_token
from appliance.api import Appliance
from appliance.server import embeddings, routes, tokenization
from appliance.server.admin import AdminState, admin_routes
from appliance.server.anthropic_api import route as anthropic
from appliance.server.errors import APIError, api_error, http_error, unexpected_error
from appliance.server.llama_cpp_api import route as llama_cpp
from appliance.server.metrics import Metrics
from appliance.server.ollama_api import management as ollama_models
from appliance.server.ollama_api import route as ollama
from appliance.server.origin_guard import OriginGuard, OriginRules
from appliance.server.responses_api.route import create_response, delete_response, get_response
from appliance.server.responses_api.store import ResponseStore
from appliance.server.sd_notify import Notifier, heartbeat
from appliance.server.snapshot import SnapshotBuilder
from appliance.server.state import ServerState
from appliance.settings.config import Settings, is_loopback
from appliance.topology.nvml import import_nvml
from appliance.tracing.exporting import start_exporting
from appliance.tracing.http_spans import RequestSpans

log = logging.getLogger("appliance.server")
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # and how to reach them
DEFAULT_PORT: int = Settings.model_fields["port"].default  # the console's without --url
STATIC = Path(__file__).with_name("static")  # the chat page's files
# The chat page loads its own files only, and no other site may frame it.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def build_app(
    appliance: Appliance, on_start_failed: Callable[[], None] = lambda: None
) -> Starlette:
    """The HTTP app around a prepared (tokenizer loaded) appliance; starting the app
    starts the appliance's workers, stopping it stops them."""
    latency = LatencyWindow()
    metrics = Metrics(CollectorRegistry(), appliance.state, latency, appliance.autopilot.counts)
    kept = ResponseStore(appliance.settings.server.responses_kept)
    state = ServerState(appliance, metrics, kept)
    admin = _admin_state(appliance, latency)
    notifier = Notifier(appliance.settings.notify_socket)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        exporting = start_exporting(appliance.settings.tracing, "server")  # None: off
        starting = asyncio.create_task(appliance.start())
        starting.add_done_callback(
            lambda task: _started(task, state, admin, notifier, on_start_failed)
        )
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
            if exporting is not None:
                exporting.stop()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
            Route("/v1/embeddings", embeddings.openai_embeddings, methods=["POST"]),
            Route("/v1/messages", anthropic.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            # an id may hold slashes ("org/name"), as a Hugging Face one does
            Route("/v1/models/{model_id:path}", routes.model, methods=["GET"]),
            Route("/tokenize", tokenization.tokenize, methods=["POST"]),
            Route("/detokenize", tokenization.detokenize, methods=["POST"]),
            Route("/apply-template", tokenization.apply_template, methods=["POST"]),
            Route("/completion", llama_cpp.completion, methods=["POST"]),
            Route("/completions", llama_cpp.completion, methods=["POST"]),
            Route("/infill", llama_cpp.infill, methods=["POST"]),
            Route("/props", llama_cpp.props, methods=["GET"]),
            Route("/api/chat", ollama.chat, methods=["POST"]),
            Route("/api/generate", ollama.generate, methods=["POST"]),
            Route("/api/embed", embeddings.ollama_embed, methods=["POST"]),
            Route("/api/embeddings", embeddings.ollama_embeddings, methods=["POST"]),
            Route("/api/tags", ollama.tags, methods=["GET"]),
            Route("/api/ps", ollama.running, methods=["GET"]),
            Route("/api/show", ollama.show, methods=["POST"]),
            Route("/api/version", ollama.ollama_version, methods=["GET"]),
            Route("/api/pull", ollama_models.pull, methods=["POST"]),
            *(
                Route(f"/api/{what}", ollama_models.refused, methods=["POST"])
                for what in ("push", "create", "copy")
            ),
            Route("/api/delete", ollama_models.refused, methods=["DELETE"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            *admin_routes(),
            Route("/", _chat_page, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        middleware=_middleware(appliance.settings),
        exception_handlers={
            APIError: _counted(api_error),
            HTTPException: _counted(http_error),
            Exception: _counted(unexpected_error),
        },
        lifespan=lifespan,
    )
    app.state.server = state
    app.state.admin = admin
    # The server calls it once bound, with the port it got (port 0 picks a free one).
    app.state.on_listening = lambda port: _listening(state, admin, port)
    return app


def _middleware(settings: Settings) -> list[Middleware]:
    """The origin guard; outside it, where tracing is on, each API request's root span."""
    guard = [Middleware(OriginGuard, rules=OriginRules.for_settings(settings))]
    return [Middleware(RequestSpans), *guard] if settings.tracing.enabled else guard


async def _chat_page(request: Request) -> Response:
    """GET /: the chat page (static/index.html), which talks to /v1 like any client."""
    return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)


def _admin_state(appliance: Appliance, latency: LatencyWindow) -> AdminState:
    devices = appliance.state.topology.devices
    nvml = import_nvml() if any(d.kind == "cuda" for d in devices) else None
    snapshots = SnapshotBuilder(appliance, latency, DeviceStats(nvml))
    return AdminState(appliance, snapshots, appliance.settings.admin_token_path())


def _listening(state: ServerState, admin: AdminState, port: int) -> None:
    """Bound: write the admin token (a port-0 server's under the port it got, where the
    console looks for it), and say ready if the workers were quicker."""
    state.port = port
    settings = state.settings
    if settings.port == 0:
        admin.token_path = settings.model_copy(update={"port": port}).admin_token_path()
    _write_token(admin)
    _say_ready(state, admin)


def _say_ready(state: ServerState, admin: AdminState) -> None:
    """Once listening and every worker ready: the line a user starts from."""
    if state.announced or state.port is None or not state.appliance.ready:
        return
    state.announced = True
    log.info("%s", ready_line(state, admin))


def ready_line(state: ServerState, admin: AdminState) -> str:
    """`ready:`, the model and its workers, the API's URL, the console command and where
    the admin token is."""
    settings = state.settings
    port = state.port if state.port is not None else settings.port
    host = settings.host
    wildcard = host in WILDCARD_HOSTS
    local = WILDCARD_HOSTS.get(host, host)
    scheme = "https" if settings.server.ssl_certfile is not None else "http"
    base = f"{scheme}://{f'[{local}]' if ':' in local else local}:{port}"
    where = f"listening on all interfaces, {host} port {port}" if wildcard else ""
    if settings.api_key is not None:
        where = ", ".join(filter(None, [where, "send the API key"]))
    api = f"{base}/v1" + (f" ({where})" if where else "")
    console = "appliance console"
    if port != DEFAULT_PORT or not (wildcard or is_loopback(host)):
        console += f" --url {base}"
    if settings.admin.token_file is not None:
        console += f" --token-file {admin.token_path}"
    token = str(admin.token_path) if admin.token is not None else "none (/admin is disabled)"
    views = state.appliance.state.views()
    pools = ", ".join(f"{v.role} worker on {v.device}" for v in views)
    return (
        f"ready: {state.appliance.model_name} ({pools}); API: {api}; "
        f"console: {console}; admin token: {token}"
    )


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
    admin: AdminState,
    notifier: Notifier,
    on_start_failed: Callable[[], None],
) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is None:
        _say_ready(state, admin)
        notifier.ready(state.status_line())
        return
    state.startup_error = str(error)
    log.error("the workers could not start: %s", error)
    on_start_failed()
