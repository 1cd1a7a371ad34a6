"""OpenTelemetry spans of each request across its processes (server, supervisor, prefill
worker, handoff, decode worker), exported over OTLP/HTTP where tracing.otlp_traces_endpoint
is set. Off by default: nothing here imports OpenTelemetry until `start_exporting` does."""
