"""benchmarks/gpu_check.py's dry run: every section of the GPU check runs here on the CPU
(Triton's interpreter for the kernel), so its first call on a GPU machine is not its
first run. A child process, as a user runs it: the check starts children of its own
(one per section, Triton's interpreter set before triton is imported) and the appliance
section spawns workers."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

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
    "quant_decode",
)


def run_check(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.extended  # a benchmark's dry run, every section: the extended lane
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


def test_the_paged_check_fails_on_a_corrupted_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its bounds are loose enough for bfloat16 on every CPU; this shows they are not too
    loose to see 16 zeroed keys of one block. The section in this process, as its child
    runs it (the dry run above runs it as a child; a failed section's exit status is the
    timeout test's)."""
    from gpu_sections import paged_bf16
    from gpu_sections.scale import DRY

    from appliance.model.layers import paged_attention as attention

    # The section counts the attention calls by wrapping these: the wrappers go after it.
    monkeypatch.setattr(attention, "_prefill", attention._prefill)
    monkeypatch.setattr(attention, "_decode", attention._decode)
    section = paged_bf16.section_paged_bf16(DRY._replace(inject_fault=True))
    assert section["status"] == "fail", section
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
        "1",  # the appliance section starts two workers: it is never done within 1 s
        timeout=120,
    )
    sections = json.loads(out.read_text())["sections"]
    assert proc.returncode == 1
    assert sections["appliance"]["status"] == "timeout"
    assert "killed" in sections["appliance"]["reason"]
    assert sections["handoff"]["status"] in ("pass", "timeout")  # ran after it, all the same


def test_wheels_are_pinned_to_what_is_installed_here(capsys: pytest.CaptureFixture[str]) -> None:
    import gpu_check  # the script's own main, in this process: --wheels starts nothing

    assert gpu_check.main(["--wheels"]) == 0
    lines = capsys.readouterr().out.split()
    assert {"gguf", "pydantic", "pydantic-core", "pydantic-settings"} <= {
        line.split("==")[0] for line in lines
    }
    assert all("==" in line for line in lines), lines


# --- the sections' own parts, in this process (issue 39) ---------------------------------

sys.path.insert(0, str(SCRIPT.parent))  # the sections' package sits beside the script

GIB = 2**30


def test_every_bandwidth_row_is_planned_to_fit_an_h100() -> None:
    """An H100 has 79.6 GiB: the 8B shape's weights (15 GiB) and a pool for 64 sequences
    at 8k (64 GiB) do not fit together. Every row that runs fits 78 GiB; the rest are
    skipped with the memory they would need; on an H200 every row runs."""
    from gpu_sections import bandwidth
    from gpu_sections.scale import GPU

    config = bandwidth.shaped_config(GPU)
    weights, block = bandwidth.model_bytes(config), bandwidth.block_bytes_of(config)
    assert weights == 2 * 8_030_261_248 and block == 2 * 2**20  # Llama-3-8B's parameters
    device = 78 * GIB
    plan = bandwidth.plan_rows(GPU, free_bytes=device - weights)
    assert weights + plan["pool_blocks"] * block + bandwidth.HEADROOM_BYTES <= device
    rows = plan["decode"] + plan["prefill"]
    for row in rows:
        if row["fits"]:
            assert row["blocks"] < plan["pool_blocks"], row
            assert weights + row["blocks"] * block + bandwidth.HEADROOM_BYTES <= device, row
        else:
            assert "GiB" in row["reason"], row
    runs = {(r["batch"], r["tokens"]) for r in plan["decode"] if r["fits"]}
    assert (64, 8192) not in runs and {(32, 8192), (64, 2048)} <= runs, runs
    assert all(r["fits"] for r in plan["prefill"])
    h200 = bandwidth.plan_rows(GPU, free_bytes=139 * GIB - weights)
    assert all(r["fits"] for r in h200["decode"] + h200["prefill"])


def test_a_cuda_graph_failure_fails_the_bandwidth_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpu_sections import bandwidth
    from gpu_sections.scale import DRY

    from appliance.engine.model_runner import ModelRunner

    def capture_fails(self: ModelRunner, max_num_seqs: int, max_len: int) -> bool:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(ModelRunner, "use_decode_graphs", capture_fails)
    section = bandwidth.section_bandwidth(DRY)
    assert section["cuda_graphs"]["status"] == "error"
    assert "stream is capturing" in section["cuda_graphs"]["error"]
    assert section["status"] == "fail" and section["failed"], section["checks"]


def recorded_gpus() -> dict[str, Any]:
    """topology.discover's mapping of a recorded NVML box (tests/topology/test_topology.py's
    MIXED: two H100s and an RTX 4090), as the environment section records it."""
    from nvml_boxes import MIXED, FakeNvml

    from appliance.topology.cuda_order import TorchFacts
    from appliance.topology.discovery import HostFacts, discover

    count = len(MIXED["gpus"])
    found = discover(
        "cuda", 2, nvml=FakeNvml(MIXED), host=HostFacts(),
        torch_facts=TorchFacts("2.x", "12.8", True, count),
    )  # fmt: skip
    return {"setting": "cuda", "devices": [dataclasses.asdict(d) for d in found.devices]}


@pytest.mark.parametrize("swapped", [False, True])
def test_a_swapped_ordinal_fails_the_uuid_check(
    monkeypatch: pytest.MonkeyPatch, swapped: bool
) -> None:
    """torch's cuda:i must be the GPU whose NVML UUID discovery gave ordinal i."""
    from gpu_sections import environment
    from gpu_sections.scale import GPU

    mapping = recorded_gpus()
    gpus = mapping["devices"]
    uuids = [d["uuid"].removeprefix("GPU-") for d in gpus]  # torch's form: no prefix
    if swapped:
        uuids[0], uuids[1] = uuids[1], uuids[0]
    seen = [
        {"ordinal": d["ordinal"], "name": d["name"], "uuid": u}
        for d, u in zip(gpus, uuids, strict=True)
    ]
    monkeypatch.setattr(environment, "discovered_devices", lambda scale: (mapping, None))
    monkeypatch.setattr(environment, "torch_facts", lambda: {"devices": seen})
    monkeypatch.setattr(environment, "nvidia_facts", dict)
    monkeypatch.setattr(environment, "missing_modules", list)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    section = environment.section_environment(GPU)
    check = "torch's UUID for each GPU's ordinal is the one NVML gave it"
    assert section["checks"][check] is not swapped
    assert section["checks"]["discover maps every GPU to a torch ordinal"]
    assert len(section["uuid_mismatches"]) == (2 if swapped else 0)
    assert section["status"] == ("fail" if swapped else "pass"), section["failed"]


def test_missing_modules_imports_each_module(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A module that is found but fails to import is missing (a wheel for another
    Python, a dependency missing)."""
    from gpu_sections import environment

    (tmp_path / "found_but_broken.py").write_text("import a_dependency_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        environment, "NEEDED_MODULES", {"json": "json", "found_but_broken": "broken-dist"}
    )
    missing = environment.missing_modules()
    assert len(missing) == 1 and missing[0].startswith("broken-dist (ModuleNotFoundError")
