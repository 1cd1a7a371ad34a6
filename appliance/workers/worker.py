"""A worker subprocess: one engine on one device (a core set on the CPU), driven by messages.

Roles: "prefill" runs prompts to their first token and parks their blocks for a decode
worker; "decode" pulls parked blocks from a prefill worker's shared pool and decodes;
"colocated" does both in one engine (chunked prefill mixed into decode steps).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import queue
import socket
import time
from dataclasses import dataclass, field, replace
from multiprocessing.queues import Queue

import torch
import torch.multiprocessing  # registers the tensor reducers ForkingPickler uses

from appliance.core.roles import Role
from appliance.engine.kernel_warmup import warm_up
from appliance.engine.llm_engine import LLMEngine, RequestOutput
from appliance.engine.speculative.proposer import reported_totals
from appliance.kv.handoff import KVShard, reading_from
from appliance.kv.remote import KVTransfer, RemoteSource
from appliance.kv.remote_pool import RemotePool
from appliance.settings.cluster import ClusterSettings
from appliance.settings.config import Settings
from appliance.topology.cpu import pin_to_cores
from appliance.topology.devices import Device
from appliance.tracing.exporting import start_exporting
from appliance.tracing.spans import Attributes
from appliance.tracing.worker_spans import WorkerSpans
from appliance.workers.lifetime import die_with_supervisor
from appliance.workers.messages import (
    Abort,
    DropPeer,
    Failed,
    Handoff,
    HandoffResult,
    LeaseExpired,
    Output,
    PeerDropped,
    PeerPool,
    PoolShared,
    Ready,
    Release,
    SharePool,
    Shutdown,
    StoreHits,
    StoreSlots,
    Submit,
    TokenBatch,
    ToWorker,
    Tune,
)
from appliance.workers.outboxes import Outbox
from appliance.workers.shard_group import TensorGroup, open_pools, pickle_pool
from appliance.workers.store_client import StoreClient

IDLE_WAIT_S = 0.05  # how long an idle worker blocks on its inbox before looking again
COPY_POLL_S = 0.0005  # how often one with only handed-off copies in flight looks at them
LEASE_S = 30.0  # parked blocks nobody pulled within this are freed
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # as `appliance serve`'s

log = logging.getLogger("appliance.worker")


@dataclass
class WorkerState:
    """What one worker process holds besides its engine."""

    worker_id: int
    engine: LLMEngine
    outbox: Outbox
    group: TensorGroup | None = None  # the other shards, for a worker over several devices
    # prefill id -> its KV: mapped here, or on another box (read through `transfer`)
    peers: dict[int, list[KVShard] | RemoteSource] = field(default_factory=dict)
    to_engine: dict[int, int] = field(default_factory=dict)  # request id -> engine id
    to_request: dict[int, int] = field(default_factory=dict)  # engine id -> request id
    announced: set[int] = field(default_factory=set)  # engine ids reported as started
    copying: dict[int, tuple[int, int]] = field(
        default_factory=dict
    )  # engine id -> (request, bytes)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    transfer: KVTransfer | None = None  # the KV transfer agent, once another box needs it
    registered: list[RemotePool] = field(default_factory=list)  # this pool, as it shares it
    spans: WorkerSpans | None = None  # its requests' spans, where tracing is on
    store: StoreClient | None = None  # the box's KV store (kv_store.enabled)


def run_worker(
    worker_id: int,
    role: Role,
    settings: Settings,
    devices: tuple[Device, ...],
    inbox: Queue[ToWorker],
    outbox: Outbox,
) -> None:
    """Process entry point: take the device (the first of a tensor-parallel group, whose
    other shards it starts), load, say Ready, serve messages until Shutdown."""
    parent = multiprocessing.parent_process()
    if parent is not None:  # started by a supervisor, through its fork server
        die_with_supervisor(parent)
    # A worker starts with no logging set up (its fork server sets none): its progress
    # lines (loading, a first conversion to dense weights) go to the stderr it shares with
    # the supervisor.
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    settings = use_device(settings, devices[0])
    log.info(
        "worker %d (%s) on %s: loading the model (dtype: %s, weights: %s)...",
        worker_id,
        role,
        "+".join(d.name for d in devices),
        settings.dtype,
        settings.weights,
    )
    group = None
    if len(devices) > 1:
        group = TensorGroup.start(settings, devices)
    try:
        load_and_serve(worker_id, role, settings, group, inbox, outbox)
    finally:
        # After the engine is gone: it may hold the followers' pools open.
        if group is not None:
            group.close()


def load_and_serve(
    worker_id: int,
    role: Role,
    settings: Settings,
    group: TensorGroup | None,
    inbox: Queue[ToWorker],
    outbox: Outbox,
) -> None:
    """Load the engine (shard 0 of `group`), say Ready, serve until Shutdown."""
    engine = LLMEngine.from_settings(
        settings, shared_kv=role == "prefill", group=group, decodes=role != "prefill"
    )
    warm_up(engine, decodes=role != "prefill", tensor_parallel=group is not None)  # CUDA only
    gemm = engine.model.prefill_gemm  # its steps' timings say where the kernels switch
    engine.clock.gemm_rows = gemm.rows if gemm is not None else None
    state = WorkerState(worker_id, engine, outbox, group, cluster=settings.cluster)
    # The model's and the engine's objects live as long as the process: frozen, no
    # collection scans them again, neither a full one while serving nor the one Python
    # makes as the process exits (most of a worker's second to exit after Shutdown).
    gc.freeze()
    exporting = start_exporting(settings.tracing, f"worker {worker_id}")
    if exporting is not None:
        state.spans = WorkerSpans(worker_id)
    try:
        shard_pids = group.pids if group is not None else []
        outbox.put(Ready(worker_id, engine.kv.num_blocks, shard_pids))
        if settings.kv_store.enabled and settings.kv.prefix_caching and group is None:
            state.store = StoreClient.start(worker_id, engine, settings, outbox, role)
        serve(state, inbox)
    finally:  # a traceback would keep the engine (and the shards' pools it opened) alive
        if exporting is not None and state.spans is not None:
            state.spans.close()
            exporting.stop()  # what the batch holds goes out before the process ends
        del state, engine


def serve(state: WorkerState, inbox: Queue[ToWorker]) -> None:
    """Step the engine while it has work, handling messages in between, until Shutdown."""
    engine, outbox, worker_id = state.engine, state.outbox, state.worker_id
    while True:
        cleaning = state.store is not None and state.store.cleaning
        handled = drain(state, inbox, 0.0 if cleaning else inbox_wait(engine))
        if handled is None:
            if state.store is not None:
                state.store.stop(outbox)
            return
        landed = send_landed(state)
        if engine.scheduler.has_unfinished():
            started_at = time.monotonic()
            report(state, engine.step(), started_at)
        elif handled or landed:
            report(state, [], 0.0)  # block counts changed (release, abort): say so
        if state.store is not None and not engine.scheduler.has_unfinished():
            state.store.clean_ahead(outbox)  # idle, tokens out: store what evicts next
        for engine_id in engine.expire_leases(LEASE_S):
            request_id = forget_engine_id(state, engine_id)
            if request_id is not None:
                outbox.put(LeaseExpired(worker_id, request_id))
                if state.spans is not None:
                    state.spans.end(request_id, error="no decode worker pulled its KV in time")


def inbox_wait(engine: LLMEngine) -> float:
    """How long to block on the inbox: not at all with a batch to run, briefly while only
    handed-off copies are in flight (the loop polls them), else IDLE_WAIT_S."""
    if engine.scheduler.has_unfinished():
        return 0.0
    return COPY_POLL_S if engine.copies_in_flight else IDLE_WAIT_S


def send_landed(state: WorkerState) -> int:
    """Admit handed-off requests whose blocks have landed and answer their Handoffs, which
    releases the source blocks; returns how many. Called before every report, so the
    supervisor hears of a handoff before any of its tokens."""
    state.engine.admit_copied()
    landed = state.engine.pop_landed()
    for engine_id in landed:
        request_id, moved = state.copying.pop(engine_id, (None, 0))
        if request_id is not None:  # else aborted meanwhile: nobody waits for the answer
            state.outbox.put(HandoffResult(state.worker_id, request_id, True, moved))
            if state.spans is not None:
                state.spans.landed(request_id, moved)
    failed = state.engine.pop_failed_copies()  # a read from another box: over
    for engine_id in failed:
        request_id = forget_engine_id(state, engine_id)
        if request_id is not None:  # else aborted meanwhile
            state.outbox.put(HandoffResult(state.worker_id, request_id, False))
            if state.spans is not None:
                state.spans.end(request_id, error="the KV read from the prefill's box failed")
    return len(landed) + len(failed)


def forget_engine_id(state: WorkerState, engine_id: int) -> int | None:
    """Drop an engine request the engine itself has let go of (a lease that expired, a
    read from another box that failed) from every map; its request id, if still known."""
    request_id = state.to_request.pop(engine_id, None)
    state.copying.pop(engine_id, None)
    if request_id is not None:
        state.to_engine.pop(request_id, None)
    return request_id


def use_device(settings: Settings, device: Device) -> Settings:
    """Bind this process to its device: a GPU, or a set of CPU cores."""
    if device.kind == "cuda":
        # Discovery numbered the GPUs in PCI bus order, under the CUDA_VISIBLE_DEVICES this
        # process inherits; CUDA numbers them fastest-first unless told otherwise, and reads
        # this once, as it starts: here, before this process's first CUDA call.
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        # Tensors made on "cuda" from here on land on this worker's GPU.
        torch.cuda.set_device(device.ordinal)
        return settings.model_copy(update={"device": "cuda"})
    if device.cores:
        pin_to_cores(device.cores)
    return settings.model_copy(update={"device": "cpu"})


def drain(state: WorkerState, inbox: Queue[ToWorker], wait: float) -> int | None:
    """Handle every waiting message (blocking up to `wait` for the first); returns how many,
    or None on Shutdown."""
    handled = 0
    try:
        message = inbox.get(timeout=wait) if wait else inbox.get_nowait()
    except queue.Empty:
        return handled
    while True:
        if isinstance(message, Shutdown):
            return None
        handle(state, message)
        handled += 1
        try:
            message = inbox.get_nowait()
        except queue.Empty:
            return handled


def handle(state: WorkerState, message: ToWorker) -> None:
    engine = state.engine
    match message:
        case Submit():
            submit(state, message)
        case Handoff():
            take_handoff(state, message)
        case SharePool(remote=True):
            state.outbox.put(PoolShared(state.worker_id, message.consumer, registered(state)))
        case SharePool():
            # Pickled by each shard's own process, once per consumer: each consumer gets
            # its own fd / IPC reference.
            pools = [pickle_pool(0, engine.kv.tensor, engine.handoff_ready)]
            if state.group is not None:
                pools += state.group.share_pools()
            state.outbox.put(PoolShared(state.worker_id, message.consumer, pools))
        case PeerPool():
            state.peers[message.worker_id] = open_peer(state, message)
        case Release():
            engine_id = state.to_engine.pop(message.request_id, None)
            if engine_id is not None and engine_id in engine.scheduler.parked:
                engine.release(engine_id)
                state.to_request.pop(engine_id, None)
        case DropPeer():
            dropped = state.peers.pop(message.worker_id, None)
            if isinstance(dropped, RemoteSource):
                for pool in dropped.pools:
                    dropped.transfer.forget(pool)
            state.outbox.put(PeerDropped(state.worker_id, message.worker_id))
        case Tune():
            engine.scheduler.limits = replace(engine.scheduler.limits, **message.changes())
        case Abort():
            engine_id = state.to_engine.get(message.request_id)
            if engine_id is not None:
                engine.abort(engine_id)
                forget_engine_id(state, engine_id)
            if state.spans is not None:
                state.spans.end(message.request_id, attributes={"appliance.aborted": True})
        case StoreHits():
            if state.store is not None:
                state.store.hold(message)
        case StoreSlots():
            if state.store is not None:
                state.store.take_slots(message)
        case Shutdown():  # drain() stops at it before handing it here
            raise AssertionError("Shutdown is drain()'s to handle")


def transfer_agent(state: WorkerState) -> KVTransfer:
    """This worker's KV transfer agent, made at first need, with this worker's own pools
    registered (a read's destination must be, as must a pool others read)."""
    if state.transfer is None:
        name = f"{socket.gethostname()}-{os.getpid()}-worker{state.worker_id}"
        state.transfer = KVTransfer(name, state.cluster)
        for shard in state.engine.kv_shards:
            state.registered.append(state.transfer.register(shard.tensor, shard.head_start))
    return state.transfer


def registered(state: WorkerState) -> list[RemotePool]:
    """This worker's pools as a decode worker on another box reads them."""
    if state.group is not None:
        raise RuntimeError("a tensor-parallel prefill group hands KV off within its box only")
    transfer_agent(state)
    return state.registered


def open_peer(state: WorkerState, message: PeerPool) -> list[KVShard] | RemoteSource:
    """A prefill worker's pools: mapped into this process, or read from another box."""
    if message.data and isinstance(message.data[0], RemotePool):
        pools = tuple(p for p in message.data if isinstance(p, RemotePool))
        return RemoteSource(transfer_agent(state), pools)
    shards = open_pools([p for p in message.data if not isinstance(p, RemotePool)])
    return reading_from(shards, state.engine.kv.tensor.device)


def submit(state: WorkerState, message: Submit) -> None:
    if state.store is not None:  # the prompt's stored prefix into the pool first
        state.store.load(message.request_id, message.token_ids, message.params)
    try:
        engine_id = state.engine.add_request(
            message.token_ids, message.params, prefill_only=message.prefill_only
        )
    except ValueError as exc:
        state.outbox.put(Failed(state.worker_id, message.request_id, str(exc)))
        return
    state.to_engine[message.request_id] = engine_id
    state.to_request[engine_id] = message.request_id
    if state.spans is not None:
        name = "prefill" if message.prefill_only else "generate"
        prompt = {"gen_ai.usage.input_tokens": len(message.token_ids)}
        state.spans.begin(message.request_id, name, message.trace, prompt)


def take_handoff(state: WorkerState, message: Handoff) -> None:
    engine = state.engine
    if message.source not in state.peers:  # that prefill worker is gone: it is prefilled again
        state.outbox.put(HandoffResult(state.worker_id, message.request_id, False))
        return
    pulled = engine.add_prefilled(
        message.token_ids,
        message.num_prompt_tokens,
        message.params,
        state.peers[message.source],
        message.blocks,
    )
    if pulled is None:  # no room now: the supervisor asks again
        state.outbox.put(HandoffResult(state.worker_id, message.request_id, False))
        return
    engine_id, moved = pulled
    if state.store is not None:  # the prompt's blocks are the prefill side's to store
        prompt = message.token_ids[: message.num_prompt_tokens]
        state.store.handed_off(prompt, message.params.cache_salt)
    state.to_engine[message.request_id] = engine_id
    state.to_request[engine_id] = message.request_id
    if state.spans is not None:  # until its blocks land (send_landed)
        blocks = {"appliance.handoff.blocks": len(message.blocks)}
        state.spans.begin(message.request_id, "handoff", message.trace, blocks)
    # Accepted once its blocks have landed (on the CPU, now): send_landed answers then.
    state.copying[engine_id] = (message.request_id, moved)
    send_landed(state)


def report(state: WorkerState, outputs: list[RequestOutput], started_at: float) -> None:
    """One message per step: the tokens made, the requests it started, this worker's load
    (after the answers to handoffs that landed, which the step may have admitted)."""
    send_landed(state)
    if state.store is not None:
        state.store.send(state.outbox)
    scheduler = state.engine.scheduler
    batch = TokenBatch(
        state.worker_id,
        num_free_blocks=state.engine.num_free_blocks,
        num_running=len(scheduler.running),
        started=newly_started(state),
        step_started_at=started_at,
        timing=state.engine.clock.pop(),
        speculation=reported_totals(scheduler.acceptance, scheduler.drafter),
        partial_tokens=scheduler.blocks.partial_tokens,
    )
    for out in outputs:
        request_id = state.to_request.get(out.seq_id)
        if request_id is None:
            continue
        if out.finished:
            state.to_request.pop(out.seq_id, None)
            state.to_engine.pop(request_id, None)
        if state.spans is not None:
            trace_output(state.spans, request_id, out)
        batch.outputs.append(
            Output(
                request_id,
                out.token_ids,
                out.text,
                out.finished,
                out.finish_reason,
                out.handoff_blocks,
                out.cached_tokens,
                out.logprobs,
                out.prompt_logprobs,
                out.embedding,
            )
        )
    state.outbox.put(batch)


def trace_output(spans: WorkerSpans, request_id: int, out: RequestOutput) -> None:
    """Count a step's tokens on the request's span; its last (a prefill parked for a
    handoff, a finished request) ends the span."""
    spans.stepped(request_id, len(out.token_ids))
    if out.finished or out.handoff_blocks is not None:
        ends: Attributes = {
            "gen_ai.response.finish_reasons": out.finish_reason or "",
            "appliance.cached_tokens": out.cached_tokens,
        }
        spans.end(request_id, attributes=ends)


def newly_started(state: WorkerState) -> list[int]:
    """Requests that got their first model step since the last report."""
    state.announced &= state.to_request.keys()  # forget the finished
    running = {s.seq_id for s in state.engine.scheduler.running}
    running |= state.engine.scheduler.parked.keys()
    new = [i for i in running - state.announced if i in state.to_request]
    state.announced.update(new)
    return [state.to_request[i] for i in new]
