"""benchmarks/speculative_bench.py's dry run: every path of the benchmark (two real
`appliance serve` starts, speculation off and on, each driven with the grounded and chat
workloads at batch 1 and a few streams; llama.cpp's llama-lookup and llama-server where built; the
acceptance read from /metrics and counted by an engine in process) with a few tokens a
request. Its figures mean nothing; what it checks is that each path ran and said so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # it starts servers and loads the model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "speculative_bench.py"
LOOKUP = ROOT / ".bench" / "llama.cpp" / "bin" / "llama-lookup"
OURS = {"ours, plain", "ours, ngram"}
LLAMA = {"llama.cpp, plain", "llama.cpp, llama-lookup"}
SERVER = {"llama-server, plain", "llama-server, ngram-simple"}


@pytest.mark.extended  # a benchmark's dry run: the extended lane
def test_the_dry_run_runs_every_path(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--llama-server", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "speculative_bench.json").read_text())
    assert report["dry_run"] is True and report["cpu"]
    cells = {(c["workload"], c["streams"], c["config"]): c for c in report["cells"]}
    ours = {key for key in cells if key[2] in OURS}
    assert ours == {(w, n, c) for w in ("grounded", "chat") for n in (1, 2) for c in OURS}
    for key in ours:
        (run,) = cells[key]["runs"]  # one round
        assert run["failed"] == 0 and run["completed"] == (1 if key[1] == 1 else 2), key
        assert run["decode_tok_s"] > 0 and run["tpot_p50_ms"] > 0, key
        if key[2] == "ours, plain":  # speculation off really is off
            assert run["drafted"] in (None, 0), key
    # The ngram server drafted: the setting reached its workers and the counters saw it.
    drafted = sum(cells[w, n, "ours, ngram"]["runs"][0]["drafted"] for w, n, _ in ours)
    assert drafted > 0
    engine = {(c["workload"], c["streams"]): c for c in report["engine_counts"]}
    assert set(engine) == {(w, n) for w, n, _ in ours}  # the in-process count ran too
    assert sum(c["drafted"] for c in engine.values()) > 0
    llama = {key for key in cells if key[2] in LLAMA}
    served = {key for key in cells if key[2] in SERVER}
    if LOOKUP.is_file():
        assert llama == {("grounded", 1, c) for c in LLAMA}
        for key in llama:
            assert cells[key]["best"]["decode_tok_s"] > 0, key
        assert report["llama_cpp_skipped"] is None
        # llama-server served every load, as ours did, plain and drafting
        assert served == {(w, n, c) for w in ("grounded", "chat") for n in (1, 2) for c in SERVER}
        for key in served:
            (run,) = cells[key]["runs"]
            assert run["failed"] == 0 and run["decode_tok_s"] > 0, key
        assert cells["grounded", 1, "llama-server, plain"]["runs"][0]["drafted"] in (None, 0)
    else:  # not built here: the rows are left out and the reason says how to build them
        assert not llama and not served and "build_llama_cpp.sh" in report["llama_cpp_skipped"]
    assert len(report["goals"]) == 6 and report["acceptance_source"]
    table = (tmp_path / "speculative_bench.md").read_text()
    assert "DRY RUN" in table and "| goal (issue 38) | measured | met |" in table
    assert table.strip() in proc.stdout
