"""Serving across two boxes against one box, on the same cores (issue 21).

One box: `appliance serve`, a prefill worker on core 0 and a decode worker on core 1.
Two boxes: a head on core 0 that only prefills (`decode_devices=none`, `cluster.listen`)
and an agent on core 1 (`appliance agent --pool decode`), each process held to its core
with taskset; every prompt's KV crosses from the head's pool to the agent's through NIXL
over TCP on loopback. The same requests (the bench's chat workload, Poisson arrivals)
go to both; the table is `appliance bench`'s, with the one-box run as the baseline.

    .venv/bin/python benchmarks/cross_box_serving.py [--rate 1.0] [--requests 60]

Writes benchmarks/results/cross_box_serving_cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from appliance.bench.compare import Target, free_port, running
from appliance.bench.report import table
from appliance.bench.runner import Load, run_load
from appliance.bench.workloads import generate
from appliance.core.goodput import SLO, Summary, summarize
from appliance.model.model_source import prepare_tokenizer
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_model_name

OUT = Path(__file__).parent / "results" / "cross_box_serving_cpu.md"
SERVE = [sys.executable, "-m", "appliance.cli", "serve"]
AGENT = [sys.executable, "-m", "appliance.cli", "agent"]
COMMON = {"APPLIANCE_KV__MEMORY_MB": "256", "APPLIANCE_CLUSTER__TRANSPORTS": "tcp"}
SLO_SPEC = ["ttft:2000", "tpot:100"]


def one_box() -> Target:
    env = {"APPLIANCE_CPU_DEVICES": "2", "APPLIANCE_PREFILL_DEVICES": "0"}
    env |= {"APPLIANCE_DECODE_DEVICES": "1"}
    return Target("one box: 1P+1D", ["taskset", "-c", "0,1", *SERVE], COMMON | env, port_flag=None)


def head(listen: str, secret: Path) -> Target:
    env = {
        "APPLIANCE_CPU_DEVICES": "1",
        "APPLIANCE_PREFILL_DEVICES": "0",
        "APPLIANCE_DECODE_DEVICES": "none",
        "APPLIANCE_CLUSTER__LISTEN": listen,
        "APPLIANCE_CLUSTER__SECRET_FILE": str(secret),
    }
    command = ["taskset", "-c", "0", *SERVE]
    return Target("two boxes: head 1P + box b 1D", command, COMMON | env, port_flag=None)


@contextlib.contextmanager
def agent(listen: str, secret: Path, log: Path) -> Iterator[None]:
    """Box b: an agent on core 1 offering one decode device."""
    command = ["taskset", "-c", "1", *AGENT, "--head", listen, "--box", "b"]
    command += ["--pool", "decode", "--cpu-devices", "1", "--secret-file", str(secret)]
    with log.open("a") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def wait_for_decoder(url: str, timeout: float = 180.0) -> None:
    """Until box b's decode worker is ready (the head serves nothing before)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pools = httpx.get(url + "/health", timeout=10).json()["pools"]
        if any(w["ready"] and w["device"].startswith("b/") for w in pools.get("decode", [])):
            return
        time.sleep(0.5)
    raise TimeoutError(f"box b's decode worker was not ready within {timeout:.0f} s")


def drive(url: str, args: argparse.Namespace, slo: SLO) -> Summary:
    tokenizer = prepare_tokenizer(None, load_settings().cache_dir)[1]
    specs = generate("chat", tokenizer, args.seed)
    load = Load(rate=args.rate, num_requests=args.requests, seed=args.seed)

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    results, duration = asyncio.run(
        run_load(url, specs, load, count, extra_body={"ignore_eos": True})
    )
    return summarize(results, duration, slo)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    slo = SLO.parse(SLO_SPEC)
    logs = Path(tempfile.mkdtemp(prefix="cross-box-"))
    secret = logs / "secret"
    secret.write_text("cross-box-benchmark-secret-0123456789\n")
    rows = []
    with running(one_box(), logs) as url:
        rows.append((one_box().label, drive(url, args, slo)))
    listen = f"127.0.0.1:{free_port()}"
    target = head(listen, secret)
    with running(target, logs) as url, agent(listen, secret, logs / "agent.log"):
        wait_for_decoder(url)
        rows.append((target.label, drive(url, args, slo)))
    text = (
        f"# Serving across two boxes against one box, same cores\n\n{cpu_model_name()}; "
        f"core 0 prefills, core 1 decodes in both; the chat workload at {args.rate} req/s "
        f"(Poisson), {args.requests} requests, seed {args.seed}, ignore_eos; SLO "
        f"`{' '.join(SLO_SPEC)}`. Two boxes: the KV crosses through NIXL over loopback TCP.\n\n"
        f"    .venv/bin/python benchmarks/cross_box_serving.py --rate {args.rate} "
        f"--requests {args.requests}\n\n" + table(rows, baseline=rows[0][0]) + "\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
