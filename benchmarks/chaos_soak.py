"""A chaos soak (issue 40): mixed traffic against a head and a cross-box agent on loopback
while a seeded scheduler injects faults, every answer checked against a reference.

The cluster: `appliance serve` on 127.0.0.2 (prefill on CPU device 0, decode on device 1,
dense float32 weights and KV, speculation off) and `appliance agent` for box "b" (one
decode device) joining from 127.0.0.3 through a TCP relay in this process, so the link
between the boxes can be cut from outside (the relay closes both ends of every connection
it carries: the agent's and its worker's). The KV itself crosses through NIXL straight
between the boxes, not through the relay. The agent is brought back whenever it exits, as
its systemd unit would.

Traffic: `--clients` loops of temperature-0 requests drawn from a fixed catalogue: chat
(whole and streamed), completions (whole and streamed), long prompts, prompts sharing a
long prefix, `n=2`, and streams the client drops after a few chunks. Every request's
reference answer is taken first from the same server, one request at a time, before any
fault; on dense float32 weights and KV the greedy answer does not depend on batch shape.

Faults, one drawn at a time by `--seed` from a shuffled deck of the kinds (each kind
tried once in each turn of the deck, so a short run tries them all): SIGKILL or
SIGSTOP/SIGCONT of a head worker, of box b's worker, of the agent (SIGSTOP: the whole box,
agent and worker); an in-place move of device 1 (POST /admin/pools); an autopilot move
(POST /admin/planner/apply); a cut link; clients that disconnect mid-stream; a full disk
under the KV store's disk tier (chaos_disk.py: the head runs with the store on, its disk
tier on a small tmpfs the soak mounts, fills to ENOSPC for a drawn time and frees; checked:
one warning from the head, the tier taking blocks again after). Mounting needs root:
without it the full disk is drawn but logged as not applied, with the reason.

The soak runs for at least `--minutes`, until every kind has been tried and at least
`--faults` faults have been applied (a fault whose target is not there, or a move the
appliance refuses, is logged and not counted). After every `--faults-per-check` faults,
traffic pauses, the requests in flight end, the box waits for its workers (box b's
included) and for idle, and the invariants are read: every KV block free, as many
processes under the server and the agent as at the start, no orphan (this process is a
child subreaper: a worker whose parent died lands here), the supervisor's file
descriptors and RSS within FD_GROWTH and RSS_GROWTH_MB of the start (the start is read
after the references, on a warm server).

Every request ends as one of: completed (the reference answer), failed cleanly (a 503 with
Retry-After, or a stream's 503 error event, within the deadline), cancelled (dropped by
its client on purpose), or a must-be-0 outcome: lost (the connection ended without an
answer), wrong (an answer that is not the reference), hang (no end within `--deadline`),
bad status (any other status, a 5xx above all). The exit code is 1 if any must-be-0 figure
is not 0 or an invariant failed.

    .venv/bin/python benchmarks/chaos_soak.py --minutes 60 --faults 200 --seed 1 --out soak.json

This file is the command and the rounds; its parts are the modules beside it, one job
each: chaos_traffic.py (the requests and their verdicts), chaos_cluster.py (the head,
the agent, the relay), chaos_faults.py (drawing and injecting faults), chaos_checks.py
(the invariants) and chaos_report.py (the report and its table).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import io
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from chaos_checks import READY_BOUND_S, Checker, figures
from chaos_cluster import API_KEY, Cluster, poll
from chaos_faults import FAULT_KINDS, Chaos
from chaos_report import MUST_BE_ZERO, VERDICTS, Report, fault_events, table
from chaos_traffic import Client, Traffic, catalogue, references

PR_SET_CHILD_SUBREAPER = 36


# ------------------------------------------------------------------------------ the soak


@dataclass
class Options:
    minutes: float
    faults: int
    seed: int
    clients: int
    max_tokens: int
    deadline_s: float
    faults_per_check: int
    stop_max_s: float
    stall_timeout_s: float
    gap_max_s: float = 3.0  # the traffic before each fault: 0.5 s to this, drawn
    kinds: tuple[str, ...] = FAULT_KINDS


async def soak(cluster: Cluster, options: Options) -> Report:
    rng = random.Random(options.seed)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=cluster.url, headers=headers, limits=limits) as http:
        client = Client(http, {}, options.deadline_s)
        specs = catalogue(options.seed, options.max_tokens)
        client.references = await references(client, specs)
        start = await asyncio.to_thread(figures, cluster)
        traffic, report = Traffic(client, specs, rng), Report(asdict(options), 0.0, start=start)
        chaos = Chaos(cluster, traffic, rng, options.stop_max_s, options.kinds)
        checker = Checker(cluster, start)
        traffic.start(options.clients)
        try:
            await rounds(chaos, checker, options, rng)
        except asyncio.CancelledError:  # Ctrl-C: report what was seen so far
            report.interrupted = True
        await traffic.stop()
        if checker.recovered and not report.interrupted:
            report.end = await checker.after_faults("end")
        else:
            report.end = await asyncio.to_thread(figures, cluster)
    report.seconds = round(time.monotonic() - chaos.started, 1)
    verdicts = Counter(o.verdict for o in traffic.outcomes)
    report.requests = {"sent": len(traffic.outcomes)} | {v: verdicts[v] for v in VERDICTS}
    report.faults = dict(Counter(f.kind for f in chaos.faults if f.applied))
    report.faults_not_applied = dict(Counter(f.kind for f in chaos.faults if not f.applied))
    report.violations = checker.violations + chaos.violations
    report.fault_log = chaos.faults
    report.bad_requests = [o for o in traffic.outcomes if o.verdict in MUST_BE_ZERO]
    return report


async def rounds(chaos: Chaos, checker: Checker, options: Options, rng: random.Random) -> None:
    """Faults with traffic running, then a check with none, until the bars are passed: the
    time, the faults applied, and every kind tried once."""
    end_at = time.monotonic() + options.minutes * 60
    round_ = 0
    while time.monotonic() < end_at or chaos.applied() < options.faults or chaos.untried():
        round_ += 1
        chaos.traffic.running.set()
        for _ in range(options.faults_per_check):
            await asyncio.sleep(rng.uniform(0.5, options.gap_max_s))  # traffic before it
            fault = await chaos.inject(round_)
            print(f"[{fault.at:7.1f} s] round {round_}: {fault.kind}: {fault.detail}")
        await asyncio.sleep(rng.uniform(1.0, 1.0 + options.gap_max_s))  # traffic after
        await chaos.traffic.pause()
        await checker.after_faults(f"round {round_}")
        if not checker.recovered:  # every later round would wait for it again
            print(f"round {round_}: the workers did not all come back: the soak stops")
            return


def subreaper() -> None:
    """Orphaned descendants come to this process instead of init, where the soak sees them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def parse(argv: list[str] | None) -> tuple[Options, Path | None, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="at least this long")
    parser.add_argument("--faults", type=int, default=200, help="at least this many applied")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clients", type=int, default=3, help="request loops at once")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--deadline", type=float, default=180.0, help="s; past it: a hang")
    parser.add_argument("--faults-per-check", type=int, default=1)
    parser.add_argument("--stop-max", type=float, default=20.0, help="longest SIGSTOP, s")
    parser.add_argument("--stall-timeout", type=float, default=15.0, help="recovery's, s")
    parser.add_argument("--gap-max", type=float, default=3.0, help="traffic before a fault, s")
    parser.add_argument(
        "--kinds",
        default=",".join(FAULT_KINDS),
        help="the fault kinds drawn from, comma-separated (to reproduce one)",
    )
    parser.add_argument("--out", type=Path, help="the report as JSON")
    parser.add_argument("--folder", type=Path, help="for logs and certificates (a temp one)")
    args = parser.parse_args(argv)
    options = Options(
        args.minutes,
        args.faults,
        args.seed,
        args.clients,
        args.max_tokens,
        args.deadline,
        args.faults_per_check,
        args.stop_max,
        args.stall_timeout,
        args.gap_max,
        kinds(args.kinds),
    )
    return options, args.out, args.folder


def kinds(text: str) -> tuple[str, ...]:
    chosen = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(set(chosen) - set(FAULT_KINDS))
    if unknown or not chosen:
        raise SystemExit(f"--kinds: unknown {unknown}; the kinds are {', '.join(FAULT_KINDS)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    options, out, folder = parse(argv)
    folder = folder or Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    subreaper()
    if isinstance(sys.stdout, io.TextIOWrapper):  # progress lines as they come, in a log too
        sys.stdout.reconfigure(line_buffering=True)
    cluster = Cluster(folder, options.stall_timeout_s)
    try:
        cluster.start()  # inside: a start cut short still stops what it began (and unmounts)
        started = time.monotonic()
        if not asyncio.run(poll(cluster.ready, READY_BOUND_S)):
            raise SystemExit(f"the cluster was not ready within {READY_BOUND_S:.0f} s: {folder}")
        print(f"cluster ready in {time.monotonic() - started:.0f} s; logs in {folder}")
        report = asyncio.run(soak(cluster, options))
    finally:
        cluster.stop()
    report.agent_exits = cluster.agent_exits
    report.events = dict(fault_events(folder / "head.log"))
    print(table(report))
    for problem in report.violations:
        print("violation:", problem)
    for outcome in report.bad_requests:
        print("bad request:", outcome)
    if report.failed:  # what the supervisor said last (its access log aside)
        lines = (folder / "head.log").read_text(errors="replace").splitlines()
        said = [line for line in lines if not line.startswith("INFO:  ")]
        print("the head's log, last lines:", *said[-40:], sep="\n")
    if out is not None:
        out.write_text(json.dumps(asdict(report), indent=1, default=str) + "\n")
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
