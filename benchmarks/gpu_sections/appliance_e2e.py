"""Section 5, appliance: the appliance end to end with 1 prefill + 1 decode worker on the
one GPU (the decode worker pulls KV over CUDA IPC; in the dry run two CPU devices and
shared memory): greedy parity with the in-process engine, a burst of concurrent
requests, a SIGKILLed prefill worker the decode worker survives, every KV block free."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from typing import TYPE_CHECKING, Any

import torch

from .common import Result, random_ids, settings_for, verdict
from .measure import free_memory
from .scale import Scale

if TYPE_CHECKING:
    from appliance.api import Appliance
    from appliance.engine.sequence import SamplingParams
    from appliance.pools.supervisor import Supervisor
    from appliance.topology.devices import Topology


QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What do bees make?",
    "Name a planet.",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
]


def one_gpu_as_two_devices() -> Topology:
    """Devices 0 and 1 of the appliance, both on the GPU torch calls cuda:0."""
    from appliance.topology.devices import Device, Topology

    props = torch.cuda.get_device_properties(0)
    memory = props.total_memory
    gpus = [Device("cuda", i, props.name, memory, memory, ordinal=0) for i in (0, 1)]
    return Topology.without_links(gpus)


def two_cpu_devices() -> Topology:
    """Two CPU devices over this process's cores (sharing one when there is one)."""
    from appliance.topology.cpu import cpu_devices
    from appliance.topology.devices import Topology

    return Topology.without_links(cpu_devices(2, share_cores=True))


def section_appliance(scale: Scale) -> Result:
    """1 prefill + 1 decode worker (on the one GPU: the decode worker pulls KV through a
    CUDA IPC handle of the prefill worker's pool; on the CPU through shared memory):
    greedy parity with the in-process engine, a burst of concurrent requests, a SIGKILLed
    prefill worker restarted while the decode worker carries on, every block free."""
    from appliance.engine.llm_engine import LLMEngine
    from appliance.engine.sequence import SamplingParams

    engine = LLMEngine.from_settings(settings_for(scale, "float32", kv={"memory_mb": 512}))
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS
    ]
    greedy = SamplingParams(max_tokens=scale.answer_tokens)
    expected = [c.token_ids for c in engine.generate(prompts, greedy)]
    vocab = engine.model.config.vocab_size
    del engine
    free_memory()
    rng = random.Random(2)
    burst = [
        random_ids(rng, rng.randint(*scale.burst_prompt), vocab)
        for _ in range(scale.burst_requests)
    ]
    burst_params = SamplingParams(max_tokens=scale.burst_tokens, ignore_eos=True)
    run = asyncio.run(appliance_run(scale, prompts, greedy, burst, burst_params))
    same = [got == want for got, want in zip(run["answers"], expected, strict=True)]
    checks = {
        f"greedy parity with the in-process engine ({sum(same)}/{len(same)})": all(same),
        f"{len(burst)} concurrent requests got {scale.burst_tokens} tokens each": all(
            n == scale.burst_tokens for n in run["burst_tokens"]
        ),
        "every KV block free after the burst": all_free(run["blocks_after_burst"]),
        "the decode worker lived through the prefill worker's SIGKILL": run["kill"]["decode_same"],
        "answers after the restart equal the expected": run["kill"]["answers"] == expected[:2],
        "every KV block free at the end": all_free(run["blocks_at_end"]),
    }
    run["first_difference"] = first_difference(run["answers"], expected)
    return verdict(
        checks,
        summary=f"parity {sum(same)}/{len(same)}, burst {len(burst)} in {run['burst_s']} s, "
        f"prefill restart {run['kill']['restart_s']} s, KV over "
        f"{'CUDA IPC' if scale.cuda else 'shared memory'}",
        **{k: v for k, v in run.items() if k != "answers"},
    )


def all_free(counts: dict[Any, tuple[int, int]]) -> bool:
    return bool(counts) and all(free == total for free, total in counts.values())


def first_difference(got: list[list[int]], want: list[list[int]]) -> list[dict[str, Any]]:
    """Where each differing answer leaves the expected tokens."""
    diffs = []
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            at = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            diffs.append(
                {"question": index, "token": at, "got": a[at : at + 4], "want": b[at : at + 4]}
            )
    return diffs


async def appliance_run(
    scale: Scale,
    prompts: list[list[int]],
    greedy: SamplingParams,
    burst: list[list[int]],
    burst_params: SamplingParams,
) -> dict[str, Any]:
    """The appliance's side of section 4; every phase has its own deadline."""
    from appliance.api import Appliance

    # Two workers share the GPU: each may take 40% of it for weights, a step and its pool.
    kv = {"gpu_memory_utilization": 0.4} if scale.cuda else {"memory_mb": 128}
    settings = settings_for(
        scale,
        "float32",
        mode="disaggregated",
        prefill_devices="0",
        decode_devices="1",
        kv=kv,
    )
    topology = one_gpu_as_two_devices() if scale.cuda else two_cpu_devices()
    start = time.monotonic()
    async with Appliance(settings, topology) as app:
        run: dict[str, Any] = {"start_s": round(time.monotonic() - start, 1)}
        run["workers"] = worker_facts(app)
        run["answers"] = await asyncio.wait_for(generate_all(app, prompts, greedy), 180)
        start = time.monotonic()
        outputs = await asyncio.wait_for(generate_all(app, burst, burst_params), 240)
        run["burst_s"] = round(time.monotonic() - start, 2)
        run["burst_tokens"] = [len(tokens) for tokens in outputs]
        run["blocks_after_burst"] = await wait_all_free(app.supervisor)
        run["kill"] = await kill_prefill(app, prompts[:2], greedy)
        run["workers_after_restart"] = worker_facts(app)
        run["blocks_at_end"] = await wait_all_free(app.supervisor)
    return run


def worker_facts(app: Appliance) -> list[dict[str, Any]]:
    """Each worker's role, process and KV pool (blocks and the tokens they hold)."""
    block = app.settings.kv.block_size
    return [
        {
            "role": w.role,
            "pid": w.process.pid,
            "kv_blocks": w.num_blocks,
            "kv_tokens": w.num_blocks * block,
        }
        for w in app.supervisor.workers.values()
    ]


async def generate_all(
    app: Appliance, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Every prompt's tokens, all requests in flight together."""

    async def one(ids: list[int]) -> list[int]:
        return [t async for chunk in app.generate(ids, params=params) for t in chunk.token_ids]

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def wait_all_free(supervisor: Supervisor, timeout: float = 15.0) -> dict:
    """Block counts come with each worker's reports: wait for the last ones to arrive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = supervisor.block_counts()
        if all_free(counts):
            break
        await asyncio.sleep(0.05)
    return {str(k): v for k, v in supervisor.block_counts().items()}


async def kill_prefill(
    app: Appliance, prompts: list[list[int]], params: SamplingParams
) -> dict[str, Any]:
    """SIGKILL the prefill worker (whose pool the decode worker has mapped); wait until a
    new one is ready; answer again. The decode worker must be the same process after."""
    supervisor = app.supervisor
    prefill = next(w for w in supervisor.workers.values() if w.role == "prefill")
    decode = next(w for w in supervisor.workers.values() if w.role == "decode")
    old_pid, decode_pid = prefill.process.pid, decode.process.pid
    os.kill(old_pid, signal.SIGKILL)
    start = time.monotonic()
    await asyncio.wait_for(worker_back(supervisor, "prefill", old_pid), 180)
    restart_s = round(time.monotonic() - start, 1)
    answers = await asyncio.wait_for(generate_all(app, prompts, params), 120)
    decodes = [w for w in supervisor.workers.values() if w.role == "decode" and w.alive]
    same = [w.process.pid for w in decodes] == [decode_pid]
    return {"restart_s": restart_s, "decode_same": same, "answers": answers}


async def worker_back(supervisor: Supervisor, role: str, old_pid: int) -> None:
    """Until a ready worker of `role` other than process old_pid serves."""
    while not any(
        w.role == role and w.ready and w.alive and w.process.pid != old_pid
        for w in supervisor.workers.values()
    ):
        await asyncio.sleep(0.1)
