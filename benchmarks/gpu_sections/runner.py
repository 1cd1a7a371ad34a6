"""Running the sections: each in a child process of its own session under a timeout
(its process group killed past it), within the run's time budget, its output appended
to the run's log; the JSON report rewritten after each section, one line printed for
each."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .appliance_e2e import section_appliance
from .bandwidth import section_bandwidth
from .common import ROOT, Result
from .cuda_tests import section_cuda_tests
from .environment import section_environment
from .handoff import section_handoff
from .paged_bf16 import section_paged_bf16
from .quant_decode import section_quant_decode
from .scale import DRY, GPU, Scale
from .throughput import section_throughput
from .triton_kernel import section_triton_kernel

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
REAL_OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"
DRY_OUT = Path(tempfile.gettempdir()) / "gpu_check_dry_run.json"


class Section(NamedTuple):
    """One part of the check and its time limits (seconds) on the GPU and in a dry run."""

    name: str
    run: Callable[[Scale], Result]
    gpu_timeout_s: float
    dry_timeout_s: float


SECTIONS = (
    Section("environment", section_environment, 60, 60),
    Section("paged_bf16", section_paged_bf16, 150, 120),
    Section("triton_kernel", section_triton_kernel, 150, 90),
    Section("cuda_tests", section_cuda_tests, 120, 30),
    Section("appliance", section_appliance, 240, 180),
    Section("handoff", section_handoff, 60, 60),
    Section("throughput", section_throughput, 120, 90),
    Section("bandwidth", section_bandwidth, 150, 60),
    Section("quant_decode", section_quant_decode, 150, 120),
)
BY_NAME = {section.name: section for section in SECTIONS}


def child_main(args: argparse.Namespace) -> int:
    """In the child process: run one section, write its result as JSON to args.result."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    scale = (DRY if args.dry_run else GPU)._replace(
        model=args.model, inject_fault=args.inject_fault
    )
    try:
        result = BY_NAME[args.child].run(scale)
    except Exception:
        result = {"status": "error", "error": traceback.format_exc()[-6000:]}
    Path(args.result).write_text(json.dumps(result, indent=1, default=str))
    return 0


def child_env(dry_run: bool) -> dict[str, str]:
    """The children's environment: unbuffered output; under a dry run Triton's
    interpreter (read when triton is first imported, so it is set before the child
    starts) and the appliance's own root on the path of every process it spawns."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    return env


def run_section(section: Section, args: argparse.Namespace, timeout: float, log: Path) -> Result:
    """Run one section in a child process of its own session, its output appended to the
    run's log; past `timeout` kill the whole process group (its workers too). Returns
    the section's result."""
    argv = [sys.executable, str(SCRIPT), "--child", section.name]
    argv += ["--dry-run"] if args.dry_run else []
    argv += ["--model", args.model] if args.model else []
    argv += ["--inject-fault"] if args.inject_fault else []
    with tempfile.TemporaryDirectory() as temp, log.open("a") as output:
        result_path = Path(temp) / "result.json"
        output.write(f"\n===== {section.name} (timeout {timeout:.0f} s) =====\n")
        output.flush()
        offset = output.tell()
        start = time.monotonic()
        child = subprocess.Popen(
            [*argv, "--result", str(result_path)], stdout=output, stderr=subprocess.STDOUT,
            env=child_env(args.dry_run), cwd=ROOT, start_new_session=True,
        )  # fmt: skip
        try:
            code: int | None = child.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        kill_group(child)
        seconds = round(time.monotonic() - start, 1)
        if code is None:
            result = {"status": "timeout", "reason": f"still running after {timeout:.0f} s: killed"}
        elif result_path.is_file():
            result = json.loads(result_path.read_text())
        else:
            result = {"status": "error", "reason": f"the child exited with {code} and no result"}
    result["seconds"] = seconds
    result["log"] = str(log)
    if result["status"] not in ("pass", "skipped"):
        with log.open("rb") as handle:
            handle.seek(max(offset, log.stat().st_size - 4000))
            result["log_tail"] = handle.read().decode(errors="replace")
    return result


def kill_group(child: subprocess.Popen) -> None:
    """SIGKILL the child's process group: it, and workers it left behind."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        child.wait(10)


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Replace the report file whole (written beside it, flushed, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    with temp.open("w") as handle:
        handle.write(json.dumps(report, indent=1, default=str))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)


def print_result(index: int, total: int, name: str, result: Result) -> None:
    """One line per section, its table, and why it did not pass."""
    status, seconds = result["status"], result.get("seconds", 0)
    detail = result.get("summary") or result.get("reason", "")
    print(f"[{index}/{total}] {name:<14} {status:<8} {seconds:>6.1f} s  {detail}", flush=True)
    for line in result.get("table", []):
        print("    " + line)
    for failed in result.get("failed", []):
        print(f"    failed: {failed}")
    if result.get("error"):
        print("    " + result["error"].strip().splitlines()[-1])
    if result.get("log_tail"):
        print("    log: " + result["log"])
    sys.stdout.flush()


def orchestrate(args: argparse.Namespace) -> int:
    """Run the chosen sections one after another within the time budget, writing the
    report after each; returns the exit status."""
    chosen = [BY_NAME[name] for name in args.sections]
    if args.model:  # the children run in the checkout's root
        args.model = str(Path(args.model).resolve())
    out = Path(args.out or (DRY_OUT if args.dry_run else REAL_OUT))
    log = out.with_suffix(".log")  # every section's output, one after another
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"gpu_check {' '.join(sys.argv[1:])}\n")
    no_cuda = not args.dry_run and not torch.cuda.is_available()
    report = {
        "check": "benchmarks/gpu_check.py",
        "dry_run": args.dry_run,
        "device": "cpu" if args.dry_run else "cuda",
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "budget_s": args.budget_s,
        "sections": {s.name: {"status": "pending"} for s in chosen},
    }
    write_report(out, report)
    print(f"# gpu_check{' --dry-run' if args.dry_run else ''}: report {out}", flush=True)
    deadline = time.monotonic() + args.budget_s
    for index, section in enumerate(chosen, 1):
        result = section_result(section, args, deadline, log, no_cuda, report, out)
        report["sections"][section.name] = result
        write_report(out, report)
        print_result(index, len(chosen), section.name, result)
    statuses = Counter(r["status"] for r in report["sections"].values())
    report["ok"] = set(statuses) <= {"pass", "skipped"} and not no_cuda
    report["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    write_report(out, report)
    print(f"# {dict(statuses)} -> {out}", flush=True)
    if no_cuda:
        print("no CUDA device here: run with --dry-run on a machine without a GPU")
        return 2
    return 0 if report["ok"] else 1


def section_result(
    section: Section,
    args: argparse.Namespace,
    deadline: float,
    log: Path,
    no_cuda: bool,
    report: dict[str, Any],
    out: Path,
) -> Result:
    """Run a section, or say why it does not run."""
    if no_cuda and section.name != "environment":
        return {"status": "skipped", "reason": "no CUDA device: torch.cuda.is_available() is False"}
    left = deadline - time.monotonic()
    if left < 10:
        return {"status": "not_run", "reason": f"the {args.budget_s:.0f} s budget was spent"}
    limit = section.dry_timeout_s if args.dry_run else section.gpu_timeout_s
    timeout = min(limit, left, args.section_timeout or math.inf)
    report["sections"][section.name] = {"status": "running", "timeout_s": round(timeout)}
    write_report(out, report)
    return run_section(section, args, timeout, log)
