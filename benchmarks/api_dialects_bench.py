"""What each API dialect costs over the OpenAI route it is made into: the same greedy
answer (128 tokens of a text completion, a chat turn) asked through each, streamed, one
request at a time, on one `appliance serve`, alternating dialect by dialect round by
round. The adapters (llama_cpp_api/, ollama_api/, anthropic_api/) read the OpenAI
stream back into their own shapes: this shows that costs nothing a stream would notice.

Decode tok/s is a request's tokens after its first over the time they took (prefill
excluded), the best of the rounds; TTFT the median. Every dialect must give the same
text (checked).

    .venv/bin/python benchmarks/api_dialects_bench.py [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tree_server import start_server

from appliance.model.model_source import model_name
from appliance.topology.cpu import cpu_model_name

ROOT = Path(__file__).resolve().parents[1]
SERVER_ENV = {"APPLIANCE_MODE": "colocated", "APPLIANCE_CPU_DEVICES": "1"}
MODEL = model_name(None)
PROMPT = "Here is a short story about a lighthouse keeper who"
ASK = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]


@dataclass
class Timing:
    texts: list[str] = field(default_factory=list)
    tok_s: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)


# A dialect: its path, its body, and how to read a stream line's text and token count.
Reader = Callable[[dict[str, Any]], tuple[str, int]]


def _sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            yield json.loads(line[5:])


def _ndjson(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    return (json.loads(line) for line in lines if line.strip())


def openai_text(event: dict[str, Any]) -> tuple[str, int]:
    choices = event.get("choices") or [{}]
    return choices[0].get("text") or "", 1 if choices[0].get("text") else 0


def openai_chat(event: dict[str, Any]) -> tuple[str, int]:
    choices = event.get("choices") or [{}]
    text = (choices[0].get("delta") or {}).get("content") or ""
    return text, 1 if text else 0


def llama(event: dict[str, Any]) -> tuple[str, int]:
    return event.get("content", ""), len(event.get("tokens", []))


def ollama(event: dict[str, Any]) -> tuple[str, int]:
    text = event.get("response") or (event.get("message") or {}).get("content") or ""
    return text, 1 if text else 0


def anthropic(event: dict[str, Any]) -> tuple[str, int]:
    text = (event.get("delta") or {}).get("text") or ""
    return text, 1 if text else 0


def dialects(tokens: int) -> dict[str, tuple[str, dict[str, Any], Reader, bool]]:
    greedy = {"model": MODEL, "temperature": 0, "stream": True}
    ollama_options = {"temperature": 0, "num_predict": tokens}
    return {
        "/v1/completions": (
            "/v1/completions",
            greedy | {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True},
            openai_text,
            False,
        ),
        "/completion (llama.cpp)": (
            "/completion",
            {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "stream": True}
            | {"ignore_eos": True},
            llama,
            False,
        ),
        "/api/generate raw (Ollama)": (
            "/api/generate",
            {"model": MODEL, "prompt": PROMPT, "raw": True, "options": ollama_options}
            | {"stream": True},
            ollama,
            True,
        ),
        "/v1/chat/completions": (
            "/v1/chat/completions",
            greedy | {"messages": ASK, "max_tokens": tokens},
            openai_chat,
            False,
        ),
        "/api/chat (Ollama)": (
            "/api/chat",
            {"model": MODEL, "messages": ASK, "options": ollama_options, "stream": True},
            ollama,
            True,
        ),
        "/v1/messages (Anthropic)": (
            "/v1/messages",
            greedy | {"messages": ASK, "max_tokens": tokens},
            anthropic,
            False,
        ),
    }


def ask(http: httpx.Client, path: str, body: dict[str, Any], read: Reader, nd: bool) -> Any:
    """One streamed request: its text, decode tok/s after the first token, TTFT ms."""
    start = time.perf_counter()
    first = last = 0.0
    text, count = "", 0
    with http.stream("POST", path, json=body) as reply:
        reply.raise_for_status()
        events = _ndjson(reply.iter_lines()) if nd else _sse(reply.iter_lines())
        for event in events:
            piece, n = read(event)
            if n:
                now = time.perf_counter()
                first = first or now
                last = now
                count += n
            text += piece
    rate = (count - 1) / (last - first) if count > 1 and last > first else 0.0
    return text, rate, (first - start) * 1000


def table(timings: dict[str, Timing]) -> str:
    base = max(timings["/v1/completions"].tok_s)
    chat_base = max(timings["/v1/chat/completions"].tok_s)
    rows = [
        "| dialect | decode tok/s (best) | vs its OpenAI route | TTFT ms (median) |",
        "|---|---:|---:|---:|",
    ]
    for name, t in timings.items():
        reference = base if name in list(timings)[:3] else chat_base
        best, ttft = max(t.tok_s), statistics.median(t.ttft_ms)
        rows.append(f"| {name} | {best:.1f} | {best / reference:.2f}x | {ttft:.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    ways = dialects(args.tokens)
    process, url = start_server(ROOT, SERVER_ENV)
    try:
        http = httpx.Client(base_url=url, timeout=300)
        for path, body, read, nd in ways.values():  # warm each path once
            ask(http, path, body, read, nd)
        timings = {name: Timing() for name in ways}
        for _ in range(args.rounds):
            for name, (path, body, read, nd) in ways.items():
                text, rate, ttft = ask(http, path, body, read, nd)
                timings[name].texts.append(text)
                timings[name].tok_s.append(rate)
                timings[name].ttft_ms.append(ttft)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    text_answers = {t for name in list(ways)[:3] for t in timings[name].texts}
    chat_answers = {t for name in list(ways)[3:] for t in timings[name].texts}
    print(
        f"{cpu_model_name()}, {os.cpu_count()} cores; `appliance serve` colocated, one worker; "
        f"{args.tokens} tokens greedy, streamed, best of {args.rounds} alternating rounds\n"
    )
    same = len(text_answers) == 1 and len(chat_answers) == 1
    print(f"every dialect gave its OpenAI route's text: {'yes' if same else 'NO'}\n")
    print(table(timings))


if __name__ == "__main__":
    main()
