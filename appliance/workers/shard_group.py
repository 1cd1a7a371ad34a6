"""A worker's tensor-parallel group, seen from its leader (shard 0).

A worker over several devices runs one process per shard. The supervisor talks to the
leader only: it schedules, samples and answers as a one-device worker does. The leader
starts the other shards (workers/shard_follower.py), and before each model step hands them
the step's inputs; every shard then runs the same forward over its own heads and MLP
columns, meeting in torch.distributed all-reduces (NCCL on GPUs, gloo on the CPU).
Commands travel on a gloo group, pickled. Followers die with their leader (a Linux
parent-death signal), and a follower that dies breaks the leader's next collective, so
the supervisor sees one worker crash and restarts the group.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing  # registers the tensor reducers ForkingPickler uses

from appliance.engine.model_runner import StepInputs
from appliance.kv.handoff import KVShard
from appliance.settings.config import RecoverySettings, Settings
from appliance.topology.devices import Device

STOP_WAIT_S = 10.0  # how long followers get to exit after Stop before they are killed
WATCH_S = 0.2  # how often the leader looks whether a follower has died
# Followers block on the next command for as long as the worker is idle: no deadline.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class FollowerSpec:
    """What a follower process starts from (pickled onto its stdin)."""

    rank: int
    size: int
    port: int  # the leader's TCPStore
    settings: Settings
    device: Device
    authkey: bytes  # the leader's, so shared-memory fds pass between the processes
    leader_pid: int


@dataclass(frozen=True)
class RunStep:
    """Run the model over these inputs (the leader runs them too)."""

    inputs: StepInputs


@dataclass(frozen=True)
class ShareKV:
    """Pickle your KV pool once more and gather (first head, bytes) to the leader."""


@dataclass(frozen=True)
class ResizeKV:
    """Remake your KV pool with this many blocks (the leader's, after a draft model took
    part of its budget: every shard's pool has the same blocks)."""

    num_blocks: int


@dataclass(frozen=True)
class Stop:
    """Leave the process group and exit."""


def backend_for(device: Device) -> str:
    """The collectives' backend for shards on `device`'s kind."""
    return "nccl" if device.kind == "cuda" else "gloo"


@dataclass(frozen=True)
class GroupLinks:
    """A shard's two process groups over the same processes."""

    compute: dist.ProcessGroup  # the all-reduces: a peer silent past the stall timeout fails
    commands: dist.ProcessGroup  # gloo, waits for the next step as long as the worker idles

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a shard's partial output over the group, in place."""
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":
            # gloo sums float32 and float16 only; the sum in float32 rounds once at the end.
            total = x.float()
            dist.all_reduce(total, group=self.compute)
            return x.copy_(total)
        dist.all_reduce(x, group=self.compute)
        return x


def join_group(
    store: dist.Store, rank: int, size: int, device: Device, recovery: RecoverySettings
) -> GroupLinks:
    """Join the group (within recovery.start_timeout_s) and open its two process groups;
    one all-reduce proves the links before the worker says it is ready."""
    # The shards of one box talk over loopback, never over the host's other interfaces.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=recovery.start_timeout_s),
    )
    stall = timedelta(seconds=recovery.stall_timeout_s)
    links = GroupLinks(
        dist.new_group(backend=backend_for(device), timeout=stall),
        dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT),
    )
    probe = torch.ones(1, device="cuda" if device.kind == "cuda" else "cpu")
    links.all_reduce(probe)
    if probe.item() != size:
        raise RuntimeError(f"tensor-parallel group of {size} summed ones to {probe.item()}")
    return links


def pickle_pool(
    head_start: int, tensor: torch.Tensor, ready: torch.cuda.Event | None = None
) -> tuple[int, bytes]:
    """A pool as another process opens it: each pickle is one fd / IPC reference, with the
    IPC handle of the owner's handoff event where it has one (a CUDA prefill worker's
    first shard: see KVShard.ready)."""
    handle = None if ready is None else ready.ipc_handle()
    return head_start, bytes(ForkingPickler.dumps((tensor, handle)))


def unpickle_pool(data: bytes) -> tuple[torch.Tensor, bytes | None]:
    """One pool pickled by pickle_pool, mapped into this process, and its event's handle."""
    tensor, handle = ForkingPickler.loads(data)
    return tensor, handle


def open_pools(pools: list[tuple[int, bytes]]) -> list[KVShard]:
    """Pools pickled by pickle_pool (in other processes), mapped into this one, their
    handoff events opened on the device of their pool."""
    shards = []
    for head, data in pools:
        tensor, handle = unpickle_pool(data)
        ready = None if handle is None else torch.cuda.Event.from_ipc_handle(tensor.device, handle)
        shards.append(KVShard(head, tensor, ready))
    return shards


class TensorGroup:
    """The leader's handle on its followers (see the module docstring)."""

    def __init__(
        self,
        store: dist.Store,
        processes: list[subprocess.Popen],
        links: GroupLinks,
        stopping: threading.Event,
    ) -> None:
        self.size = len(processes) + 1
        self._stopping = stopping  # tells the watch thread the followers may exit now
        self.pids = [p.pid for p in processes]  # shards 1.. in order
        self._store = store  # the TCPStore lives as long as the group
        self._processes = processes
        self._links = links
        self._commands = links.commands

    @classmethod
    def start(cls, settings: Settings, devices: tuple[Device, ...]) -> TensorGroup:
        """Start one follower per device after the first (this process's) and join them."""
        size = len(devices)
        timeout_s = settings.recovery.start_timeout_s
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size=size, is_master=True,
            timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
        )  # fmt: skip
        authkey = bytes(multiprocessing.current_process().authkey)
        processes = [
            _spawn(FollowerSpec(rank, size, store.port, settings, device, authkey, os.getpid()))
            for rank, device in enumerate(devices[1:], start=1)
        ]
        stopping = threading.Event()
        watch = threading.Thread(target=_watch, args=(processes, stopping), daemon=True)
        watch.start()
        try:
            links = join_group(store, 0, size, devices[0], settings.recovery)
        except Exception:
            _kill(processes)
            raise
        return cls(store, processes, links, stopping)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum this shard's partial output with the followers'."""
        return self._links.all_reduce(x)

    def run_step(self, inputs: StepInputs) -> None:
        """Hand the followers this step's inputs; the leader then runs it too."""
        # Host tensors (ModelRunner.prepare): each follower moves them to its own device.
        self._send(RunStep(inputs))

    def share_pools(self) -> list[tuple[int, bytes]]:
        """The followers' pools, each pickled by its own process for one consumer."""
        self._send(ShareKV())
        gathered: list[Any] = [None] * self.size
        dist.gather_object(None, gathered, dst=0, group=self._commands)
        return gathered[1:]

    def kv_shards(self) -> list[KVShard]:
        """The followers' pools, opened in this process (the handoff copies into them)."""
        return open_pools(self.share_pools())

    def resize_kv(self, num_blocks: int) -> None:
        """Give every follower's pool `num_blocks` blocks (before any handoff: a pool
        already opened elsewhere keeps the old memory)."""
        self._send(ResizeKV(num_blocks))

    def close(self) -> None:
        """Stop the followers (killing any that linger) and leave the process group."""
        self._stopping.set()
        # A follower already gone breaks the broadcast; the rest are killed below.
        with contextlib.suppress(Exception):
            self._send(Stop())
        deadline = time.monotonic() + STOP_WAIT_S
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
        _kill(self._processes)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _send(self, command: Any) -> None:
        dist.broadcast_object_list([command], src=0, group=self._commands)


def _spawn(spec: FollowerSpec) -> subprocess.Popen:
    # A plain subprocess: this worker is a daemonic multiprocessing child, which may not
    # have multiprocessing children of its own. It imports what this process imports.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance.workers.shard_follower"],
        stdin=subprocess.PIPE,
        env=env,
    )
    assert process.stdin is not None  # asked for with stdin=PIPE
    process.stdin.write(pickle.dumps(spec))
    process.stdin.close()
    return process


def _watch(processes: list[subprocess.Popen], stopping: threading.Event) -> None:
    """Exit this worker as soon as a follower dies (at start, or during an NCCL step that
    would otherwise wait for it until the stall timeout): the supervisor then restarts
    the whole group."""
    while not stopping.wait(WATCH_S):
        dead = [p for p in processes if p.poll() is not None]
        if dead and not stopping.is_set():
            print(
                f"tensor-parallel shard (pid {dead[0].pid}) exited with code "
                f"{dead[0].returncode}; stopping its group",
                file=sys.stderr,
                flush=True,
            )
            _kill(processes)
            os._exit(1)


def _kill(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
