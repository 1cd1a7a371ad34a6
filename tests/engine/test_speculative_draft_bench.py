"""benchmarks/draft_model_bench.py's dry run: tiny random models, every configuration
(plain, a draft, the target drafting for itself, a random draft) run once, each greedy
answer checked against plain decoding. Its figures mean nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # it builds and runs models

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "draft_model_bench.py"


@pytest.mark.extended  # a benchmark's dry run: the extended lane
def test_the_dry_run_runs_every_configuration() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "answers identical to plain: True" in proc.stdout
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line}
    assert {"plain", "draft", "self", "random"} <= set(rows)
    assert rows["self"][3] == "1.00"  # the target drafting for itself: every draft kept
    assert rows["plain"][3] == "-" and int(rows["draft"][4]) > 0
