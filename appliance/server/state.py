"""What every route needs: the appliance, the metrics, and the checks done before work
(key, readiness, model name, admission)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request

from appliance.api import Appliance
from appliance.server.errors import APIError
from appliance.server.metrics import Metrics
from appliance.server.responses_api.store import ResponseStore
from appliance.settings.config import Settings

STARTING_RETRY_S = 5
PAUSED_RETRY_S = 5
OVERLOAD_RETRY_S = 1


def server_version() -> str:
    """This server's version, as the APIs that report one (Ollama's, llama.cpp's) give it."""
    try:
        return version("appliance")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "0.0.0"


def bearer_is(request: Request, secret: str) -> bool:
    """Whether the request carries `Authorization: Bearer <secret>` (compared in constant
    time, so the answer's timing tells nothing about the secret)."""
    sent = request.headers.get("authorization", "").encode()
    return hmac.compare_digest(sent, f"Bearer {secret}".encode())


def api_key_is(request: Request, secret: str) -> bool:
    """Whether the request carries Anthropic's `x-api-key: <secret>` (constant time)."""
    sent = request.headers.get("x-api-key", "").encode()
    return hmac.compare_digest(sent, secret.encode())


@dataclass
class Ticket:
    """Admission of `count` generations; released exactly once."""

    state: ServerState
    count: int
    released: bool = False

    def release(self) -> None:
        """Give the slots back (again is harmless)."""
        if not self.released:
            self.released = True
            self.state.in_flight -= self.count


@dataclass
class ServerState:
    appliance: Appliance
    metrics: Metrics
    responses: ResponseStore  # what previous_response_id and /v1/responses/{id} read
    in_flight: int = 0  # admitted generations not yet finished
    startup_error: str | None = None  # set when the workers could not start
    draining: bool = False  # shutting down: running requests finish, new ones get 503
    port: int | None = None  # the port bound, once listening
    announced: bool = False  # the `ready:` line is out

    @property
    def settings(self) -> Settings:
        return self.appliance.settings

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        secret = key.get_secret_value()
        if not (bearer_is(request, secret) or api_key_is(request, secret)):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>' (or "
                "Anthropic's 'x-api-key: <key>')",
                code="invalid_api_key",
            )

    def check_ready(self) -> None:
        if self.startup_error is not None:
            raise APIError(503, f"the appliance failed to start: {self.startup_error}")
        if not self.appliance.ready:
            raise APIError(
                503,
                "the appliance is starting: its workers are loading the model",
                code="starting",
                retry_after=STARTING_RETRY_S,
            )

    def check_admission_open(self) -> None:
        if self.draining:
            raise APIError(
                503,
                "the appliance is shutting down; requests already running go on",
                code="shutting_down",
                retry_after=STARTING_RETRY_S,
            )
        if self.appliance.state.tuning.admission == "paused":
            raise APIError(
                503,
                "admission is paused by the operator; requests already running go on",
                code="admission_paused",
                retry_after=PAUSED_RETRY_S,
            )

    def status_line(self) -> str:
        """The pools' state in a few words (systemd's STATUS=)."""
        if self.startup_error is not None:
            return f"failed to start: {self.startup_error}"
        views = self.appliance.state.views()
        if not self.appliance.ready:
            return f"starting: {len(views)} workers loading the model"
        pools: dict[str, list[bool]] = {}
        for view in views:
            pools.setdefault(view.role, []).append(view.phase == "ready")
        counts = ", ".join(f"{role} {sum(up)}/{len(up)}" for role, up in pools.items())
        doing = "draining" if self.draining else "serving"
        return f"{doing}: workers ready {counts}; {self.in_flight} generations in flight"

    def check_model(self, name: str) -> None:
        if name != self.appliance.model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.appliance.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_room(self, count: int) -> None:
        """429 when `count` more generations would pass the limit."""
        limit = self.settings.server.max_concurrent_requests
        if self.in_flight + count > limit:
            raise APIError(
                429,
                f"the server is at its limit of {limit} generations in flight; retry shortly",
                code="overloaded",
                retry_after=OVERLOAD_RETRY_S,
            )

    def admit(self, count: int) -> Ticket:
        """Hold `count` generation slots until the ticket is released; 429 when full."""
        self.check_room(count)
        self.in_flight += count
        return Ticket(self, count)
