"""Driving the in-process Appliance with real worker processes: greedy questions, CPU
devices pinned to this machine's cores, every prompt run at once with its timestamps
checked, and waiting for the KV pools to be free. Shared by the runtime and tensor
parallel tests."""

from __future__ import annotations

import asyncio
import os

from appliance.api import Appliance
from appliance.engine.sequence import SamplingParams
from appliance.pools.supervisor import Supervisor
from appliance.topology.devices import Device, Topology

GREEDY = SamplingParams(max_tokens=16)
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What do bees make?",
    "Name a planet.",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
    "What color is the sky?",
    "Name a fruit that is yellow.",
    "What is ice made of?",
    "Which animal barks?",
    "What is the first letter of the alphabet?",
    "Name a musical instrument.",
    "What do plants need to grow?",
    "What is a baby cat called?",
]


def cpu_topology(*core_sets: tuple[int, ...]) -> Topology:
    """One CPU device per core set, its cores mapped onto the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    devices = [
        Device("cpu", i, f"cpu{c}", 0, 0, cores=tuple(cores[x % len(cores)] for x in c))
        for i, c in enumerate(core_sets)
    ]
    return Topology.without_links(devices)


async def run_all(app: Appliance, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt generated greedily at once; each one's timestamps checked."""

    async def one(ids: list[int]) -> list[int]:
        tokens = []
        async for chunk in app.generate(ids, params=GREEDY):
            tokens += chunk.token_ids
        handed_off = app.settings.mode == "disaggregated" and not app.settings.colocated_devices
        check_timing(chunk.timing, handed_off)
        return tokens

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def check_timing(timing: dict[str, float], handed_off: bool) -> None:
    """The last chunk carries the request's timestamps, in the order things happened
    (a handoff's when every request is handed off, and whenever one was)."""
    order = ["arrival", "prefill_start", "first_token", "finished"]
    if handed_off or "handoff" in timing:
        order.insert(3, "handoff")
    values = [timing[name] for name in order]
    assert values == sorted(values), timing


async def wait_all_free(supervisor: Supervisor, timeout: float = 10.0) -> dict:
    """Block counts come with each worker's reports: wait for the last ones to arrive."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        counts = supervisor.block_counts()
        if all(free == total for free, total in counts.values()):
            return counts
        await asyncio.sleep(0.05)
    return supervisor.block_counts()
