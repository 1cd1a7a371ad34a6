"""The process that times one worker size for `appliance profile` (see profiler.py): bound
to its device as a worker is, it loads the model, times the step shapes alone, then again
while processes on the box's other devices run steps, and answers with what it measured."""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
import traceback
from typing import Any

import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.kv.handoff import copy_blocks
from appliance.model.model_source import default_model_path
from appliance.model.quant import QuantLinear
from appliance.planner.fitting import fit_step_cost
from appliance.planner.profile import model_id
from appliance.planner.profiler import UnitRun
from appliance.planner.step_probe import StepProbe, StepShape, default_shapes, time_engine_steps
from appliance.settings.config import Settings
from appliance.topology.cpu import cpu_model_name
from appliance.workers.worker import use_device

BUSY_SHAPES = (StepShape(decodes=(256,) * 16), StepShape(chunks=((0, 256),)))


def measure_unit(
    settings: Settings, run: UnitRun, quick: bool, time_handoff: bool, results: Any
) -> None:
    """Process entry point: put the measurements (or {'error': ...}) on `results`; with
    `time_handoff`, a handoff's block copy too (one worker size's is the box's)."""
    try:
        results.put(_measure(settings, run, quick, time_handoff))
    except Exception as exc:  # the parent reports it; a traceback here would be lost
        results.put({"error": f"{exc!r}\n{traceback.format_exc()}"})


def _measure(settings: Settings, run: UnitRun, quick: bool, time_handoff: bool) -> dict[str, Any]:
    settings = use_device(settings, run.device)
    engine = LLMEngine.from_settings(settings)
    # Medians of 3 even when quick: one run can land on a moment another process took.
    probe = StepProbe(engine, repeats=3)
    capacity = engine.kv.num_blocks * engine.kv.block_size
    shapes = default_shapes(capacity, settings.batch.chunk_size, engine.kv.block_size)
    if quick:
        shapes = shapes[::2]
    samples = [probe.time(shape) for shape in shapes]
    contention = _contention(settings, run, probe, shapes) if run.busy else 1.0
    model_step = probe.time(StepShape(decodes=(24,) * 8)).seconds
    measured = {
        "unit": run.unit,
        "model": model_id(settings.model or default_model_path()),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "weights": "quantized" if _quantized(engine) else "dense",
        "device_kind": _device_kind(run),
        "samples": [s.as_dict() for s in samples],
        "contention": contention,
        "kv_blocks": engine.kv.num_blocks,
        "block_size": engine.kv.block_size,
        "kv_bytes_per_token": engine.kv.layout.bytes_per_block() // engine.kv.block_size,
        "max_model_len": engine.scheduler.max_model_len,
        "loop_s": max(0.0, time_engine_steps(engine, 8, 8 if quick else 16) - model_step),
    }
    if time_handoff:
        measured["copy_base_s"], measured["copy_per_byte_s"] = _copy_cost(engine)
    return measured


def _contention(
    settings: Settings, run: UnitRun, probe: StepProbe, shapes: list[StepShape]
) -> float:
    """How much slower this worker's steps run while the other devices run steps too: the
    median ratio over a few decode and prompt shapes, timed alone and under load."""
    picked = [s for s in shapes if s.kind == "decode"][-2:] + [
        s for s in shapes if s.kind == "prefill"
    ][-2:]
    alone = [probe.time(shape).seconds for shape in picked]
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Semaphore(0)
    others = [
        ctx.Process(target=busy_loop, args=(settings, device, ready, stop), daemon=True)
        for device in run.busy
    ]
    for other in others:
        other.start()
    try:
        for _ in others:
            if not ready.acquire(timeout=180):
                raise RuntimeError("a process meant to load the other devices did not start")
        loaded = [probe.time(shape).seconds for shape in picked]
    finally:
        stop.set()
        for other in others:
            other.join(timeout=30)
            if other.is_alive():
                other.kill()
    return statistics.median(b / a for a, b in zip(alone, loaded, strict=True))


def busy_loop(settings: Settings, device: Any, ready: Any, stop: Any) -> None:
    """Process entry point: run steps on `device` until `stop` is set, as a busy worker
    does; `ready` is released once the steps have begun."""
    settings = use_device(settings, device)
    probe = StepProbe(LLMEngine.from_settings(settings), repeats=1)
    probe.time(BUSY_SHAPES[0])
    ready.release()
    turn = 0
    while not stop.is_set():
        probe.time(BUSY_SHAPES[turn % len(BUSY_SHAPES)])
        turn += 1


def _copy_cost(engine: LLMEngine) -> tuple[float, float]:
    """A handoff's copy, fitted as base + per byte: blocks copied between two pools of
    this engine's layout on its device (a decode worker pulls them the same way)."""
    pool = engine.kv.tensor
    blocks = min(256, pool.shape[2] // 2)
    source = torch.empty_like(pool[:, :, :blocks])
    if source.device.type == "cpu":
        source.share_memory_()  # where a prefill worker's pool lives
    samples = []
    for count in sorted({1, 4, 16, 64, blocks} & set(range(1, blocks + 1))):
        ids = list(range(count))
        times = []
        for _ in range(5):
            began = time.perf_counter()
            moved = copy_blocks(source, ids, pool, ids)
            if pool.is_cuda:
                torch.cuda.synchronize(pool.device)
            times.append(time.perf_counter() - began)
        samples.append({"seqs": moved, "seconds": statistics.median(times)})
    cost = fit_step_cost(samples, ("seqs",))  # "seqs" stands for bytes here
    return cost.base_s, cost.per_seq_s


def _quantized(engine: LLMEngine) -> bool:
    return any(isinstance(m, QuantLinear) for m in engine.model.modules())


def _device_kind(run: UnitRun) -> str:
    if run.device.kind == "cuda":
        return f"cuda: {run.device.name}"
    from appliance.model.cpu_kernels import loading

    return f"cpu: {cpu_model_name()} (kernels {loading.level() or 'none'})"
