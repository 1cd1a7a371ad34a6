"""POST /v1/responses, OpenAI's Responses API, served through the chat pipeline: the
request and what it becomes (request.py), the response object and its stream events
(events.py), the route (route.py)."""
