"""A follower shard of a tensor-parallel worker: its part of the model and of the KV pool,
run step by step as its leader commands (see workers/shard_group.py).

Started by the leader as `python -m appliance.workers.shard_follower` with a pickled
FollowerSpec on stdin.
"""

from __future__ import annotations

import gc
import multiprocessing
import pickle
import signal
import sys
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from appliance.engine.model_runner import forward, move_to
from appliance.engine.shard_loading import ShardParts, load_shard
from appliance.engine.speculative.draft_loading import smaller_pool
from appliance.model.tensor_parallel import Shard, shard_plan
from appliance.workers.lifetime import die_with_parent
from appliance.workers.shard_group import (
    FollowerSpec,
    ResizeKV,
    RunStep,
    ShareKV,
    Stop,
    join_group,
    pickle_pool,
)
from appliance.workers.worker import use_device


def serve(spec: FollowerSpec) -> None:
    """Join the group, load this shard, then follow commands until Stop."""
    multiprocessing.current_process().authkey = spec.authkey
    settings = use_device(spec.settings, spec.device)
    store = dist.TCPStore(
        "127.0.0.1", spec.port, world_size=spec.size, is_master=False,
        timeout=timedelta(seconds=settings.recovery.start_timeout_s),
    )  # fmt: skip
    links = join_group(store, spec.rank, spec.size, spec.device, settings.recovery)
    commands = links.commands
    shard = Shard(spec.rank, spec.size)
    parts = load_shard(settings, shard, links.all_reduce, shared_kv=True)
    head_start = shard_plan(parts.files.config, shard).kv_heads.start
    gc.freeze()  # as a worker does once loaded (worker.py): its exit scans none of it
    while True:
        received: list[Any] = [None]
        dist.broadcast_object_list(received, src=0, group=commands)
        command = received[0]
        if isinstance(command, RunStep):
            run_step(parts, command)
        elif isinstance(command, ShareKV):
            pool = pickle_pool(head_start, parts.kv.tensor)
            dist.gather_object(pool, None, dst=0, group=commands)
        elif isinstance(command, ResizeKV):
            parts = replace(parts, kv=smaller_pool(parts.kv, command.num_blocks))
        elif isinstance(command, Stop):
            dist.destroy_process_group()
            return
        else:
            raise TypeError(f"unknown command {command!r}")


def run_step(parts: ShardParts, command: RunStep) -> None:
    """This shard's part of the leader's step (its all-reduces meet the others')."""
    inputs = move_to(command.inputs, parts.model.device)
    forward(parts.model, inputs, parts.kv.tensor)


def main() -> None:
    spec = pickle.load(sys.stdin.buffer)
    die_with_parent(spec.leader_pid)
    # Ctrl-C reaches the whole process group; the leader decides when its shards stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(spec)


if __name__ == "__main__":
    main()
