"""Turning span export on in one process: the OpenTelemetry SDK's tracer provider with a
batching OTLP/HTTP exporter, made the process's global provider (which the API's tracers
find). Imported, with the SDK, only where tracing.otlp_traces_endpoint is set."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.settings.tracing import TracingSettings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("appliance.tracing")


@dataclass
class Exporting:
    """A process's span export, to stop (flush what is buffered) as the process ends."""

    provider: TracerProvider

    def stop(self) -> None:
        self.provider.shutdown()


def start_exporting(settings: TracingSettings, instance: str) -> Exporting | None:
    """Export this process's spans to the configured endpoint; None (nothing imported)
    when tracing is off. `instance` names the process (service.instance.id: "server",
    "worker 3"). The batch's schedule follows the SDK's OTEL_BSP_* environment."""
    if settings.otlp_traces_endpoint is None:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            "tracing.otlp_traces_endpoint is set but OpenTelemetry is not installed: "
            "pip install 'appliance[tracing]'"
        ) from exc
    resource = Resource.create(
        {"service.name": settings.service_name, "service.instance.id": instance}
    )
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=settings.otlp_traces_endpoint)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("%s: tracing to %s", instance, settings.otlp_traces_endpoint)
    return Exporting(provider)
