"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/ps, /api/show,
/api/version), served through the chat pipeline: the bodies and what they become
(request.py), Ollama's answer shapes (reply.py), the routes (route.py), the stream on
the wire (ndjson.py), and the model-management routes a server of one model answers
(management.py: /api/pull of the served model; push, create, copy and delete refused).
/api/embed is served with /v1/embeddings (server/embeddings.py)."""
