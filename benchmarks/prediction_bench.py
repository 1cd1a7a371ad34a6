"""OpenAI's predicted outputs at batch 1: code edits (a function of this repository,
returned renamed) through the official `openai` client, streamed, greedy, one request
at a time, on one `appliance serve` with n-gram speculation opt-in. Each request four
ways, alternating round by round:

  plain       no speculation (the opt-in server's default)
  lookup      speculative.n_max 4: prompt lookup (the function is in the prompt)
  prediction  prediction = the function as it stands (OpenAI's documented use)
  wrong       prediction = another function of the same size (what a bad one costs)

Decode tok/s is a request's tokens after its first over the time they took, summed over
requests (prefill excluded); the table shows each way's best round, the acceptance from
the server's /metrics over that way's requests, and usage's accepted / rejected
prediction tokens. Every way must give the same answers (they are checked).

    .venv/bin/python benchmarks/prediction_bench.py [--functions 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from tree_server import start_server

from appliance.bench.workloads import Passage, code_passages, grounded_prompt
from appliance.model.model_source import default_model_path, model_name
from appliance.topology.cpu import cpu_model_name

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("plain", "lookup", "prediction", "wrong")
SERVER_ENV = {
    "APPLIANCE_MODE": "colocated",
    "APPLIANCE_CPU_DEVICES": "1",  # one worker over every core: a single stream's speed
    "APPLIANCE_SPECULATIVE__METHOD": "ngram",
    "APPLIANCE_SPECULATIVE__OPT_IN": "true",
}
DRAFTED, KEPT = (
    "appliance_spec_decode_num_draft_tokens_total",
    ("appliance_spec_decode_num_accepted_tokens_total"),
)


@dataclass
class Round:
    """One way's figures over one round of requests."""

    tokens: int = 0  # after each request's first
    seconds: float = 0.0  # from each request's first token to its last
    drafted: float = 0.0
    kept: float = 0.0
    accepted_prediction: int = 0
    rejected_prediction: int = 0
    answers: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def spec_counts(url: str) -> tuple[float, float]:
    """The server's drafted and kept totals."""
    totals = {DRAFTED: 0.0, KEPT: 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals[DRAFTED], totals[KEPT]


def extra_of(way: str, passage: Passage, other: Passage) -> dict[str, Any]:
    """The request fields of one way."""
    if way == "lookup":
        return {"extra_body": {"speculative.n_max": 4}}
    if way in ("prediction", "wrong"):
        text = passage.text if way == "prediction" else other.text
        return {"prediction": {"type": "content", "content": text}}
    return {}


def ask(client: OpenAI, passage: Passage, fields: dict[str, Any], into: Round) -> None:
    """One streamed request, timed from its first token to its last."""
    message = grounded_prompt("code-edit", passage)
    stream = client.chat.completions.create(
        model=model_name(default_model_path()),
        messages=[{"role": "user", "content": message}],
        max_tokens=len(passage.text) // 2 + 64,  # more than a renamed copy needs
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **fields,
    )
    first = last = 0.0
    text, usage = "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.monotonic()
            first = first or last
            text += chunk.choices[0].delta.content
    assert usage is not None
    into.tokens += usage.completion_tokens - 1
    into.seconds += last - first
    into.answers.append(text)
    details = usage.completion_tokens_details
    if details is not None:
        into.accepted_prediction += details.accepted_prediction_tokens or 0
        into.rejected_prediction += details.rejected_prediction_tokens or 0


def run_way(url: str, way: str, pairs: list[tuple[Passage, Passage]]) -> Round:
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    result = Round()
    drafted, kept = spec_counts(url)
    for passage, other in pairs:
        ask(client, passage, extra_of(way, passage, other), result)
    now_drafted, now_kept = spec_counts(url)
    result.drafted, result.kept = now_drafted - drafted, now_kept - kept
    return result


def chosen(count: int, seed: int) -> list[tuple[Passage, Passage]]:
    """`count` functions of 10 to 30 lines, each with another of about its size."""
    functions = [p for p in code_passages(ROOT) if 10 <= p.text.count("\n") + 1 <= 30]
    rng = random.Random(seed)
    picked = rng.sample(functions, count)
    pairs = []
    for passage in picked:
        size = len(passage.text)
        others = sorted(
            (f for f in functions if f is not passage), key=lambda f: abs(len(f.text) - size)
        )
        pairs.append((passage, others[0]))
    return pairs


def table(rounds: dict[str, list[Round]]) -> str:
    plain = max(r.tok_s for r in rounds["plain"])
    lines = [
        "| way | decode tok/s (best) | vs plain | acceptance "
        "| accepted / rejected prediction tokens |",
        "|---|---:|---:|---:|---:|",
    ]
    for way, results in rounds.items():
        best = max(results, key=lambda r: r.tok_s)
        rate = f"{best.kept / best.drafted:.0%}" if best.drafted else "-"
        told = (
            f"{best.accepted_prediction} / {best.rejected_prediction}"
            if way in ("prediction", "wrong")
            else "-"
        )
        lines.append(f"| {way} | {best.tok_s:.1f} | {best.tok_s / plain:.2f}x | {rate} | {told} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--functions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pairs = chosen(args.functions, args.seed)
    process, url = start_server(ROOT, SERVER_ENV)
    try:
        run_way(url, "plain", pairs[:1])  # a warm-up request, untimed
        rounds: dict[str, list[Round]] = {way: [] for way in WAYS}
        for _ in range(args.rounds):
            for way in WAYS:
                rounds[way].append(run_way(url, way, pairs))
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(120)
    answers = {tuple(r.answers) for results in rounds.values() for r in results}
    print(
        f"{cpu_model_name()}, {os.cpu_count()} cores; `appliance serve` colocated, one worker "
        "over every core, n-gram speculation opt-in;"
    )
    print(
        f"{args.functions} code edits (seed {args.seed}), batch 1, greedy; best of "
        f"{args.rounds} alternating rounds;"
    )
    print(f"every way gave the same answers: {'yes' if len(answers) == 1 else 'NO'}\n")
    print(table(rounds))


if __name__ == "__main__":
    main()
