"""The chaos soak's traffic (benchmarks/chaos_soak.py): the catalogue of temperature-0
requests, the client that sends one and judges its answer against its reference, and the
client loops."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

MODEL = "SmolLM2-135M-Instruct"
BACK_OFF_S = 1.0  # a client answered 503 + Retry-After waits this long (not the header's)


# ----------------------------------------------------------------------------- traffic


@dataclass(frozen=True)
class Spec:
    """One request of the catalogue: where it goes, its body (n=1, whole), how it is sent."""

    name: str
    route: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]
    stream: bool = False
    n: int = 1
    drop_after: int = 0  # > 0: the client closes the stream after this many chunks


@dataclass
class Outcome:
    """What became of one request."""

    spec: str
    verdict: str  # completed, failed_cleanly, cancelled, lost, wrong, hang, bad_status
    seconds: float
    detail: str = ""


WORDS = (
    "harbor lantern orchard copper meadow signal winter river market engine garden "
    "letter bridge valley candle ledger window summit thunder compass island village"
).split()


def long_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def catalogue(seed: int, max_tokens: int) -> list[Spec]:
    """The requests the clients draw from: each kind with a few prompts."""
    rng = random.Random(seed)
    common = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    prompts = [
        "The lighthouse keeper wrote in his log that the ship",
        "Three things every garden needs are",
        "In the winter market the baker sold",
        "A letter arrived from the island, and it said",
    ]
    questions = ["Name a color.", "What is rain?", "Say something kind.", "Count to five."]
    shared = "Context: " + long_text(rng, 160) + "\nQuestion: "  # the reused prefix
    specs = []
    for i, p in enumerate(prompts):
        body = {**common, "prompt": p}
        specs += [Spec(f"complete{i}", "/v1/completions", body)]
        specs += [Spec(f"stream{i}", "/v1/completions", body, stream=True)]
        specs += [Spec(f"n2_{i}", "/v1/completions", body, n=2)]
        specs += [Spec(f"drop{i}", "/v1/completions", body, stream=True, drop_after=2)]
    for i, q in enumerate(questions):
        chat = {**common, "messages": [{"role": "user", "content": q}]}
        specs += [Spec(f"chat{i}", "/v1/chat/completions", chat)]
        specs += [Spec(f"chat_stream{i}", "/v1/chat/completions", chat, stream=True)]
        specs += [Spec(f"prefix{i}", "/v1/completions", {**common, "prompt": shared + q})]
    for i in range(3):
        body = {**common, "prompt": f"Story {i}: " + long_text(rng, 300)}
        specs += [Spec(f"long{i}", "/v1/completions", body)]
    return specs


def reply_texts(spec: Spec, reply: dict[str, Any]) -> list[str]:
    """The choices' texts of a whole reply, by index."""
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    if spec.route.endswith("chat/completions"):
        return [c["message"]["content"] or "" for c in choices]
    return [c["text"] for c in choices]


def delta_text(spec: Spec, choice: dict[str, Any]) -> str:
    if spec.route.endswith("chat/completions"):
        return choice.get("delta", {}).get("content") or ""
    return choice.get("text") or ""


class Client:
    """Sends one Spec and judges the answer against its reference."""

    def __init__(self, http: httpx.AsyncClient, references: dict[str, str], deadline: float):
        self.http, self.references, self.deadline = http, references, deadline

    async def reference(self, spec: Spec) -> str:
        """The answer of `spec` (whole, n=1) alone on the server."""
        reply = await self.http.post(spec.route, json=spec.body, timeout=self.deadline)
        reply.raise_for_status()
        return reply_texts(spec, reply.json())[0]

    async def send(self, spec: Spec) -> Outcome:
        started = time.monotonic()
        try:
            verdict, detail = await asyncio.wait_for(self._send(spec), self.deadline)
        except TimeoutError:
            verdict, detail = "hang", f"no end within {self.deadline:.0f} s"
        except httpx.TransportError as exc:  # the connection ended without an answer
            verdict, detail = "lost", f"{type(exc).__name__}: {exc}"
        return Outcome(spec.name, verdict, time.monotonic() - started, detail[:300])

    async def _send(self, spec: Spec) -> tuple[str, str]:
        body = {**spec.body, "n": spec.n, "stream": spec.stream}
        if not spec.stream:
            reply = await self.http.post(spec.route, json=body, timeout=None)
            if reply.status_code != 200:
                return refused(reply.status_code, reply.headers, reply.text)
            return self._judge(spec, reply_texts(spec, reply.json()))
        async with self.http.stream("POST", spec.route, json=body, timeout=None) as reply:
            if reply.status_code != 200:
                return refused(reply.status_code, reply.headers, (await reply.aread()).decode())
            return await self._read_stream(spec, reply)

    async def _read_stream(self, spec: Spec, reply: httpx.Response) -> tuple[str, str]:
        texts = [""] * spec.n
        chunks = 0
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return self._judge(spec, texts)
            event = json.loads(data)
            if "error" in event:
                return stream_error(event["error"])
            for choice in event.get("choices", []):
                texts[choice["index"]] += delta_text(spec, choice)
            chunks += 1
            if spec.drop_after and chunks >= spec.drop_after:
                return "cancelled", f"dropped after {chunks} chunks"
        return "lost", "the stream ended without [DONE]"

    def _judge(self, spec: Spec, texts: list[str]) -> tuple[str, str]:
        """Completed when every choice is the reference (n=2 at temperature 0: both are)."""
        expected = self.references[spec.name]
        wrong = [t for t in texts if t != expected]
        if wrong:
            return "wrong", f"expected {expected!r}, got {wrong[0]!r}"
        return "completed", ""


def refused(status: int, headers: httpx.Headers, text: str) -> tuple[str, str]:
    """A non-200 answer: clean only as a 503 (or 429) that says when to come back."""
    if status in (429, 503) and headers.get("retry-after"):
        return "failed_cleanly", f"{status}: {text[:200]}"
    return "bad_status", f"{status}: {text[:200]}"


def stream_error(error: dict[str, Any]) -> tuple[str, str]:
    """An error event inside a stream: clean as a 503's (service_unavailable) with a message."""
    if error.get("type") == "service_unavailable" and error.get("message"):
        return "failed_cleanly", f"stream error: {error['message']}"
    return "bad_status", f"stream error: {error}"


async def references(client: Client, specs: list[Spec]) -> dict[str, str]:
    """Each spec's answer alone on the server, one request at a time (specs with the same
    route and body share one)."""
    by_body: dict[str, str] = {}
    answers = {}
    for spec in specs:
        key = spec.route + json.dumps(spec.body, sort_keys=True)
        if key not in by_body:
            by_body[key] = await client.reference(spec)
        answers[spec.name] = by_body[key]
    return answers


class Traffic:
    """`clients` loops sending requests drawn from the catalogue while running is set."""

    def __init__(self, client: Client, specs: list[Spec], rng: random.Random) -> None:
        self.client, self.rng = client, rng
        self.specs = [s for s in specs if not s.drop_after]  # drops come as a fault
        self.drops = [s for s in specs if s.drop_after]
        self.running = asyncio.Event()
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self._tasks: list[asyncio.Task] = []

    def start(self, clients: int) -> None:
        self._tasks = [asyncio.create_task(self._loop()) for _ in range(clients)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self.running.wait()
            if await self.one(self.rng.choice(self.specs)) == "failed_cleanly":
                await asyncio.sleep(BACK_OFF_S)  # told to come back later: not at once

    async def one(self, spec: Spec) -> str:
        """Send `spec`, record its outcome; its verdict."""
        self.in_flight += 1
        try:
            outcome = await self.client.send(spec)
            self.outcomes.append(outcome)
            return outcome.verdict
        finally:
            self.in_flight -= 1

    def disconnecting(self, count: int) -> list[asyncio.Task]:
        """`count` streams whose clients hang up after a few chunks."""
        return [asyncio.create_task(self.one(self.rng.choice(self.drops))) for _ in range(count)]

    async def pause(self) -> None:
        """No new request; returns once those in flight have ended (each within its
        deadline, so this ends too)."""
        self.running.clear()
        while self.in_flight:
            await asyncio.sleep(0.1)
