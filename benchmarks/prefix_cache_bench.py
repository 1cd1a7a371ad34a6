"""Prefix caching: TTFT of requests that share a 1k-token system prompt, with the cache
on and off, in one run on the same cores.

    .venv/bin/python benchmarks/prefix_cache_bench.py [--requests 12]

Each pool layout (disaggregated 1P+1D, colocated on all cores) is started twice, with
APPLIANCE_KV__PREFIX_CACHING=true and =false, and sent the same `shared-prefix` requests
one at a time (closed loop, concurrency 1), so TTFT is prefill time, not queueing. The
table: TTFT of the first request (nothing cached yet), the median TTFT of the rest, and
how many times lower the rest are with the cache than without. Written to --out too.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
from pathlib import Path

from appliance.bench.client import CountTokens
from appliance.bench.compare import Target, our_targets, running
from appliance.bench.runner import Load, run_load
from appliance.bench.workloads import generate
from appliance.model.model_source import prepare_tokenizer
from appliance.settings.config import load_settings

OUT = Path(__file__).resolve().parent / "results" / "prefix_cache_cpu.md"


def ttfts(target: Target, specs: list, count_tokens: CountTokens, logs: Path) -> list[float]:
    """Each request's TTFT in ms, in the order sent."""
    load = Load(concurrency=1, num_requests=len(specs), warmup=0)
    with running(target, logs) as url:
        results, _ = asyncio.run(
            run_load(url, iter(specs), load, count_tokens, extra_body=target.extra_body)
        )
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{target.label}: {len(failed)} requests failed: {failed[0]}")
    return [r.ttft * 1000 for r in sorted(results, key=lambda r: r.start)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    settings = load_settings()
    _, tokenizer = prepare_tokenizer(settings.model, settings.cache_dir)
    specs = list(itertools.islice(generate("shared-prefix", tokenizer, seed=0), args.requests))

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text))

    logs = Path("/tmp/prefix-cache-bench-logs")
    cores = len(os.sched_getaffinity(0))
    rows = []
    for base in our_targets(cores)[::2]:  # disaggregated 1P+1D, colocated on all cores
        measured = {}
        for caching in ("true", "false"):
            env = base.env | {"APPLIANCE_KV__PREFIX_CACHING": caching}
            target = Target(
                base.label, base.command, env, extra_body=base.extra_body, port_flag=None
            )
            measured[caching] = ttfts(target, specs, count_tokens, logs)
            print(f"  {base.label}, cache {caching}: done", file=sys.stderr)
        on, off = measured["true"], measured["false"]
        rest_on, rest_off = statistics.median(on[1:]), statistics.median(off[1:])
        rows.append(
            f"| {base.label} | {on[0]:.0f} | {rest_on:.0f} | {off[0]:.0f} | {rest_off:.0f} "
            f"| {rest_off / rest_on:.1f}x |"
        )
    table = "\n".join(
        [
            f"Shared 1024-token system prompt + 32-64 token question, {args.requests} requests "
            "one at a time, TTFT in ms.",
            "",
            "| layout | cache on: first | cache on: rest (median) | cache off: first "
            "| cache off: rest (median) | rest, off / on |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
