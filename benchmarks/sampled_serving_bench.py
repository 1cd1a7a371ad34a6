"""Sampled requests served at two commits, same machine, same run: `--streams` chat
completions at once with temperature and top_p (what applications send by default),
each `--max-tokens` long (ignore_eos), through the official `openai` client; output
tokens per second and time per output token (p50), by commit, alternating.

    .venv/bin/python benchmarks/sampled_serving_bench.py --before f4cbb7e [--after HEAD]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time
from pathlib import Path

from openai import AsyncOpenAI
from tree_server import start_server
from worktrees import alternate

from appliance.model.model_source import default_model_path, model_name
from appliance.topology.cpu import cpu_model_name


async def one_stream(client: AsyncOpenAI, args: argparse.Namespace, n: int) -> list[float]:
    """The arrival times of one streamed answer's chunks."""
    stream = await client.chat.completions.create(
        model=model_name(default_model_path()),
        messages=[{"role": "user", "content": f"Tell me a story about the number {n}."}],
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    times = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.monotonic())
    return times


async def load(url: str, args: argparse.Namespace) -> tuple[float, float]:
    """Output tokens per second over the whole load, and the median time per output token."""
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    began = time.monotonic()
    answers = await asyncio.gather(*(one_stream(client, args, n) for n in range(args.streams)))
    took = time.monotonic() - began
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in answers if len(t) > 1]
    return sum(len(t) for t in answers) / took, statistics.median(tpots)


def serve_and_load(tree: Path, args: argparse.Namespace) -> tuple[float, float]:
    process, url = start_server(tree, {})
    try:
        asyncio.run(load(url, args))  # a warm-up load, untimed
        return asyncio.run(load(url, args))
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.9)
    args = parser.parse_args()
    revs = [args.before, args.after]
    runs = alternate(revs, args.rounds, lambda tree: serve_and_load(tree, args))
    print(f"{cpu_model_name()}, {os.cpu_count()} cores; `appliance serve` (its default layout);")
    print(
        f"{args.streams} streams at once, {args.max_tokens} tokens each, temperature "
        f"{args.temperature}, top_p {args.top_p}; best of {args.rounds} alternating rounds\n"
    )
    print("| commit | output tok/s | TPOT p50 ms |")
    print("|---|---:|---:|")
    for rev, results in runs.items():
        best_rate = max(rate for rate, _ in results)
        best_tpot = min(tpot for _, tpot in results)
        print(f"| {rev} | {best_rate:.1f} | {best_tpot * 1000:.1f} |")


if __name__ == "__main__":
    main()
