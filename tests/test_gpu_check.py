"""benchmarks/gpu_check.py's dry run: every section of the GPU check runs here on the CPU
(Triton's interpreter for the kernel), so its first call on a GPU machine is not its
first run. A child process, as a user runs it: the check starts children of its own
(one per section, Triton's interpreter set before triton is imported) and the appliance
section spawns workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
SECTIONS = (
    "environment",
    "paged_bf16",
    "triton_kernel",
    "cuda_tests",
    "appliance",
    "handoff",
    "throughput",
    "bandwidth",
)


def run_check(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


def test_the_dry_run_passes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = run_check("--dry-run", "--out", str(out), timeout=300)
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert tuple(sections) == SECTIONS
    for name, section in sections.items():
        if section["status"] == "skipped":
            assert section["reason"], name
        else:
            assert section["status"] == "pass", (name, section)
            assert all(section["checks"].values()), (name, section["failed"])
    assert report["ok"] is True and "finished" in report
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CUDA only" in sections["cuda_tests"]["reason"]
    # What the GPU run is for is recorded even here: the backend and the device mapping.
    assert sections["paged_bf16"]["attention"]["runs_triton"] is False
    assert sections["triton_kernel"]["interpreted"] is True
    devices = sections["environment"]["topology"]["devices"]
    assert [d["kind"] for d in devices] == ["cpu", "cpu"]
    log = (tmp_path / "gpu_check.log").read_text()  # every section's output, in order
    assert [line.split()[1] for line in log.splitlines() if line.startswith("=====")] == list(
        SECTIONS
    )


def test_the_paged_check_fails_on_a_corrupted_kv_cache(tmp_path: Path) -> None:
    """Its bounds are loose enough for bfloat16 on every CPU; this shows they are not too
    loose to see 16 zeroed keys of one block."""
    out = tmp_path / "fault.json"
    proc = run_check(
        "--dry-run", "--out", str(out), "--sections", "paged_bf16", "--inject-fault", timeout=300
    )
    section = json.loads(out.read_text())["sections"]["paged_bf16"]
    assert proc.returncode == 1 and section["status"] == "fail", section
    rows_over = {kind: got["rows_over_bound"] for kind, got in section["engine_vs_float32"].items()}
    # The long prompt's rows after its first chunk, the prompt that reuses that block, and
    # the long prompt's decodes read the zeroed keys; the short prompts never do.
    assert rows_over["chunked_prefill"] > 0 and rows_over["prefix_hit"] > 0, rows_over
    assert rows_over["decode"] > 0 and rows_over["short_prefill"] == 0, rows_over
    assert all(c for name, c in section["checks"].items() if name.startswith("short_prefill"))


def test_a_section_past_its_timeout_is_killed_and_recorded(tmp_path: Path) -> None:
    out = tmp_path / "cut.json"
    proc = run_check(
        "--dry-run",
        "--out",
        str(out),
        "--sections",
        "appliance,handoff",
        "--section-timeout",
        "3",
        timeout=120,
    )
    sections = json.loads(out.read_text())["sections"]
    assert proc.returncode == 1
    assert sections["appliance"]["status"] == "timeout"
    assert "killed" in sections["appliance"]["reason"]
    assert sections["handoff"]["status"] in ("pass", "timeout")  # ran after it, all the same


def test_wheels_are_pinned_to_what_is_installed_here() -> None:
    proc = run_check("--wheels", timeout=60)
    lines = proc.stdout.split()
    assert proc.returncode == 0
    assert {"gguf", "pydantic", "pydantic-core", "pydantic-settings"} <= {
        line.split("==")[0] for line in lines
    }
    assert all("==" in line for line in lines), lines
