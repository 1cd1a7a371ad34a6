"""What constrained decoding costs a decode step: TPOT p50 with a json_schema against
without, at batch 1 and 16, on this CPU, in one engine (the default model and settings,
as a colocated worker runs it).

Both sides decode the same number of tokens: free text with ignore_eos, and a schema
(an array of at least 64 records) that cannot finish within max_tokens. The runs
alternate (free, json, json without the mask thread, ...) so the box's noise falls on
all. Each request's TPOT is (last token time - first token time) / (tokens - 1); the
table gives the p50 over requests and rounds. Alongside: the mask work per step (filling
the bitmasks, on the thread or inline) and the time the sampler waits for it.

    .venv/bin/python benchmarks/structured_tpot.py [--rounds 3] [--max-tokens 96]

llama-server with the same schema is left out unless a llama.cpp build is at
.bench/llama.cpp/bin (benchmarks/build_llama_cpp.sh; about 12 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams, StructuredOutput
from appliance.engine.structured.masks import GrammarMasks
from appliance.settings.config import load_settings

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "tags"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 64}
PROMPT = "List people as JSON records with name, age, email and tags."


@dataclass
class Timed:
    """Mask work seen during a run: seconds per call of each part."""

    compute: list[float] = field(default_factory=list)  # filling the step's bitmasks
    wait: list[float] = field(default_factory=list)  # the sampler's apply, waiting included


def timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    return wrapper


def run(
    engine: LLMEngine, batch: int, params: SamplingParams, prompt: list[int]
) -> tuple[list[float], int]:
    """Per-request TPOT (s) of one batch decoded to max_tokens; and how many were cut by
    length (all of them, or the comparison is off)."""
    ids = [engine.add_request(list(prompt), params) for _ in range(batch)]
    times: dict[int, list[float]] = {i: [] for i in ids}
    reasons: dict[int, str | None] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.seq_id] += [now] * len(out.token_ids)
            if out.finished:
                reasons[out.seq_id] = out.finish_reason
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return tpots, sum(r == "length" for r in reasons.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batches", default="1,16")
    args = parser.parse_args()
    engine = LLMEngine.from_settings(load_settings(device="cpu"))
    masks: GrammarMasks = engine.grammar
    timing = Timed()
    masks.banned = timed(masks.banned, timing.compute)  # type: ignore[method-assign]
    masks.apply = timed(masks.apply, timing.wait)  # type: ignore[method-assign]
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    free = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, structured=spec)
    sides = {
        "free text": (free, True),
        "json_schema": (constrained, True),
        "json_schema, masks inline": (constrained, False),
    }
    run(engine, 1, constrained, prompt)  # warm: the grammar vocabulary, compiled paths
    threads = os.environ.get("OMP_NUM_THREADS", "torch default")
    print(f"# {args.rounds} rounds, max_tokens {args.max_tokens}, temperature 1, threads {threads}")
    print()
    print("| batch | side | TPOT p50 | vs free | mask fill / step | sampler apply / step | cut |")
    print("|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        tpots: dict[str, list[float]] = {name: [] for name in sides}
        fills: dict[str, list[float]] = {name: [] for name in sides}
        applies: dict[str, list[float]] = {name: [] for name in sides}
        cut: dict[str, int] = dict.fromkeys(sides, 0)
        for _ in range(args.rounds):
            for name, (params, background) in sides.items():
                masks.background = background
                timing.compute.clear()
                timing.wait.clear()
                values, lengths = run(engine, batch, params, prompt)
                tpots[name] += values
                cut[name] += lengths
                fills[name] += timing.compute
                applies[name] += timing.wait
        base = statistics.median(tpots["free text"])
        for name in sides:
            p50 = statistics.median(tpots[name])
            fill = statistics.median(fills[name]) * 1e3 if fills[name] else 0.0
            apply = statistics.median(applies[name]) * 1e3 if applies[name] else 0.0
            print(
                f"| {batch} | {name} | {p50 * 1e3:.1f} ms | {p50 / base - 1:+.1%} "
                f"| {fill:.2f} ms | {apply:.2f} ms | {cut[name]}/{batch * args.rounds} |",
                flush=True,
            )
    masks.close()


if __name__ == "__main__":
    main()
