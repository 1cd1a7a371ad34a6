"""`appliance profile`: measure what this box's steps cost for the configured model.

Each worker size the box can form is timed in its own process, bound to its device as a
worker is (its cores, or its GPU): prompt chunks, decode batches and mixed steps (see
step_probe.py), fitted to the linear step costs the simulator reads. On a CPU box the
same steps are timed again while processes on the other cores run steps too (they share
memory bandwidth and caches): the ratio is the worker's `contention`. A KV handoff is
timed as the copy a decode worker makes plus the messages around it; the host's share as
an engine step's time beyond its model step, and a message's trip between processes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appliance.planner.fitting import both_regimes, fit_step_cost, in_regimes, regime_sample
from appliance.planner.profile import (
    HandoffCost,
    HostCost,
    Profile,
    ProfileKey,
    StepCost,
    WorkerCost,
    worker_unit,
)
from appliance.settings.config import Settings
from appliance.topology.cpu import cpu_devices
from appliance.topology.devices import Device

Progress = Callable[[str], None]
UNIT_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class UnitRun:
    """One worker size to time: its device, and the devices kept busy meanwhile."""

    unit: str
    device: Device
    busy: tuple[Device, ...] = ()


def cpu_unit_runs(cores: int) -> list[UnitRun]:
    """The worker sizes of a CPU box of `cores` cores: the whole box, half and a quarter
    of it (those that divide it), each timed on its first device with the others busy."""
    sizes = sorted({s for s in (cores, cores // 2, cores // 4) if s >= 1 and cores % s == 0})
    runs = []
    for size in sizes:
        devices = cpu_devices(cores // size)
        runs.append(UnitRun(worker_unit(size, 1), devices[0], devices[1:4]))
    return runs


def gpu_unit_runs(devices: tuple[Device, ...]) -> list[UnitRun]:
    """The worker sizes timed on a GPU box: one GPU (tensor-parallel workers are not timed
    yet; the planner takes them from an analytic profile). GPUs do not share memory
    bandwidth: nothing is kept busy meanwhile."""
    return [UnitRun(worker_unit(1, 1), devices[0])]


def profile_box(
    settings: Settings,
    runs: list[UnitRun],
    atoms: int,
    quick: bool = False,
    progress: Progress = print,
) -> Profile:
    """Time every run's worker size on a box of `atoms` cores or GPUs; the profile of this
    box for the configured model."""
    measured = []
    for index, run in enumerate(runs):
        progress(f"timing worker size {run.unit} on {run.device.name}")
        measured.append(_measure_in_child(settings, run, quick, time_handoff=index == 0))
    first = measured[0]
    message_s = message_seconds(50 if quick else 200)
    workers = {m["unit"]: _worker_cost(m) for m in measured}
    samples = tuple({"unit": m["unit"], **s} for m in measured for s in m["samples"])
    return Profile(
        key=ProfileKey(
            model=first["model"],
            dtype=first["dtype"],
            weights=first["weights"],
            device_kind=first["device_kind"],
        ),
        atoms=atoms,
        block_size=first["block_size"],
        kv_bytes_per_token=first["kv_bytes_per_token"],
        max_model_len=first["max_model_len"],
        workers=workers,
        handoff=HandoffCost(
            base_s=first["copy_base_s"] + 2 * message_s,
            per_byte_s=first["copy_per_byte_s"],
        ),
        host=HostCost(
            per_step_s=statistics.median(m["loop_s"] for m in measured),
            per_token_s=message_s + encode_seconds(),
        ),
        assumptions=(
            "handoff: the copy of a request's blocks plus two messages between processes",
            "host per token: one message between processes plus encoding an SSE chunk",
        ),
        samples=samples,
    )


def _worker_cost(measured: dict[str, Any]) -> WorkerCost:
    samples = measured["samples"]
    by_kind = {kind: [s for s in samples if s["kind"] == kind] for kind in ("prefill", "decode")}
    return WorkerCost(
        prefill=_fit_regimes(by_kind["prefill"], ("tokens", "seqs", "attended")),
        # A decode step's tokens are its sequences: one feature, not two.
        decode=fit_step_cost(by_kind["decode"], ("seqs", "context")),
        mixed=_fit_regimes(samples, ("tokens", "seqs", "attended", "context")),
        kv_blocks=measured["kv_blocks"],
        contention=max(1.0, measured["contention"]),
    )


def _fit_regimes(samples: list[dict[str, Any]], features: tuple[str, ...]) -> StepCost:
    """fit_step_cost, with a line per side of the quantized kernels' switch to a GEMM
    (StepCost.gemm_rows) where the samples say where it is and show two prompt sizes on
    each side; else one line."""
    gemm_rows = samples[0].get("gemm_rows") if samples else None
    if gemm_rows is not None:
        regimed = [regime_sample(s, gemm_rows) for s in samples]
        # Each sample is a size's mean over repeats: two sizes a side are enough.
        if both_regimes((s["gemm"] == 1.0, float(s["tokens"])) for s in regimed):
            return fit_step_cost(regimed, in_regimes(features), gemm_rows)
    return fit_step_cost(samples, features)


def _measure_in_child(
    settings: Settings, run: UnitRun, quick: bool, time_handoff: bool
) -> dict[str, Any]:
    """Time one worker size in a process bound to its device, as a worker is."""
    from appliance.planner.unit_timing import measure_unit

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # Not a daemon: it starts the processes that keep the other devices busy.
    child = ctx.Process(target=measure_unit, args=(settings, run, quick, time_handoff, results))
    child.start()
    try:
        outcome = results.get(timeout=UNIT_TIMEOUT_S)
    except Exception:  # queue.Empty, or the child died before answering
        raise RuntimeError(f"timing worker size {run.unit} gave no answer") from None
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if "error" in outcome:
        raise RuntimeError(f"timing worker size {run.unit} failed: {outcome['error']}")
    return outcome


def message_seconds(rounds: int = 200) -> float:
    """One-way time of a small message between two processes (half a round trip)."""
    ctx = mp.get_context("spawn")
    to_child, back = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_echo, args=(to_child, back), daemon=True)
    child.start()
    try:
        to_child.put(0)
        back.get(timeout=60)  # started
        trips = []
        for i in range(rounds):
            began = time.perf_counter()
            to_child.put(i)
            back.get(timeout=10)
            trips.append(time.perf_counter() - began)
        return statistics.median(trips) / 2
    finally:
        to_child.put(None)
        child.join(timeout=10)


def _echo(inbox: Any, outbox: Any) -> None:
    while (item := inbox.get()) is not None:
        outbox.put(item)


def encode_seconds(rounds: int = 2000) -> float:
    """Encoding one streamed token as an OpenAI SSE chunk."""
    chunk = {
        "id": "cmpl-0123456789abcdef",
        "object": "text_completion",
        "created": 1700000000,
        "model": "model",
        "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}],
    }
    began = time.perf_counter()
    for _ in range(rounds):
        (b"data: " + json.dumps(chunk).encode() + b"\n\n").decode()
    return (time.perf_counter() - began) / rounds
