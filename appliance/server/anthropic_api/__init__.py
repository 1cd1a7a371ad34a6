"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), served through the
chat pipeline: the body and what it becomes (request.py), Anthropic's answer shapes and
events (reply.py), the routes (route.py)."""
