"""The box's KV store (issue 41): TTFT, prefill tokens computed and hits per tier with the
store off, host tier only, host + disk, on workloads whose working set is several times
the workers' KV pools; and a warm restart (disk tier kept) against a cold one.

    .venv/bin/python benchmarks/kv_store_bench.py [--conversations 8 --turns 6]
        [--documents 6 --questions 4] [--pool-mb 64] [--out FILE]

Workloads (token-id prompts, the same every run; one request at a time, so TTFT is the
prefill, not queueing):
- multi-turn chat: `conversations` chats of `turns` turns, interleaved round robin; each
  turn re-sends the whole history (a system prompt, every earlier turn and answer) plus a
  new user message, as a chat client does. The answer re-sent is the model's own
  (`--answers model`, default: each turn generates `message` tokens and its text, encoded
  again, joins the history, so the blocks the decode worker computed can be reused) or
  random tokens no worker ever computed (`--answers random`, the first tables' workload);
- shared documents: `documents` documents of `doc_tokens` tokens, each asked `questions`
  questions, the questions of all documents interleaved.
With the workers' pools pinned small (kv.memory_mb = --pool-mb), the working set is 3-5x
a pool: without the store a prefix is evicted before its next use.

Configurations: store off; host tier only; host + disk. Then the restart: the host+disk
server answers the document workload, stops (its host tier goes to disk), a new one
starts on the same disk folder and answers it again (warm), against a server on a fresh
folder (cold). Reported per run: TTFT p50/p99, prompt tokens computed, the share of
prompt tokens not computed and the cached tokens from partial blocks (a finished
request's last block, its rows up to its last fed token, copied into the next prompt's
own block: a cached length that is not a block multiple ends in one), blocks served per
tier, and the store's traffic: blocks
loaded into the pools and written into the store per request, and the bytes of a put that
crossed a worker's pipe (before reserved arena slots every put sent its whole block
there; now only a worker out of slots does) and the share of puts written in place
(from /metrics). Name the CPU
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
from collections.abc import Callable, Iterator
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
    partial_tokens: int  # of the cached ones, those from partial blocks (a block's tail)
    reused_share: float  # prompt tokens not computed, of all
    hits_host: int
    hits_disk: int
    loaded_per_request: float  # blocks workers copied from the store, per request
    written_per_request: float  # blocks put into the store's host tier, per request
    piped_bytes_per_put: float  # bytes a stored block sent through a worker's pipe
    in_place_share: float  # of the bytes stored, those written straight into the arena


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 40000) for _ in range(n)]


@dataclass
class Chats:
    """The multi-turn chat workload: each chat's history grows by a user message and the
    answer to it, turn by turn, the turns of all chats interleaved."""

    conversations: int
    turns: int
    system: int
    message: int
    answers: str  # "model": the model's own answer re-sent; "random": random tokens

    def prompts(self, answer: Callable[[list[int]], list[int]]) -> Iterator[list[int]]:
        """Turn t of every chat, then turn t+1; `answer(prompt)` answers each (its ids)."""
        rng = random.Random(1)
        prefix = words(rng, self.system)
        histories = [list(prefix) for _ in range(self.conversations)]
        for _ in range(self.turns):
            for history in histories:
                history += words(rng, self.message)  # the user's message
                yield list(history)
                reply = words(rng, self.message) if self.answers == "random" else None
                history += reply if reply is not None else answer(history)


def document_prompts(documents: int, questions: int, doc_tokens: int) -> Iterator[list[int]]:
    """Every document asked each question in turn: question q of every document, then q+1."""
    rng = random.Random(2)
    docs = [words(rng, doc_tokens) for _ in range(documents)]
    asks = [words(rng, 24) for _ in range(questions)]
    for ask in asks:
        for doc in docs:
            yield doc + ask


@dataclass
class Reply:
    """One streamed completion as the bench reads it."""

    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    text: str


def complete(client: httpx.Client, url: str, prompt: list[int], max_tokens: int = 4) -> Reply:
    """One streamed completion: its TTFT, prompt and cached tokens, and its text."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    usage: dict = {}
    text: list[str] = []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: {reply.status_code} {reply.read().decode()}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            text += [c.get("text", "") for c in chunk.get("choices") or []]
            usage = chunk.get("usage") or usage
    assert first is not None, "no token came back"
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", 0)
    return Reply((first - start) * 1000, usage["prompt_tokens"], cached, "".join(text))


def store_counters(url: str) -> dict[str, float]:
    """The store's counters by name and tier ('hits/host', 'written_bytes/host', ...)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = r'^appliance_kv_store_(hits|read_bytes|written_bytes)_total\{tier="(\w+)"\} (\S+)$'
    found = {f"{n}/{t}": float(v) for n, t, v in re.findall(pattern, text, re.M)}
    puts = r"^appliance_kv_store_(put_blocks|put_in_place_bytes|put_piped_bytes)_total (\S+)$"
    return found | {n: float(v) for n, v in re.findall(puts, text, re.M)}


Answer = Callable[[list[int]], list[int]]  # a prompt -> the ids of the model's answer
Workload = Callable[[Answer], Iterator[list[int]]]  # its prompts, given a way to answer


@dataclass
class Answering:
    """How the chat's answers are made: `tokens` generated, their text encoded again (as a
    chat client re-sends the text it was given)."""

    tokens: int
    encode: Callable[[str], list[int]]


def drive(
    label: str, workload: str, url: str, prompts: Workload, answering: Answering
) -> RunFigures:
    """Send `prompts(answer)` one at a time and time each; `answer(prompt)` (the chat's
    model answers) generates an answer, untimed, and returns its ids."""
    before = store_counters(url)
    replies: list[Reply] = []
    with httpx.Client() as client:

        def answer(prompt: list[int]) -> list[int]:
            text = complete(client, url, prompt, answering.tokens).text
            return answering.encode(text)

        for prompt in prompts(answer):
            replies.append(complete(client, url, prompt))
    after = store_counters(url)
    moved = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    times = sorted(r.ttft_ms for r in replies)
    prompt_tokens = sum(r.prompt_tokens for r in replies)
    cached = sum(r.cached_tokens for r in replies)
    # A cached length past a block boundary ends in a partial block (a finished request's
    # tail, copied in): the full blocks alone would leave those tokens to compute.
    partial = sum(r.cached_tokens % BLOCK for r in replies)
    hits = moved.get("hits/host", 0.0) + moved.get("hits/disk", 0.0)
    served = moved.get("read_bytes/host", 0.0) + moved.get("read_bytes/disk", 0.0)
    block = served / hits if hits else 0.0  # one block's bytes
    written = moved.get("written_bytes/host", 0.0) / block if block else 0.0
    puts = moved.get("put_blocks", 0.0)
    piped = moved.get("put_piped_bytes", 0.0)
    in_place = moved.get("put_in_place_bytes", 0.0)
    return RunFigures(
        label,
        workload,
        len(replies),
        statistics.median(times),
        times[min(len(times) - 1, round(0.99 * (len(times) - 1)))],
        prompt_tokens,
        prompt_tokens - cached,
        partial,
        cached / prompt_tokens if prompt_tokens else 0.0,
        int(moved.get("hits/host", 0)),
        int(moved.get("hits/disk", 0)),
        hits / len(replies),
        written / len(replies),
        piped / puts if puts else 0.0,
        in_place / (in_place + piped) if in_place + piped else 0.0,
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
    parser.add_argument(
        "--answers",
        choices=["model", "random"],
        default="model",
        help="the chat's answers: the model's own (re-sent as a client does) or random tokens",
    )
    parser.add_argument(
        "--only", choices=["chat", "documents"], help="run one workload (no restart runs)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()

    chats = Chats(
        args.conversations, args.turns, args.system_tokens, args.message_tokens, args.answers
    ).prompts
    doc_list = list(document_prompts(args.documents, args.questions, args.doc_tokens))

    def docs(_answer: Answer) -> Iterator[list[int]]:
        return iter(doc_list)

    answering = Answering(args.message_tokens, tokenizer_encode())
    work = Path(tempfile.mkdtemp(prefix="kv-store-bench-"))
    shm = Path("/dev/shm") / f"kv-store-bench-{uuid.uuid4().hex}"
    shm.mkdir()
    logs = work / "logs"
    rows: list[RunFigures] = []
    try:
        configs: list[tuple[str, str, Path | None]] = [
            ("store off", "off", None),
            ("host", "host", None),
        ]
        configs.append(("host+disk", "disk", work / "disk"))
        for label, store, disk in configs:
            with running(target(label, args.pool_mb, store, shm, disk), logs) as url:
                if args.only != "documents":
                    rows.append(drive(label, "multi-turn chat", url, chats, answering))
                if args.only != "chat":
                    rows.append(drive(label, "shared documents", url, docs, answering))
        if args.only != "chat":  # the restart runs answer the documents
            # The host+disk server above stopped, its host tier flushed to disk.
            warm = target("warm restart", args.pool_mb, "disk", shm, work / "disk")
            with running(warm, logs) as url:
                rows.append(drive("warm restart", "shared documents", url, docs, answering))
            cold = target("cold restart", args.pool_mb, "disk", shm, work / "cold-disk")
            with running(cold, logs) as url:
                rows.append(drive("cold restart", "shared documents", url, docs, answering))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work / "disk", ignore_errors=True)
        shutil.rmtree(work / "cold-disk", ignore_errors=True)
    table = render(rows, args)
    print(table)
    if args.out is not None:
        args.out.write_text(table)


def tokenizer_encode() -> Callable[[str], list[int]]:
    """The served model's tokenizer (the embedded one unless settings say otherwise)."""
    from appliance.bench.cli import _tokenizer

    return _tokenizer().encode


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
        f"(pool {args.pool_mb} MiB a worker; default layout; chat answers: {args.answers})",
        "",
        "| run | workload | requests | TTFT p50 ms | TTFT p99 ms | prompt tokens | computed "
        "| from partial blocks | reused | host hits | disk hits | loaded/request "
        "| written/request | piped KiB/put | in place |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.workload} | {r.requests} | {r.ttft_p50_ms:.0f} | "
            f"{r.ttft_p99_ms:.0f} | {r.prompt_tokens} | {r.computed_tokens} | "
            f"{r.partial_tokens} | {r.reused_share:.0%} | {r.hits_host} | {r.hits_disk} | "
            f"{r.loaded_per_request:.1f} | {r.written_per_request:.1f} | "
            f"{r.piped_bytes_per_put / 1024:.1f} | {r.in_place_share:.0%} |"
        )
    lines += ["", "```json", json.dumps([asdict(r) for r in rows], indent=1), "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
