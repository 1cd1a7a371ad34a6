"""A naive baseline for `appliance bench compare`: transformers' `generate` behind a
streaming /v1/completions, one request at a time, as a quick script would serve a model.

python -m appliance.bench.naive_server --port 8001 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
import uvicorn
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from appliance.model.model_source import default_model_path, model_name, prepare_tokenizer
from appliance.model.tokenizer import IncrementalDetokenizer, Tokenizer


class TokenStreamer:
    """transformers' streamer protocol: `put` gets the prompt, then each new token."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def _generate(model: Any, streamer: TokenStreamer, kwargs: dict[str, Any]) -> None:
    try:
        model.generate(**kwargs)
    finally:  # a failed generate still ends its stream
        streamer.end()


def build_app(model: Any, tokenizer: Tokenizer, name: str) -> Starlette:
    """/v1/completions and /v1/models around a transformers model."""
    lock = asyncio.Lock()  # one generation at a time: the naive part

    async def completions(request: Request) -> Response:
        body = await request.json()
        ids = tokenizer.encode(body["prompt"])
        max_tokens = int(body.get("max_tokens", 16))
        min_tokens = max_tokens if body.get("ignore_eos") else 0
        if body.get("stream"):
            return EventSourceResponse(events(ids, max_tokens, min_tokens), sep="\n")
        text, count = "", 0
        async for piece in generate(ids, max_tokens, min_tokens):
            text, count = text + piece, count + 1
        usage = {"prompt_tokens": len(ids), "completion_tokens": count}
        return JSONResponse({"choices": [{"index": 0, "text": text}], "usage": usage})

    async def events(ids: list[int], max_tokens: int, min_tokens: int) -> AsyncIterator[str]:
        created, rid, count = int(time.time()), uuid.uuid4().hex, 0
        async for piece in generate(ids, max_tokens, min_tokens):
            count += 1
            chunk = {"id": rid, "object": "text_completion", "created": created, "model": name}
            yield json.dumps(chunk | {"choices": [{"index": 0, "text": piece}]})
        usage = {"prompt_tokens": len(ids), "completion_tokens": count}
        yield json.dumps({"id": rid, "choices": [], "usage": usage})
        yield "[DONE]"

    async def generate(ids: list[int], max_tokens: int, min_tokens: int) -> AsyncIterator[str]:
        async with lock:
            queue: asyncio.Queue = asyncio.Queue()
            streamer = TokenStreamer(asyncio.get_running_loop(), queue)
            kwargs = dict(
                input_ids=torch.tensor([ids]),
                max_new_tokens=max_tokens,
                min_new_tokens=min_tokens,
                do_sample=False,
                streamer=streamer,
            )
            thread = threading.Thread(target=_generate, args=(model, streamer, kwargs))
            thread.start()
            detokenizer = IncrementalDetokenizer(tokenizer)
            try:
                while (token := await queue.get()) is not None:
                    yield detokenizer.add(token)
            finally:  # one at a time, even when a client leaves early
                await asyncio.to_thread(thread.join)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"}]})

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, help="GGUF file (default: the embedded one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from appliance.settings.config import load_settings

    path = args.model or default_model_path()
    _, tokenizer = prepare_tokenizer(path, load_settings().cache_dir)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    app = build_app(model.eval(), tokenizer, model_name(path))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
