"""`appliance serve`: the HTTP server in front of the pools, run by uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from appliance.appliance import Appliance
from appliance.config import Settings, is_loopback
from appliance.server.app import build_app

log = logging.getLogger("appliance.server")
GRACEFUL_SHUTDOWN_S = 30  # on Ctrl-C / SIGTERM, how long open requests may still run


def serve(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; returns the process's exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    appliance = Appliance(settings)
    appliance.prepare()  # a bad model file fails here, before anything listens
    if not is_loopback(settings.host):
        log.warning(
            "listening on %s: other machines can reach this server%s",
            settings.host,
            "" if settings.api_key else " and no api_key is set",
        )
    server: uvicorn.Server | None = None

    def stop_serving() -> None:
        server.should_exit = True

    app = build_app(appliance, on_start_failed=stop_serving)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    server.run()
    return 1 if app.state.server.startup_error else 0
