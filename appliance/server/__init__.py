"""The HTTP server: OpenAI-compatible routes, health and metrics."""
