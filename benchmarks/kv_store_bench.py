"""The box's KV store (issue 41): TTFT, prefill tokens computed and hits per tier with the
store off, host tier only, host + disk, on workloads whose working set is several times
the workers' KV pools; and a warm restart (disk tier kept) against a cold one.

    .venv/bin/python benchmarks/kv_store_bench.py [--conversations 8 --turns 6]
        [--documents 6 --questions 4] [--pool-mb 64] [--out FILE]

Workloads (token-id prompts, the same every run; one request at a time, so TTFT is the
prefill, not queueing):
- multi-turn chat: `conversations` chats of `turns` turns, interleaved round robin; each
  turn re-sends the whole history (a system prompt, every earlier turn and answer) plus a
  new user message, as a chat client does;
- shared documents: `documents` documents of `doc_tokens` tokens, each asked `questions`
  questions, the questions of all documents interleaved.
With the workers' pools pinned small (kv.memory_mb = --pool-mb), the working set is 3-5x
a pool: without the store a prefix is evicted before its next use.

Configurations: store off; host tier only; host + disk. Then the restart: the host+disk
server answers the document workload, stops (its host tier goes to disk), a new one
starts on the same disk folder and answers it again (warm), against a server on a fresh
folder (cold). Reported per run: TTFT p50/p99, prompt tokens computed, the share of
prompt tokens not computed, and blocks served per tier (from /metrics). Name the CPU
with the figures; smoke-run with tiny counts only on a busy machine (its figures mean
nothing then).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from appliance.bench.compare import Target, running

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16


@dataclass
class RunFigures:
    """One configuration on one workload."""

    label: str
    workload: str
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    prompt_tokens: int
    computed_tokens: int
    reused_share: float  # prompt tokens not computed, of all
    hits_host: int
    hits_disk: int


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 40000) for _ in range(n)]


def chat_prompts(conversations: int, turns: int, system: int, message: int) -> Iterator[list[int]]:
    """Each chat's turns, interleaved: turn t of every chat, then turn t+1."""
    rng = random.Random(1)
    prefix = words(rng, system)
    histories = [list(prefix) for _ in range(conversations)]
    for _ in range(turns):
        for history in histories:
            history += words(rng, message)  # the user's message
            yield list(history)
            history += words(rng, message)  # the answer, as the client re-sends it


def document_prompts(documents: int, questions: int, doc_tokens: int) -> Iterator[list[int]]:
    """Every document asked each question in turn: question q of every document, then q+1."""
    rng = random.Random(2)
    docs = [words(rng, doc_tokens) for _ in range(documents)]
    asks = [words(rng, 24) for _ in range(questions)]
    for ask in asks:
        for doc in docs:
            yield doc + ask


def ttft_ms(client: httpx.Client, url: str, prompt: list[int]) -> tuple[float, int, int]:
    """One streamed completion: its TTFT in ms, prompt tokens and cached tokens."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    usage: dict = {}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: {reply.status_code} {reply.read().decode()}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    assert first is not None, "no token came back"
    details = usage.get("prompt_tokens_details") or {}
    return (first - start) * 1000, usage["prompt_tokens"], details.get("cached_tokens", 0)


def store_hits(url: str) -> dict[str, int]:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.findall(r'^appliance_kv_store_hits_total\{tier="(\w+)"\} (\S+)$', text, re.M)
    return {tier: int(float(value)) for tier, value in found}


def drive(label: str, workload: str, url: str, prompts: list[list[int]]) -> RunFigures:
    before = store_hits(url)
    times, prompt_tokens, cached = [], 0, 0
    with httpx.Client() as client:
        for prompt in prompts:
            ms, tokens, hit = ttft_ms(client, url, prompt)
            times.append(ms)
            prompt_tokens += tokens
            cached += hit
    after = store_hits(url)
    times.sort()
    return RunFigures(
        label,
        workload,
        len(prompts),
        statistics.median(times),
        times[min(len(times) - 1, round(0.99 * (len(times) - 1)))],
        prompt_tokens,
        prompt_tokens - cached,
        cached / prompt_tokens if prompt_tokens else 0.0,
        after.get("host", 0) - before.get("host", 0),
        after.get("disk", 0) - before.get("disk", 0),
    )


def target(label: str, pool_mb: int, store: str, shm: Path, disk: Path | None) -> Target:
    env = {
        "APPLIANCE_KV__MEMORY_MB": str(pool_mb),
        "APPLIANCE_KV_STORE__ENABLED": "false" if store == "off" else "true",
        "APPLIANCE_KV_STORE__SHM_DIR": str(shm),
        "APPLIANCE_KV_STORE__HOST_MEMORY_MB": str(8 * pool_mb),
    }
    if disk is not None:
        env["APPLIANCE_KV_STORE__DISK_PATH"] = str(disk)
    command = [sys.executable, "-m", "appliance.cli", "serve"]
    return Target(label, command, env, port_flag=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--message-tokens", type=int, default=64)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=1024)
    # 16 MiB holds 352 tokens of context here: a chat of 6 turns would not fit.
    parser.add_argument("--pool-mb", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()

    chats = list(
        chat_prompts(args.conversations, args.turns, args.system_tokens, args.message_tokens)
    )
    docs = list(document_prompts(args.documents, args.questions, args.doc_tokens))
    work = Path(tempfile.mkdtemp(prefix="kv-store-bench-"))
    shm = Path("/dev/shm") / f"kv-store-bench-{uuid.uuid4().hex}"
    shm.mkdir()
    logs = work / "logs"
    rows: list[RunFigures] = []
    try:
        configs = [("store off", "off", None), ("host", "host", None)]
        configs.append(("host+disk", "disk", work / "disk"))
        for label, store, disk in configs:
            with running(target(label, args.pool_mb, store, shm, disk), logs) as url:
                rows.append(drive(label, "multi-turn chat", url, chats))
                rows.append(drive(label, "shared documents", url, docs))
        # Restart: the host+disk server above stopped, its host tier flushed to disk.
        warm = target("warm restart", args.pool_mb, "disk", shm, work / "disk")
        with running(warm, logs) as url:
            rows.append(drive("warm restart", "shared documents", url, docs))
        cold = target("cold restart", args.pool_mb, "disk", shm, work / "cold-disk")
        with running(cold, logs) as url:
            rows.append(drive("cold restart", "shared documents", url, docs))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work / "disk", ignore_errors=True)
        shutil.rmtree(work / "cold-disk", ignore_errors=True)
    table = render(rows, args)
    print(table)
    if args.out is not None:
        args.out.write_text(table)


def cpu_name() -> str:
    """The CPU's model name (the figures mean nothing without it)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M)
        if found:
            return found.group(1).strip()
    return platform.processor() or platform.machine()


def render(rows: list[RunFigures], args: argparse.Namespace) -> str:
    lines = [
        f"KV store bench on {cpu_name()}, {os.cpu_count()} cores "
        f"(pool {args.pool_mb} MiB a worker; default layout)",
        "",
        "| run | workload | requests | TTFT p50 ms | TTFT p99 ms | prompt tokens | computed "
        "| reused | host hits | disk hits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.workload} | {r.requests} | {r.ttft_p50_ms:.0f} | "
            f"{r.ttft_p99_ms:.0f} | {r.prompt_tokens} | {r.computed_tokens} | "
            f"{r.reused_share:.0%} | {r.hits_host} | {r.hits_disk} |"
        )
    lines += ["", "```json", json.dumps([asdict(r) for r in rows], indent=1), "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
