"""`appliance serve`: the HTTP server in front of the pools, run by uvicorn, drained
gracefully on SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from appliance.api import Appliance
from appliance.kv.remote_pool import require_nixl
from appliance.server.app import build_app
from appliance.server.state import ServerState
from appliance.settings.config import ServerSettings, Settings, is_loopback

log = logging.getLogger("appliance.server")
DRAIN_POLL_S = 0.1
CLOSE_GRACE_S = 5  # after the drain, how long uvicorn waits for connections to close


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains: new requests get 503, running ones
    finish until `server.shutdown_timeout_s`, then the server stops. A second signal
    stops it at once (uvicorn closes the connections, up to CLOSE_GRACE_S); a third
    does not wait for them. Either way the app's shutdown stops the workers."""

    def __init__(
        self, config: uvicorn.Config, state: ServerState, on_listening: Callable[[int], None]
    ) -> None:
        super().__init__(config)
        self.state = state
        self.on_listening = on_listening
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        # Only a server that got its port writes the admin token: a second one started on
        # the same port by mistake must not replace (then delete) the first one's.
        if not self.should_exit:
            self.on_listening(self._bound_port())

    async def shutdown(self, sockets: list | None = None) -> None:
        await super().shutdown(sockets)
        # Forced (or forced while uvicorn ran the app's shutdown: then it is done).
        if self.force_exit and not self.lifespan.shutdown_event.is_set():
            # uvicorn skips the app's shutdown when forced (a second signal), and the app's
            # lifespan, cancelled as the loop closes, then logs a CancelledError traceback;
            # the app's shutdown is what stops the workers and removes the admin token.
            await self.lifespan.shutdown()

    def _bound_port(self) -> int:
        """The port listened on: the one asked for, or the one port 0 got."""
        for server in self.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.config.port

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if self.state.draining or loop is None or not self.started:
            self._stop_now()
            return
        self.state.draining = True
        log.info(
            "signal %s: draining %d generations", signal.Signals(sig).name, self.state.in_flight
        )
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.settings.server.shutdown_timeout_s
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.state.in_flight:
            log.warning("shutdown deadline passed: ending %d generations", self.state.in_flight)
        # Not _stop_now: a second Ctrl-C already set should_exit, and the generations it
        # cut end this loop; that must not count as a third and skip the app's shutdown.
        self.should_exit = True

    def _stop_now(self) -> None:
        # Not uvicorn's handle_exit: that records the signal and re-raises it on the way
        # out, so a drained server would die of SIGTERM instead of exiting 0.
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def serve(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; returns the process's exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # What cannot serve fails before the layout is planned (seconds) and the model loads.
    check_https(settings.server)
    if settings.cluster.listen:
        require_nixl()  # the supervisor's Boxes checks again, for any other way in
    from appliance.planner.auto_layout import autopilot_resolved, planned_settings

    settings = autopilot_resolved(settings)  # while the settings still say what pins
    if settings.planner.layout == "auto":
        settings = planned_settings(settings)
    appliance = Appliance(settings)
    appliance.prepare()  # a bad model file fails here, before anything listens
    if not is_loopback(settings.host):
        log.warning(
            "listening on %s: other machines can reach this server%s",
            settings.host,
            "" if settings.api_key else " and no api_key is set",
        )
    server: DrainingServer | None = None

    def stop_serving() -> None:
        assert server is not None  # made before it runs the app, which calls this
        server.should_exit = True

    app = build_app(appliance, on_start_failed=stop_serving)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        lifespan="on",
        timeout_graceful_shutdown=CLOSE_GRACE_S,
        # HTTPS where both are set (check_https): then plain HTTP gets no answer.
        ssl_certfile=settings.server.ssl_certfile,
        ssl_keyfile=settings.server.ssl_keyfile,
    )
    server = DrainingServer(config, app.state.server, app.state.on_listening)
    server.run()
    return 1 if app.state.server.startup_error else 0


def check_https(server: ServerSettings) -> None:
    """ValueError naming the setting when HTTPS is asked for half-way or with files TLS
    cannot use (uvicorn would fail only once the model has loaded)."""
    cert, key = server.ssl_certfile, server.ssl_keyfile
    if (cert is None) != (key is None):
        raise ValueError(
            "server.ssl_certfile and server.ssl_keyfile go together (--ssl-certfile, "
            "--ssl-keyfile): set both for HTTPS, neither for plain HTTP"
        )
    if cert is None or key is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as error:
        raise ValueError(
            f"server.ssl_certfile {cert} with server.ssl_keyfile {key} cannot be used: {error}"
        ) from None
