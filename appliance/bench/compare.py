"""`appliance bench compare`: start each configuration on the same cores, run the same
requests against it, stop it; one after the other, in one command."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from appliance.bench.client import CountTokens
from appliance.bench.runner import Load, run_load
from appliance.bench.shift import Shift
from appliance.bench.workloads import RequestSpec
from appliance.core.goodput import (
    SLO,
    PhaseSummary,
    RequestResult,
    Summary,
    phase_summaries,
    shift_total,
    summarize,
)

START_TIMEOUT_S = 600.0
BASELINE = "colocated x2"


@dataclass
class Target:
    """A server to benchmark: how to start it, when it is ready, what its requests add."""

    label: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/health"
    extra_body: dict[str, Any] = field(default_factory=dict)
    port_flag: str | None = "--port"  # None: ours, told by APPLIANCE_PORT


@dataclass
class Run:
    """One target driven at one load (rate None: a closed loop or a shift, whose runs
    have their per-phase summaries and the whole run's)."""

    label: str
    rate: float | None
    results: list[RequestResult]
    summary: Summary
    phases: list[PhaseSummary] | None = None
    phases_total: PhaseSummary | None = None


DEFAULT = "default settings"


def our_targets(cores: int) -> list[Target]:
    """The appliance three ways on the same cores: split pools, two colocated workers,
    one colocated worker on every core."""
    if cores < 2:
        raise ValueError("compare needs at least 2 cores: one per pool")
    serve = [sys.executable, "-m", "appliance.cli", "serve"]
    same_tokens: dict[str, Any] = {"ignore_eos": True}  # same token counts
    two_devices = {"APPLIANCE_CPU_DEVICES": "2"}  # each half of the cores
    return [
        Target(
            "disaggregated 1P+1D",
            serve,
            two_devices
            | {
                "APPLIANCE_MODE": "disaggregated",
                "APPLIANCE_PREFILL_DEVICES": "0",
                "APPLIANCE_DECODE_DEVICES": "1",
            },
            extra_body=same_tokens,
            port_flag=None,
        ),
        Target(
            BASELINE,
            serve,
            two_devices | {"APPLIANCE_MODE": "colocated"},
            extra_body=same_tokens,
            port_flag=None,
        ),
        Target(
            "colocated x1 (all cores)",
            serve,
            {"APPLIANCE_MODE": "colocated", "APPLIANCE_CPU_DEVICES": "1"},
            extra_body=same_tokens,
            port_flag=None,
        ),
    ]


def default_target() -> Target:
    """The appliance as a fresh `appliance serve` runs: no layout setting, the planner's
    default layout (on a CPU box without a profile, every core colocated)."""
    serve = [sys.executable, "-m", "appliance.cli", "serve"]
    return Target(DEFAULT, serve, {}, extra_body={"ignore_eos": True}, port_flag=None)


def llama_cpp_targets(
    gguf: Path, cores: int, stop_ids: list[int], llama_cpp_python: str | None
) -> list[Target]:
    """llama-cpp-python's server, if this or the given Python has it."""
    targets = []
    python = llama_cpp_python or (sys.executable if importlib.util.find_spec("llama_cpp") else None)
    if python is not None:
        # llama-cpp-python has no ignore_eos; banning the end tokens does the same.
        ban = {"logit_bias": {str(i): -100.0 for i in stop_ids}}
        command = [python, "-m", "llama_cpp.server", "--model", str(gguf)]
        command += ["--n_threads", str(cores), "--n_threads_batch", str(cores)]
        command += ["--n_ctx", "4096", "--host", "127.0.0.1"]
        # By default it cuts the running stream short whenever a new request comes in.
        command += ["--interrupt_requests", "False"]
        targets.append(Target("llama-cpp-python", command, ready_path="/v1/models", extra_body=ban))
    return targets


def naive_target(gguf: Path, cores: int) -> Target:
    """transformers' generate, one request at a time."""
    naive = [sys.executable, "-m", "appliance.bench.naive_server", "--threads", str(cores)]
    naive += ["--model", str(gguf)]
    return Target(
        "transformers (naive)", naive, ready_path="/v1/models", extra_body={"ignore_eos": True}
    )


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(target: Target, log_dir: Path) -> Iterator[str]:
    """Start the target on a free port, wait until it answers, yield its URL, stop it."""
    port = free_port()
    command = list(target.command)
    # A key meant for the user's own server would make only ours answer 401.
    env = {k: v for k, v in os.environ.items() if k != "APPLIANCE_API_KEY"} | target.env
    if target.port_flag is None:
        env["APPLIANCE_PORT"] = str(port)
    else:
        command += [target.port_flag, str(port)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / (re.sub(r"\W+", "_", target.label).strip("_") + ".log")
    with log_path.open("a") as log:
        # Its own process group: stopping it stops its worker processes too.
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(process, url + target.ready_path, log_path)
            yield url
        finally:
            _stop(process)


def _wait_ready(process: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited while starting; see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"{url} was not ready within {START_TIMEOUT_S:.0f} s; see {log_path}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    with contextlib.suppress(ProcessLookupError):  # anything of its group still running
        os.killpg(process.pid, signal.SIGKILL)


def compare(
    targets: list[Target],
    specs: list[RequestSpec],
    loads: Sequence[Load | Shift],
    slo: SLO,
    count_tokens: CountTokens,
    log_dir: Path | None = None,
) -> list[Run]:
    """Each target started afresh for each load and driven with the very same requests
    (`specs`: a Load's warm-up and measured ones; a Shift's warm-up, its schedule being
    its own); returns one Run per (target, load). A fresh start per load: a server that kept its
    prefix cache would meet the previous load's prompts again and skip their prefill. A
    target that cannot start is reported and left out; the others still run."""
    runs = []
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="appliance-bench-"))
    for target in targets:
        try:
            for load in loads:
                with running(target, log_dir) as url:
                    runs.append(_drive(target, url, specs, load, slo, count_tokens))
        except RuntimeError as exc:  # it did not start: say so, go on with the rest
            print(f"  {target.label}: left out, {exc}", file=sys.stderr)
    return runs


def _drive(
    target: Target,
    url: str,
    specs: list[RequestSpec],
    load: Load | Shift,
    slo: SLO,
    count_tokens: CountTokens,
) -> Run:
    at = "shift" if isinstance(load, Shift) else load.rate or load.concurrency
    label = f"{target.label} @ {at}"
    results, seconds = asyncio.run(
        run_load(url, iter(specs), load, count_tokens, extra_body=target.extra_body, label=label)
    )
    summary = summarize(results, seconds, slo)
    if isinstance(load, Shift):
        run = Run(target.label, None, results, summary)
        run.phases = phase_summaries(results, load.phases, slo)
        run.phases_total = shift_total(results, load.phases, slo)
    else:
        run = Run(target.label, load.rate, results, summary)
    print(f"  {label}: {_brief(run.summary)}", file=sys.stderr)
    return run


def _brief(s: Summary) -> str:
    return (
        f"{s.completed} done, {s.failed} failed, goodput {s.goodput:.3f} req/s, "
        f"TPOT p99 {s.tpot.p99 * 1000:.0f} ms"
    )
