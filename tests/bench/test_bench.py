"""`appliance bench`: exact-length prompts, and the load generator and the comparison run
for real against appliance servers."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_process import API_KEY, ServerProcess

from appliance import cli
from appliance.bench import cli as bench_cli
from appliance.bench import runner
from appliance.bench.client import send
from appliance.bench.compare import BASELINE, Target, compare
from appliance.bench.runner import Load, poisson_gaps, run_load
from appliance.bench.shift import (
    DEFAULT_PHASES,
    Phase,
    ScheduledRequest,
    Shift,
    make_shift,
    parse_phases,
    phase_starts,
    shift_schedule,
    shift_warmup,
)
from appliance.bench.workloads import PromptMaker, RequestSpec, generate, load_jsonl
from appliance.core.goodput import SLO, RequestResult
from appliance.engine.llm_engine import LLMEngine

BENCH = [sys.executable, "-m", "appliance.cli", "bench"]
# What a streaming server's reply says it is (the bench reads no other).
SSE = {"content-type": "text/event-stream"}


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
    """The command's main in this process (the run above is the one as a process)."""
    args = ["--url", server.url, "--api-key", "wrong", "--workload", "fixed", "--model", "x"]
    args += ["--num-requests", "3", "--warmup", "0", "--out", str(tmp_path)]
    assert cli.main(["bench", *args]) == 1  # failures are reported, never dropped
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["summary"]["failed"] == 3
    assert all("HTTP 401" in r["error"] for r in saved["results"])


@pytest.mark.process
@pytest.mark.extended  # every layout in turn: the extended lane (one layout's run is in the suite)
def test_compare_runs_every_layout_on_the_same_requests(tmp_path: Path) -> None:
    """Our three layouts for real, at one rate (each layout is a server start, the slow
    part); sweeping several rates, a fresh start each, is the next test's, on stand-ins."""
    args = ["compare", "--configs", "ours", "--workload", "fixed", "--input-len", "16"]
    args += ["--output-len", "6", "--num-requests", "3", "--warmup", "0"]
    args += ["--rates", "inf", "--out", str(tmp_path)]
    result = subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "compare.json").read_text())
    labels = [run["label"] for run in saved["runs"]]
    assert labels == ["disaggregated 1P+1D", "colocated x2", "colocated x1 (all cores)"]
    assert all(run["summary"]["completed"] == 3 for run in saved["runs"])
    prompts = {tuple(r["prompt_tokens"] for r in run["results"]) for run in saved["runs"]}
    assert prompts == {(16, 16, 16)}
    assert "goodput / colocated x2" in (tmp_path / "compare.md").read_text()
    assert (tmp_path / "latency_cdf.png").is_file()


@pytest.mark.process  # stand-in server processes
def test_compare_sweeps_each_rate_on_a_fresh_start_of_each_configuration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`bench compare --rates 4,inf` as the command runs it, its configurations stand-in
    servers that start in a moment: one run per (configuration, rate), configuration by
    configuration, each run a fresh start; the sweep's table per rate and its plot."""
    fake = [sys.executable, "-c", FAKE_SERVER]
    stand_ins = [Target(name, fake, ready_path="/health") for name in ("split", BASELINE)]
    monkeypatch.setattr(bench_cli, "our_targets", lambda cores: stand_ins)
    args = ["bench", "compare", "--configs", "ours", "--workload", "fixed", "--input-len", "16"]
    args += ["--output-len", "6", "--num-requests", "3", "--warmup", "1"]
    args += ["--rates", "4,inf", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    saved = json.loads((tmp_path / "compare.json").read_text())
    runs = [(run["label"], run["rate"]) for run in saved["runs"]]
    # (an infinite rate is written as its text: JSON has no infinity)
    assert runs == [("split", 4.0), ("split", "inf"), (BASELINE, 4.0), (BASELINE, "inf")]
    assert all(run["summary"]["completed"] == 3 for run in saved["runs"])
    for name in ("split", BASELINE):  # the stand-in says when it starts: twice, once a rate
        log = tmp_path / "logs" / (re.sub(r"\W+", "_", name).strip("_") + ".log")
        # Its own lines: the traceback SIGINT may leave in the log quotes threading.py,
        # whose source says `_started` (a count of the substring found 3 in CI).
        assert log.read_text().splitlines().count("started") == 2
    tables = (tmp_path / "compare.md").read_text()
    assert tables.count("### fixed workload") == 2 and "4.0 req/s Poisson" in tables
    assert tables.count(f"goodput / {BASELINE}") == 2
    assert (tmp_path / "goodput_sweep.png").stat().st_size > 10_000


def replay(events: list[str], status: int = 200) -> httpx.AsyncClient:
    """A client whose server answers every request with these SSE lines."""
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    answer = lambda request: httpx.Response(status, headers=SSE, content=body)  # noqa: E731
    transport = httpx.MockTransport(answer)
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


def test_phases_are_parsed() -> None:
    phases = parse_phases(" chat:2.0:60 , long-burst:0.4:30,fixed:1:0.5")
    assert phases == [
        Phase("chat", 2.0, 60.0),
        Phase("long-burst", 0.4, 30.0),
        Phase("fixed", 1.0, 0.5),
    ]
    assert [p.label(i) for i, p in enumerate(phases)] == [
        "1 chat @2.0/s",
        "2 long-burst @0.4/s",
        "3 fixed @1.0/s",
    ]
    assert phase_starts(phases) == [0.0, 60.0, 90.0]
    assert [p.workload for p in parse_phases(DEFAULT_PHASES)] == ["chat", "long-burst", "chat"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "no phases given; expected workload:rate:seconds"),
        ("chat:2", "phase 1 'chat:2': expected workload:rate:seconds, e.g. chat:2.0:60"),
        ("chat:2:60,", "phase 2 '': expected workload:rate:seconds"),
        ("chat:2:60:1", "phase 1 'chat:2:60:1': expected workload:rate:seconds"),
        (
            "chat:2:60,jsonl:1:5",
            "phase 2 'jsonl:1:5': unknown workload 'jsonl'; "
            "choose chat, long-burst, fixed, shared-prefix",
        ),
        ("chat:0:60", "phase 1 'chat:0:60': rate must be requests/s > 0, got '0'"),
        ("chat:fast:60", "rate must be requests/s > 0, got 'fast'"),
        ("chat:inf:60", "rate must be requests/s > 0, got 'inf'"),
        ("chat:2:-1", "phase 1 'chat:2:-1': seconds must be > 0, got '-1'"),
        ("chat:2:nan", "seconds must be > 0, got 'nan'"),
    ],
)
def test_bad_phases_say_which_part_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_phases(spec)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_command_line_checks_shift_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["bench", "--workload", "shift", "--phases", "chat:2"])
    assert exited.value.code == 2
    assert "argument --phases: phase 1 'chat:2': expected" in capsys.readouterr().err
    refused = {
        "--num-requests": ["--num-requests", "5"],
        "--duration": ["--duration", "5"],
        "--concurrency": ["--concurrency", "2"],
        "--request-rate": ["--request-rate", "2"],
        "--rates": ["compare", "--rates", "1,2"],
    }
    for flag, extra in refused.items():
        assert cli.main(["bench", "--workload", "shift", *extra]) == 2
        assert f"from --phases; drop {flag}" in capsys.readouterr().err
    assert cli.main(["bench", "--workload", "chat", "--phases", "chat:1:1"]) == 2
    assert "--phases goes with --workload shift only" in capsys.readouterr().err


def test_the_shift_schedule_follows_its_phases(engine: LLMEngine) -> None:
    phases = parse_phases("fixed:6:2,long-burst:4:2,chat:5:1")
    schedule = shift_schedule(phases, engine.tokenizer, seed=7, input_len=16, output_len=8)
    assert [item.arrival_s for item in schedule] == sorted(item.arrival_s for item in schedule)
    assert sorted({item.phase for item in schedule}) == [0, 1, 2]
    bounds = {0: (0.0, 2.0), 1: (2.0, 4.0), 2: (4.0, 5.0)}
    for item in schedule:
        low, high = bounds[item.phase]
        assert low <= item.arrival_s < high
    by_phase = {i: [item.spec for item in schedule if item.phase == i] for i in bounds}
    assert all((s.prompt_tokens, s.max_tokens) == (16, 8) for s in by_phase[0])
    assert all(s.prompt_tokens <= 128 or s.prompt_tokens >= 1800 for s in by_phase[1])
    assert all(48 <= s.max_tokens <= 96 or 16 <= s.max_tokens <= 32 for s in by_phase[1])
    assert all(32 <= s.max_tokens <= 256 for s in by_phase[2])
    again = shift_schedule(phases, engine.tokenizer, seed=7, input_len=16, output_len=8)
    assert again == schedule  # every server gets the very same requests at the same times
    other = shift_schedule(phases, engine.tokenizer, seed=8, input_len=16, output_len=8)
    assert [i.arrival_s for i in other] != [i.arrival_s for i in schedule]


def test_a_phase_draws_its_own_requests_whatever_the_others(engine: LLMEngine) -> None:
    first = shift_schedule(parse_phases("fixed:3:1,chat:4:2"), engine.tokenizer, seed=1)
    second = shift_schedule(parse_phases("fixed:9:1,chat:4:2"), engine.tokenizer, seed=1)
    assert [i for i in first if i.phase == 1] == [i for i in second if i.phase == 1]
    warmup = shift_warmup(parse_phases("fixed:3:1,chat:4:2"), engine.tokenizer, 1, 3, 16, 8)
    assert [(s.prompt_tokens, s.max_tokens) for s in warmup] == [(16, 8)] * 3
    assert not {s.prompt for s in warmup} & {i.spec.prompt for i in first}


def test_shift_arrivals_are_poisson_at_each_phase_rate(engine: LLMEngine) -> None:
    phases = parse_phases("fixed:20:10,fixed:2:10")
    schedule = shift_schedule(phases, engine.tokenizer, seed=0, input_len=4, output_len=4)
    assert 160 <= sum(item.phase == 0 for item in schedule) <= 240
    assert 8 <= sum(item.phase == 1 for item in schedule) <= 35


def test_a_shift_sends_each_request_at_its_time_and_records_its_phase(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[float] = []
    done = "".join(f"data: {e}\n\n" for e in (json.dumps({"choices": [{"text": " a"}]}), "[DONE]"))

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(time.perf_counter())
        return httpx.Response(200, headers=SSE, content=done.encode())

    mock = functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(answer))
    monkeypatch.setattr(runner.httpx, "AsyncClient", mock)
    spec = RequestSpec("hi", 1, 1)
    arrivals = [(0.0, 0), (0.15, 0), (0.3, 1)]
    shift = Shift(
        (Phase("fixed", 10.0, 0.2), Phase("fixed", 10.0, 0.2)),
        tuple(ScheduledRequest(spec, due, phase) for due, phase in reversed(arrivals)),
        warmup=1,
    )
    results, seconds = asyncio.run(
        run_load("http://peer", iter([spec]), shift, lambda text: 1, model="m")
    )
    assert len(sent) == 4  # the warm-up, then the schedule
    assert [r.phase for r in results] == [0, 0, 1]
    assert all(r.ok for r in results)
    for result, (due, _) in zip(results, arrivals, strict=True):
        assert due - 0.02 <= result.start <= due + 0.1
    assert seconds >= 0.3


def test_bench_shift_against_a_running_server(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's main in this process, against the shared server."""
    args = ["--url", server.url, "--api-key", API_KEY, "--workload", "shift"]
    args += ["--phases", "fixed:4:1,fixed:4:1", "--input-len", "16", "--output-len", "4"]
    args += ["--warmup", "1", "--goodput", "ttft:60000", "--out", str(tmp_path)]
    args += ["--extra-body", '{"ignore_eos": true}']
    code, printed = cli.main(["bench", *args]), capsys.readouterr()
    assert code == 0, printed.err
    assert "| phase |" in printed.out and "| 2 fixed @4.0/s |" in printed.out
    saved = json.loads((tmp_path / "result.json").read_text())
    assert [p["label"] for p in saved["phases"]] == ["1 fixed @4.0/s", "2 fixed @4.0/s"]
    assert {r["phase"] for r in saved["results"]} <= {0, 1}
    counts = [sum(r["phase"] == i for r in saved["results"]) for i in (0, 1)]
    assert [p["requests"] for p in saved["phases"]] == counts
    assert saved["phases_total"]["requests"] == len(saved["results"]) == sum(counts)
    assert saved["phases_total"]["goodput"] == pytest.approx(len(saved["results"]) / 2)


def test_options_before_compare_are_kept() -> None:
    argv = ["bench", "--workload", "shift", "--phases", "fixed:1:1", "--seed", "3", "compare"]
    args = cli.build_parser().parse_args([*argv, "--warmup", "0"])
    assert (args.workload, args.phases, args.seed, args.warmup) == (
        "shift",
        [Phase("fixed", 1.0, 1.0)],
        3,
        0,
    )
    assert (args.rates, args.llama_cpp_python, args.configs) == (None, None, "ours,peers")


# A stand-in OpenAI server: every completion is one chunk of text, at once.
FAKE_SERVER = """
import http.server, signal, sys
# A job started in the background by a non-interactive shell (CI's) inherits SIGINT
# ignored, and Python then keeps it so: compare stops a server with SIGINT, and would wait
# its 30 s for this one to go.
signal.signal(signal.SIGINT, signal.default_int_handler)
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args): pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"data": [{"id": "m"}]}')
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'data: {"choices": [{"text": " a"}]}\\n\\ndata: [DONE]\\n\\n'
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Handler)
print("started", flush=True)
server.serve_forever()
"""


def test_compare_drives_every_configuration_through_the_same_shift(
    engine: LLMEngine, tmp_path: Path
) -> None:
    phases = parse_phases("fixed:8:0.5,fixed:8:0.5")
    shift, warmup = make_shift(phases, engine.tokenizer, seed=2, warmup=1, input_len=4)
    fake = [sys.executable, "-c", FAKE_SERVER]
    targets = [Target(name, fake, ready_path="/health", extra_body={}) for name in ("a", "b")]
    runs = compare(targets, warmup, [shift], SLO(), lambda text: 1, tmp_path)
    assert [run.label for run in runs] == ["a", "b"]
    for run in runs:
        assert run.rate is None and run.phases is not None and run.phases_total is not None
        assert [r.phase for r in run.results] == [item.phase for item in shift.schedule]
        assert [p.requests for p in run.phases] == [
            sum(item.phase == i for item in shift.schedule) for i in (0, 1)
        ]
        assert run.phases_total.goodput == len(shift.schedule) / 1.0
