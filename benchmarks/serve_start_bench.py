"""`appliance serve` as a user starts and stops it, at two commits, same machine, same run:
seconds to a healthy server, then one short completion, the serve process's memory and
whether it mapped torch, the memory of every process under it (workers, and a fork server
where workers fork from one: proportional set size, so pages they share count once),
seconds from a worker's SIGKILL to its restart being ready, and seconds from SIGINT to
its exit.

Each commit runs from a git worktree (this checkout's compiled kernels copied in), the
two alternating, the default model and settings but the port (and `--mode`).

    .venv/bin/python benchmarks/serve_start_bench.py --before e291516 [--after HEAD] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tree_server import start_server
from worktrees import alternate

from appliance.model.cpu_kernels.loading import level
from appliance.model.model_source import default_model_path, model_name
from appliance.topology.cpu import cpu_model_name


@dataclass
class Start:
    ready_s: float
    restart_s: float
    stop_s: float
    rss_mib: float
    torch_mapped: bool
    workers_pss_mib: float


def one_start(tree: Path, mode: str) -> Start:
    """Start `appliance serve` from `tree`, wait for /health, ask one completion, stop it."""
    began = time.monotonic()
    process, url = start_server(tree, {"APPLIANCE_MODE": mode})
    ready = time.monotonic() - began
    body = {"model": model_name(default_model_path()), "prompt": "Hello", "max_tokens": 8}
    httpx.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()
    maps = Path(f"/proc/{process.pid}/maps").read_text()
    workers = sum(pss_mib(child) for child in descendants(process.pid))
    rss = rss_mib(process.pid)
    restart = restart_s(url)
    stopping = time.monotonic()
    process.send_signal(signal.SIGINT)
    process.wait(120)
    return Start(ready, restart, time.monotonic() - stopping, rss, "libtorch" in maps, workers)


def restart_s(url: str) -> float:
    """SIGKILL the first worker /health lists; seconds until its replacement is ready."""
    killed = workers_of(url)[0]["pid"]
    began = time.monotonic()
    os.kill(killed, signal.SIGKILL)
    deadline = began + 120
    while time.monotonic() < deadline:
        workers = workers_of(url)
        if all(w["ready"] and w.get("pid") not in (None, killed) for w in workers):
            return time.monotonic() - began
        time.sleep(0.02)
    raise TimeoutError("the killed worker was not restarted within 120 s")


def workers_of(url: str) -> list[dict]:
    pools = httpx.get(url + "/health", timeout=10).json()["pools"]
    return [worker for workers in pools.values() for worker in workers]


def pss_mib(pid: int) -> float:
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    return next(int(line.split()[1]) for line in rollup if line.startswith("Pss:")) / 1024


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (its workers, their fork server), from each of its
    threads' lists of children, and theirs."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mode", default="disaggregated")
    args = parser.parse_args()
    starts = alternate(
        [args.before, args.after], args.runs, lambda tree: one_start(tree, args.mode)
    )
    print(f"{cpu_model_name()}, kernels {level()}, {os.cpu_count()} cores; `appliance serve`,")
    print(f"mode {args.mode}, {args.runs} starts each, alternating; median (min-max)\n")
    print(
        "| commit | ready s | worker restart s | stop s | serve process RSS MiB "
        "| torch in the serve process | processes under it, PSS MiB |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    for rev, runs in starts.items():
        fields = ("ready_s", "restart_s", "stop_s", "rss_mib")
        cells = [_spread([getattr(r, f) for r in runs]) for f in fields]
        mapped = sorted({r.torch_mapped for r in runs})
        workers = _spread([r.workers_pss_mib for r in runs])
        print(f"| {rev} | {' | '.join(cells)} | {', '.join(map(str, mapped))} | {workers} |")


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    main()
