"""`appliance bench`: exact-length prompts, and the load generator and the comparison run
for real against appliance servers."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_process import API_KEY, ServerProcess

from appliance.bench.client import send
from appliance.bench.metrics import RequestResult
from appliance.bench.runner import Load, poisson_gaps
from appliance.bench.workloads import PromptMaker, RequestSpec, generate, load_jsonl
from appliance.engine.llm_engine import LLMEngine

BENCH = [sys.executable, "-m", "appliance.cli", "bench"]


def test_prompts_have_exact_token_counts(engine: LLMEngine) -> None:
    maker = PromptMaker(engine.tokenizer)
    rng = random.Random(0)
    for n in (1, 7, 128, 1999):
        assert len(engine.tokenizer.encode(maker.make(n, rng))) == n


def test_long_burst_is_mostly_short_with_one_in_ten_near_2k(engine: LLMEngine) -> None:
    specs = list(itertools.islice(generate("long-burst", engine.tokenizer, seed=1), 300))
    long = [s for s in specs if s.prompt_tokens >= 1800]
    assert 15 <= len(long) <= 45
    assert all(s.prompt_tokens <= 128 for s in specs if s not in long)
    for spec in specs[:20]:
        assert len(engine.tokenizer.encode(spec.prompt)) == spec.prompt_tokens
    again = list(itertools.islice(generate("long-burst", engine.tokenizer, seed=1), 300))
    assert again == specs  # the same seed gives every endpoint the same requests


def test_shared_prefix_requests_share_their_first_1k_tokens(engine: LLMEngine) -> None:
    specs = list(itertools.islice(generate("shared-prefix", engine.tokenizer, seed=3), 8))
    encoded = [engine.tokenizer.encode(s.prompt) for s in specs]
    assert [len(ids) for ids in encoded] == [s.prompt_tokens for s in specs]
    assert len({tuple(ids[:1024]) for ids in encoded}) == 1  # one system prompt
    assert len({tuple(ids[1024:]) for ids in encoded}) == 8  # each its own question
    assert all(1024 + 32 <= s.prompt_tokens <= 1024 + 64 for s in specs)


def test_jsonl_prompts_are_read_and_checked(engine: LLMEngine, tmp_path: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "Hello there", "max_tokens": 5}\n\n{"prompt": "Hi"}\n')
    specs = load_jsonl(good, engine.tokenizer, 7)
    assert [(s.prompt, s.max_tokens) for s in specs] == [("Hello there", 5), ("Hi", 7)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_jsonl(bad, engine.tokenizer, 7)


def test_poisson_gaps_average_one_over_the_rate() -> None:
    gaps = list(itertools.islice(poisson_gaps(4.0, random.Random(0)), 4000))
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)
    assert next(poisson_gaps(float("inf"), random.Random(0))) == 0.0


def test_load_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="a rate or a concurrency"):
        Load(rate=1.0, concurrency=2)
    with pytest.raises(ValueError, match="infinite rate"):
        Load(rate=float("inf"), num_requests=None, duration=5.0)
    with pytest.raises(ValueError, match="must be > 0"):
        Load(rate=0.0)


def test_bench_against_a_running_server(server: ServerProcess, tmp_path: Path) -> None:
    args = ["--url", server.url, "--api-key", API_KEY, "--workload", "fixed"]
    args += ["--input-len", "16", "--output-len", "8", "--num-requests", "4", "--warmup", "1"]
    args += ["--concurrency", "2", "--goodput", "ttft:60000", "--out", str(tmp_path)]
    args += ["--extra-body", '{"ignore_eos": true}']
    result = subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "| done |" in result.stdout
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["summary"]["completed"] == 4 and saved["summary"]["failed"] == 0
    assert all(r["output_tokens"] == 8 and r["prompt_tokens"] == 16 for r in saved["results"])
    assert saved["summary"]["goodput"] > 0
    assert (tmp_path / "latency_cdf.png").stat().st_size > 10_000


def test_bench_counts_failed_requests(server: ServerProcess, tmp_path: Path) -> None:
    args = ["--url", server.url, "--api-key", "wrong", "--workload", "fixed", "--model", "x"]
    args += ["--num-requests", "3", "--warmup", "0", "--out", str(tmp_path)]
    result = subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1  # failures are reported, never dropped
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["summary"]["failed"] == 3
    assert all("HTTP 401" in r["error"] for r in saved["results"])


def test_compare_runs_every_layout_on_the_same_requests(tmp_path: Path) -> None:
    args = ["compare", "--configs", "ours", "--workload", "fixed", "--input-len", "16"]
    args += ["--output-len", "6", "--num-requests", "3", "--warmup", "0"]
    args += ["--rates", "4,inf", "--out", str(tmp_path)]
    result = subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "compare.json").read_text())
    labels = [run["label"] for run in saved["runs"]]
    assert labels == [
        "disaggregated 1P+1D",
        "disaggregated 1P+1D",
        "colocated x2",
        "colocated x2",
        "colocated x1 (all cores)",
        "colocated x1 (all cores)",
    ]
    assert all(run["summary"]["completed"] == 3 for run in saved["runs"])
    assert "goodput / colocated x2" in (tmp_path / "compare.md").read_text()
    assert (tmp_path / "goodput_sweep.png").is_file()


def replay(events: list[str], status: int = 200) -> httpx.AsyncClient:
    """A client whose server answers every request with these SSE lines."""
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    return httpx.AsyncClient(transport=transport, base_url="http://peer")


def send_to(client: httpx.AsyncClient) -> RequestResult:
    spec = RequestSpec("hi", 1, 4)

    async def main() -> RequestResult:
        async with client:
            return await send(client, "m", spec, {}, 0.0, lambda text: len(text.split()))

    return asyncio.run(main())


def test_a_stream_without_usage_has_its_text_counted() -> None:
    chunks = [json.dumps({"choices": [{"text": t}]}) for t in (" a", " b", " c")]
    result = send_to(replay([*chunks, "[DONE]"]))
    assert result.ok and result.output_tokens == 3 and len(result.itl) == 2


def test_malformed_or_cut_streams_are_failures_not_crashes() -> None:
    cases = {
        "not json": ["{oops"],
        "error event": [json.dumps({"error": {"message": "busy"}})],
        "odd choices": [json.dumps({"choices": None}), json.dumps("text")],
        "no [DONE]": [json.dumps({"choices": [{"text": "x"}]})],
    }
    for name, events in cases.items():
        result = send_to(replay(events))
        assert not result.ok and result.error, name
    assert "HTTP 503" in send_to(replay([], status=503)).error
