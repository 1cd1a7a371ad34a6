"""Where a KV store hit's TTFT goes (issue 41): a short multi-turn chat through a real
server, with every process stamping the stages of each timed request (benchmarks/kv_probe:
imported by each process through PYTHONPATH, it wraps the functions named below), then the
median of each stage over the requests the store served.

    .venv/bin/python benchmarks/kv_store_breakdown.py [--store host|off]
        [--mode default|disaggregated|colocated] [--conversations 4 --turns 4] [--pool-mb 64]

The chat is kv_store_bench's (`--answers model`), the same prompts and server settings.
Stages of one timed request, each from CLOCK_MONOTONIC stamps in the process that runs it:
- http_in: the client sends -> the supervisor's RequestFlow.submit starts (HTTP, parsing);
- route: RequestFlow.submit (the router with the store's stored_keys, StoreOwner.hits_for,
  the StoreHits and Submit onto the worker's queue), with lookup: hits_for alone;
- queue: submit returns -> the worker starts handling the Submit;
- load: StoreClient.load (the stored blocks copied into the pool; `blocks` how many);
- submit_rest: the rest of handling the Submit (the engine's add_request);
- to_step: the Submit handled -> the engine's step with its prefill starts;
- step: that step (the prefill of the part computed, the first token sampled), wall and
  the worker thread's CPU time (a busy box inflates wall, much less the CPU time);
- report: the worker's report of the step (the TokenBatch and any store messages out);
- pipe: the report starts -> the supervisor's reader thread has the TokenBatch;
- loop: that -> the first chunk put on the request's stream (the event loop);
- sse: that -> the client reads the first chunk;
- clean_ahead: the idle worker's writes ahead (StoreClient.clean_ahead) that ran while the
  request's Submit waited on its queue (part of `queue`).
Also counted: the blocks copied into the store inside an engine step (a decode worker's
finish-time writes, an eviction's), and that step's time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
from kv_store_bench import (  # benchmarks/ is the script's folder: on sys.path
    MODEL,
    Chats,
    cpu_name,
    target,
    tokenizer_encode,
)

from appliance.bench.compare import running

PROBE = Path(__file__).parent / "kv_probe"


@dataclass
class Stamp:
    pid: int
    name: str
    start: float
    end: float
    details: dict[str, str]

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1000

    @property
    def cpu(self) -> float:
        return float(self.details.get("cpu", "0"))


@dataclass
class Sent:
    """One timed request as the client saw it."""

    start: float
    first: float
    prompt: int
    cached: int


def read_stamps(folder: Path) -> list[Stamp]:
    stamps = []
    for path in folder.glob("p*.txt"):
        for line in path.read_text().splitlines():
            pid, name, start, end, *rest = line.split(" ", 4)
            words = rest[0].split() if rest else []
            details = dict(w.split("=", 1) for w in words if "=" in w)
            stamps.append(Stamp(int(pid), name, float(start), float(end), details))
    return sorted(stamps, key=lambda s: s.start)


def complete(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> tuple:
    """One streamed completion: (its Sent, its text)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, text, usage = time.monotonic(), 0.0, [], {}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code} {reply.read().decode()}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not first and chunk.get("choices"):
                first = time.monotonic()
            text += [c.get("text", "") for c in chunk.get("choices") or []]
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Sent(start, first, len(prompt), cached), "".join(text)


def stages(sent: Sent, stamps: list[Stamp]) -> dict[str, float] | None:
    """One timed request's stages (ms), from the stamps in its window."""
    window = [s for s in stamps if sent.start <= s.start <= sent.first]

    def named(name: str, **match: str) -> list[Stamp]:
        return [
            s
            for s in window
            if s.name == name and all(s.details.get(k) == v for k, v in match.items())
        ]

    submits = named("s.submit")
    if not submits:
        return None
    submit = submits[0]
    handles = named("w.handle", type="Submit", rid=submit.details["wire"])
    if not handles:
        return None
    handle = handles[0]
    mine = [s for s in window if s.pid == handle.pid]
    loads = [s for s in mine if s.name == "w.store.load" and s.start <= handle.end]
    steps = [s for s in mine if s.name == "w.engine.step" and s.start >= handle.end]
    if not steps:
        return None
    step = steps[0]
    reports = [s for s in mine if s.name == "w.report" and s.start >= step.end]
    batches = [s for s in named("s.recv", type="TokenBatch") if s.start >= step.end]
    puts = named("s.put", rid=submit.details["rid"])
    if not reports or not batches or not puts:
        return None
    cleans = [s for s in stamps if s.pid == handle.pid and s.name == "w.store.clean_ahead"]
    waited = sum(max(0.0, min(s.end, handle.start) - max(s.start, submit.end)) for s in cleans)
    return {
        "prompt": sent.prompt,
        "cached": sent.cached,
        "blocks": sum(float(s.details.get("loaded", 0)) for s in loads),
        "ttft": (sent.first - sent.start) * 1000,
        "http_in": (submit.start - sent.start) * 1000,
        "route": submit.ms,
        "lookup": sum(s.ms for s in named("s.store.hits_for")),
        "queue": (handle.start - submit.end) * 1000,
        "load": sum(s.ms for s in loads),
        "submit_rest": handle.ms - sum(s.ms for s in loads),
        "to_step": (step.start - handle.end) * 1000,
        "step": step.ms,
        "step_cpu": step.cpu,
        "report": reports[0].ms,
        "pipe": (batches[0].start - reports[0].start) * 1000,
        "loop": (puts[0].start - batches[0].start) * 1000,
        "sse": (sent.first - puts[0].start) * 1000,
        "clean_ahead": waited * 1000,
    }


def copies_in_steps(stamps: list[Stamp]) -> tuple[int, int, float, float]:
    """(blocks copied into the store inside an engine step, of all copied; the median step
    CPU ms of the one-token steps with such copies, and without)."""
    copies = [s for s in stamps if s.name == "w.store.copy_out"]
    steps = [s for s in stamps if s.name == "w.engine.step"]
    inside, with_copies = 0, set()
    for copy in copies:
        for step in steps:
            if step.pid == copy.pid and step.start <= copy.start <= step.end:
                inside += 1
                with_copies.add(id(step))
                break
    decodes = [s for s in steps if s.details.get("outs", "").count(":1:") == 1]
    busy = [s.cpu for s in decodes if id(s) in with_copies]
    plain = [s.cpu for s in decodes if id(s) not in with_copies]
    median = statistics.median
    return inside, len(copies), median(busy) if busy else 0.0, median(plain) if plain else 0.0


def render(rows: list[dict[str, float]], stamps: list[Stamp], args: argparse.Namespace) -> str:
    hits = [r for r in rows if r["blocks"] > 0]
    keys = list(rows[0])
    lines = [
        f"KV store breakdown on {cpu_name()}: store {args.store}, layout {args.mode}, "
        f"{args.conversations} chats x {args.turns} turns, pool {args.pool_mb} MiB; "
        f"{len(rows)} timed requests, {len(hits)} served blocks by the store (medians, ms)",
        "",
        "| requests | " + " | ".join(keys) + " |",
        "|---" * (len(keys) + 1) + "|",
    ]
    for label, chosen in (("store hits", hits), ("all", rows)):
        if chosen:
            cells = [f"{statistics.median(r[k] for r in chosen):.1f}" for k in keys]
            lines.append(f"| {label} ({len(chosen)}) | " + " | ".join(cells) + " |")
    inside, copied, busy, plain = copies_in_steps(stamps)
    lines += [
        "",
        f"blocks written to the store inside an engine step: {inside} of {copied}; "
        f"one-token steps' CPU median {busy:.1f} ms with such writes, {plain:.1f} without",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=["host", "off"], default="host")
    parser.add_argument(
        "--mode", choices=["default", "disaggregated", "colocated"], default="default"
    )
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--pool-mb", type=int, default=64)
    parser.add_argument("--keep", type=Path, default=None, help="keep the stamps here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kv-store-breakdown-"))
    probe = args.keep or work / "stamps"
    probe.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm") / f"kv-store-breakdown-{uuid.uuid4().hex}"
    shm.mkdir()
    server = target(args.store, args.pool_mb, args.store, shm, None)
    server.env |= {"KV_PROBE_DIR": str(probe), "PYTHONPATH": str(PROBE)}
    if args.mode != "default":
        server.env["APPLIANCE_MODE"] = args.mode
    encode = tokenizer_encode()
    timed: list[Sent] = []
    try:
        with running(server, work / "logs") as url, httpx.Client() as client:
            chats = Chats(args.conversations, args.turns, 512, 64, "model")

            def answer(history: list[int]) -> list[int]:
                return encode(complete(client, url, history, 64)[1])

            for prompt in chats.prompts(answer):
                timed.append(complete(client, url, prompt, 4)[0])
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    stamps = read_stamps(probe)
    rows = [r for r in (stages(s, stamps) for s in timed) if r is not None]
    print(render(rows, stamps, args))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
