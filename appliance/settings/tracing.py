"""The tracing section of the settings model (appliance/settings/config.py): OpenTelemetry
spans of each request, exported over OTLP/HTTP. Off unless an endpoint is set; the names
follow vLLM's (`--otlp-traces-endpoint`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TracingSettings(BaseModel):
    """Where the spans of each request go (the server's, the supervisor's and each
    worker's, each process exporting its own)."""

    model_config = ConfigDict(extra="forbid")

    otlp_traces_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces endpoint (an OpenTelemetry collector, Jaeger, Tempo), "
        "e.g. 'http://127.0.0.1:4318/v1/traces'. Empty: no tracing, and the OpenTelemetry "
        "SDK is not imported (needs the `tracing` extra: pip install 'appliance[tracing]').",
    )
    service_name: str = Field(
        "appliance",
        min_length=1,
        description="The spans' service.name resource attribute; each process adds its own "
        "part as service.instance.id (server, worker 3).",
    )

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if not value:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(
                f"tracing.otlp_traces_endpoint {value!r} must be an http:// or https:// URL "
                "(OTLP over HTTP)"
            )
        return value

    @property
    def enabled(self) -> bool:
        return self.otlp_traces_endpoint is not None
