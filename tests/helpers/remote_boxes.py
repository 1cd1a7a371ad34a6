"""Two 'boxes' as processes for the KV-between-boxes tests: a prefill box whose pool a
decode box reads through NIXL, with UCX held to TCP on the loopback interface (so the
bytes cross a socket, not shared memory). Each runs the real engine on the default model;
the test drives both over pipes."""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.kv.remote import KVTransfer, RemoteSource
from appliance.settings.cluster import ClusterSettings
from appliance.settings.config import load_settings

TCP_ONLY = ClusterSettings(transports="tcp", interface="lo", transfer_timeout_s=5.0)


@dataclass(frozen=True)
class Parked:
    """A prefilled request waiting for its decode box: prompt + first token, its blocks."""

    seq_id: int
    token_ids: list[int]
    prompt_len: int
    blocks: list[int]


def box_engine(num_blocks: int) -> LLMEngine:
    return LLMEngine.from_settings(
        load_settings(dtype="float32", device="cpu", weights="dense", kv={"num_blocks": num_blocks})
    )


def prefill_box(conn: Connection, cluster: ClusterSettings = TCP_ONLY) -> None:
    """Commands: ('prefill', prompts, params) -> (pool, [Parked]); ('release', ids);
    ('free',) -> free blocks; ('stop',)."""
    engine = box_engine(200)
    transfer = KVTransfer("prefill-box", cluster)
    pool = transfer.register(engine.kv.tensor)
    conn.send("ready")
    while True:
        command, *args = conn.recv()
        if command == "prefill":
            conn.send((pool, prefill_all(engine, *args)))
        elif command == "release":
            for seq_id in args[0]:
                engine.release(seq_id)
        elif command == "free":
            conn.send(engine.num_free_blocks)
        else:
            transfer.close()
            return


def prefill_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    ids = [engine.add_request(p, params, prefill_only=True) for p in prompts]
    parked: dict[int, Parked] = {}
    while len(parked) < len(ids):
        for out in engine.step():
            assert out.handoff_blocks is not None  # the tests ask for more than one token
            prompt = prompts[ids.index(out.seq_id)]
            parked[out.seq_id] = Parked(
                out.seq_id, prompt + out.token_ids, len(prompt), out.handoff_blocks
            )
    return [parked[i] for i in ids]


def decode_box(conn: Connection, cluster: ClusterSettings = TCP_ONLY) -> None:
    """Commands: ('decode', pool, [Parked], params) -> (outputs by Parked order (None for
    a failed read), failed source ids, bytes read, free blocks); ('free',) -> free blocks
    (once the reads still out are looked at); ('forget', pool): as DropPeer; ('stop',)."""
    engine = box_engine(300)
    transfer = KVTransfer("decode-box", cluster)
    transfer.register(engine.kv.tensor)  # a read's destination must be registered
    conn.send("ready")
    while True:
        command, *args = conn.recv()
        if command == "decode":
            conn.send(decode_all(engine, RemoteSource(transfer, (args[0],)), *args[1:]))
        elif command == "free":
            engine.admit_copied()
            conn.send(engine.num_free_blocks)
        elif command == "forget":
            transfer.forget(args[0])
        else:
            transfer.close()
            return


def decode_all(
    engine: LLMEngine, source: RemoteSource, parked: list[Parked], params: SamplingParams
) -> tuple[list[list[int] | None], list[int], int, int]:
    tokens: dict[int, list[int]] = {}
    origin: dict[int, int] = {}  # decode id -> the prefill box's id
    moved = 0
    for p in parked:
        started = engine.add_prefilled(p.token_ids, p.prompt_len, params, source, p.blocks)
        assert started is not None  # the pool has room for every test's requests
        new_id, nbytes = started
        origin[new_id], tokens[p.seq_id] = p.seq_id, list(p.token_ids[p.prompt_len :])
        moved += nbytes
    failed: list[int] = []
    # Until each request has finished or failed (a failed read's blocks may wait longer).
    while engine.scheduler.has_unfinished() or engine.copies_in_flight:
        engine.admit_copied()
        failed += [origin[i] for i in engine.pop_failed_copies()]
        for out in engine.step():
            tokens[origin[out.seq_id]] += out.token_ids
    failed += [origin[i] for i in engine.pop_failed_copies()]
    outputs = [None if p.seq_id in failed else tokens[p.seq_id] for p in parked]
    return outputs, failed, moved, engine.num_free_blocks
