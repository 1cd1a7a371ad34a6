"""Section 4, cuda_tests: benchmarks/gpu_tests under pytest on the GPU (a step's host
syncs, decode CUDA graphs and batch.cuda_graphs, the handoff copy's side streams and IPC
event); skipped without CUDA, where those tests fail at import."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .common import ROOT, Result, verdict
from .scale import Scale

GPU_TESTS = ROOT / "benchmarks" / "gpu_tests"


def section_cuda_tests(scale: Scale) -> Result:
    """benchmarks/gpu_tests under pytest: the checks that need CUDA to run at all (a
    step's host syncs, decode CUDA graphs against eager steps, the handoff copy behind the
    prefill side's IPC event on the decode side's streams), kept out of the CPU suite."""
    if not scale.cuda:
        return {
            "status": "skipped",
            "reason": "CUDA only: benchmarks/gpu_tests fail at import without a CUDA device",
        }
    import pytest

    outcomes = PytestOutcomes()
    code = pytest.main(["-q", "-p", "no:cacheprovider", str(GPU_TESTS)], plugins=[outcomes])
    counts = Counter(outcome for outcome, _ in outcomes.tests.values())
    return verdict(
        {"pytest exits 0": int(code) == 0, "some test ran": counts["passed"] > 0},
        summary=", ".join(f"{n} {outcome}" for outcome, n in counts.items()) or "no tests",
        exit_code=int(code),
        tests={name: outcome for name, (outcome, _) in outcomes.tests.items()},
        failures={name: text for name, (outcome, text) in outcomes.tests.items() if text},
    )


class PytestOutcomes:
    """A pytest plugin keeping each test's outcome and, where it failed, its report."""

    def __init__(self) -> None:
        self.tests: dict[str, tuple[str, str]] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            text = str(report.longrepr)[-3000:] if report.failed else ""
            self.tests[report.nodeid] = (report.outcome, text)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.tests[report.nodeid or "collection"] = ("error", str(report.longrepr)[-3000:])
