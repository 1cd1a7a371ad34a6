"""KV blocks between boxes through NIXL: a prefill box and a decode box, each a process
with its own engine and transfer agent, the bytes over TCP (UCX held to it on loopback).
Greedy outputs equal one engine's; every block is free after; a prefill box that dies or
freezes under a read fails that read (the request can be prefilled again), never hangs."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import torch
import torch.multiprocessing as mp
from remote_boxes import decode_box, prefill_box
from server_process import wait_until

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.kv.remote import (
    Copies,
    RemoteCopy,
    RemoteSource,
    TransferError,
    pool_shape,
    ucx_environment,
)
from appliance.kv.remote_pool import RemotePool, nixl_available
from appliance.settings.cluster import ClusterSettings

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

TEXT = (
    "A lighthouse keeper kept a log of every ship that passed, the weather, the tides "
    "and the birds, and after forty years the log filled a whole shelf of the tower."
)
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


class Box:
    """A box process and the test's end of its pipe."""

    def __init__(self, target: object) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(theirs,), daemon=True)
        self.process.start()
        theirs.close()
        assert self.ask(None, timeout=120) == "ready"

    def ask(self, message: tuple | None, timeout: float = 120) -> object:
        if message is not None:
            self.conn.send(message)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the box did not answer {message!r} in {timeout} s")
        return self.conn.recv()

    def tell(self, message: tuple) -> None:
        self.conn.send(message)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


@pytest.fixture
def boxes() -> Iterator[tuple[Box, Box]]:
    assert nixl_available(), "NIXL is missing: ./install.sh --dev installs it"
    prefill, decode = Box(prefill_box), Box(decode_box)
    yield prefill, decode
    prefill.stop()
    decode.stop()


def prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    ids = engine.tokenizer.encode(TEXT * 3)
    return [ids[: 9 + 11 * i] for i in range(count)]


def test_prefill_on_one_box_decode_on_another_equals_one_engine(
    engine: LLMEngine, boxes: tuple[Box, Box]
) -> None:
    prefill, decode = boxes
    asked = prompts(engine, 8)
    expected = [c.token_ids for c in engine.generate(asked, PARAMS)]
    pool, parked = prefill.ask(("prefill", asked, PARAMS))
    outputs, failed, moved, free = decode.ask(("decode", pool, parked, PARAMS))
    assert outputs == expected and failed == []
    layout = engine.kv.layout
    blocks = sum(-(-p.prompt_len // 16) for p in parked)
    assert moved == blocks * layout.bytes_per_block()  # the prompts' blocks, nothing more
    prefill.tell(("release", [p.seq_id for p in parked]))
    assert free == 300 and prefill.ask(("free",)) == 200


def test_a_prefill_box_killed_before_the_read_fails_it_and_frees_the_blocks(
    engine: LLMEngine, boxes: tuple[Box, Box]
) -> None:
    prefill, decode = boxes
    pool, parked = prefill.ask(("prefill", prompts(engine, 3), PARAMS))
    prefill.process.kill()
    prefill.process.join(10)
    outputs, failed, _, free = decode.ask(("decode", pool, parked, PARAMS), timeout=60)
    assert outputs == [None] * 3 and sorted(failed) == sorted(p.seq_id for p in parked)
    assert free == 300


@pytest.mark.parametrize("end", ["thawed", "forgotten"])
def test_a_frozen_prefill_box_fails_the_read_at_its_deadline(
    engine: LLMEngine, boxes: tuple[Box, Box], end: str
) -> None:
    prefill, decode = boxes
    pool, parked = prefill.ask(("prefill", prompts(engine, 2), PARAMS))
    os.kill(prefill.process.pid, signal.SIGSTOP)  # a hung box: its sockets stay open
    try:
        outputs, failed, _, free = decode.ask(("decode", pool, parked, PARAMS), timeout=60)
        assert outputs == [None, None] and len(failed) == 2  # over at the deadline
        # The reads were not cancelled (NIXL cannot make sure a busy one stops writing):
        # their blocks wait, out of use, while the box is frozen...
        held = 300 - free
        assert held == sum(-(-p.prompt_len // 16) for p in parked)
        assert decode.ask(("free",)) == free
        if end == "forgotten":  # ...until the head gives its worker up (DropPeer)...
            decode.tell(("forget", pool))
            wait_until(lambda: decode.ask(("free",)) == 300, 30, "the reads to end")
    finally:
        os.kill(prefill.process.pid, signal.SIGCONT)
    # ...or the box comes back and the reads land
    wait_until(lambda: decode.ask(("free",)) == 300, 30, "the late reads to end")


def test_ucx_settings_come_from_the_cluster_settings() -> None:
    env = ucx_environment(ClusterSettings(transports="tcp", interface="eth0"))
    assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "eth0"
    assert "UCX_TCP_PORT_RANGE" not in env  # empty settings leave UCX its defaults
    ports = ucx_environment(ClusterSettings(transfer_ports="40000-40100"))
    assert ports["UCX_TCP_PORT_RANGE"] == "40000-40100" and "UCX_TLS" not in ports


def test_only_whole_contiguous_pools_are_registered() -> None:
    assert pool_shape(torch.zeros(2, 2, 5, 4, 3, 8)).blocks == 5
    with pytest.raises(ValueError, match="contiguous KV pool"):
        pool_shape(torch.zeros(2, 2, 5, 4, 6, 8)[..., :3, :])
    with pytest.raises(ValueError, match="contiguous KV pool"):
        pool_shape(torch.zeros(2, 3, 5, 4, 3, 8))


class Read:
    """A stand-in read whose done() gives these outcomes in turn (the last one stays);
    settled once it has landed or failed."""

    def __init__(self, *outcomes: bool | str) -> None:
        self.outcomes = list(outcomes)
        self.nbytes = 10
        self.over = False

    def done(self) -> bool:
        outcome = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        self.over = outcome is not False
        if isinstance(outcome, str):
            raise TransferError(outcome)
        return outcome

    def settled(self) -> bool:
        return self.over or self.done() is not False


def test_a_failed_read_fails_the_copy_at_once_and_it_settles_when_none_still_writes() -> None:
    # one read fails at once, the other lands at the third poll
    copies = Copies([Read("peer gone"), Read(False, False, True)])  # type: ignore[list-item]
    with pytest.raises(TransferError, match="peer gone"):
        copies.done()
    assert copies.settled() is False and copies.settled() is True
    landed = Copies([Read(False, True), Read(True)])  # type: ignore[list-item]
    assert landed.done() is False and landed.done() is True and landed.nbytes == 20


class Nixl:
    """A stand-in for a transfer agent with one posted read, whose state the test sets (a
    read past its deadline that then lands, or ends in an error, on cue)."""

    def __init__(self) -> None:
        self.status = "busy"
        self.released: list[int] = []

    def state(self, request: int) -> str:
        return self.status

    def release(self, request: int) -> None:
        assert self.status != "busy", "a busy read is not released: it may still land"
        self.released.append(request)


def test_a_read_past_its_deadline_fails_but_is_unsettled_until_it_ends() -> None:
    nixl = Nixl()
    read = RemoteCopy(10, nixl, 7, _deadline=0.0)  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="ran past its deadline"):
        read.done()
    assert read.settled() is False and read.settled() is False  # it may still write
    nixl.status = "done"
    assert read.settled() is True and nixl.released == [7]
    with pytest.raises(TransferError, match="ran past its deadline"):
        read.done()  # it failed for good, though its bytes came in the end
    errored = RemoteCopy(10, Nixl(), 8, _deadline=0.0)  # type: ignore[arg-type]
    with pytest.raises(TransferError):
        errored.done()
    errored._transfer.status = "error"  # type: ignore[union-attr]
    assert errored.settled() is True  # ended: nothing more can land


def test_a_failed_read_keeps_failing_when_asked_again() -> None:
    read = RemoteCopy(10, failed="the KV read from box-a failed: gone")
    for _ in range(2):
        with pytest.raises(TransferError, match="box-a failed"):
            read.done()


class StalledTransfer:
    """Starts every read as one that has run past its deadline and is still busy."""

    def __init__(self, nixl: Nixl) -> None:
        self.nixl = nixl

    def start_read(self, *args: object) -> RemoteCopy:
        return RemoteCopy(10, self.nixl, 7, _deadline=0.0)  # type: ignore[arg-type]


def test_a_failed_read_is_over_at_once_but_its_blocks_wait_until_it_ends(
    engine: LLMEngine,
) -> None:
    nixl = Nixl()
    # the stalled transfer never reads its pool: one shaped as this engine's own
    pool = RemotePool("stalled", b"", 0, pool_shape(engine.kv.tensor))
    source = RemoteSource(StalledTransfer(nixl), (pool,))
    free = engine.num_free_blocks
    ids = prompts(engine, 3)[2]  # 31 tokens: two blocks
    started = engine.add_prefilled([*ids, 42], len(ids), PARAMS, source, [5, 6])
    assert started is not None
    engine.step()
    assert engine.pop_failed_copies() == [started[0]]  # the request is over: prefill again
    assert engine.num_free_blocks == free - 2 and engine.has_unfinished()  # still written
    engine.step()
    assert engine.num_free_blocks == free - 2
    nixl.status = "done"  # the read ended at last
    engine.step()
    assert engine.num_free_blocks == free and not engine.has_unfinished()
    assert engine.pop_failed_copies() == [] and engine.pop_landed() == []
