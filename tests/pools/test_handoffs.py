"""Handoffs and the pool wiring on plain data: worker handles with list inboxes, a request
table, the real router. No processes.

Workers: 0 is a prefill worker, 1 and 2 are decode workers (wired to 0 unless a test
says otherwise), each with 8 free KV blocks of 16 tokens; a prompt of 3 tokens needs 1.
"""

from __future__ import annotations

import asyncio

from worker_handles import worker_handle

from appliance.core.request_table import Phase, Request, RequestTable
from appliance.core.router import Router
from appliance.engine.sequence import SamplingParams
from appliance.pools.handoffs import Handoffs
from appliance.pools.wiring import Wiring
from appliance.pools.worker_handle import WorkerHandle
from appliance.workers.messages import (
    Abort,
    DropPeer,
    Handoff,
    HandoffResult,
    Output,
    PeerDropped,
    PeerPool,
    PoolShared,
    Release,
    SharePool,
    ToWorker,
)

PREFILL, DECODE, OTHER = 0, 1, 2
BLOCK_SIZE = 16


class Inbox(list):
    def put(self, message: ToWorker) -> None:
        self.append(message)


def worker(worker_id: int, role: str, free: int = 8) -> WorkerHandle:
    return worker_handle(worker_id, role, free=free, inbox=Inbox(), ready=True)


class Box:
    """A prefill worker, two decode workers, and the handoffs between them; the box is
    the handoffs' worker pool and takes back the requests they cannot send."""

    def __init__(self, decode_free: tuple[int, int] = (8, 8)) -> None:
        self.workers = {
            PREFILL: worker(PREFILL, "prefill"),
            DECODE: worker(DECODE, "decode", decode_free[0]),
            OTHER: worker(OTHER, "decode", decode_free[1]),
        }
        for decode in (DECODE, OTHER):
            self.workers[decode].peers.add(PREFILL)
        self.table = RequestTable()
        self.retried: list[int] = []
        self.failed: list[int] = []
        self.coming_back = False
        router = Router(BLOCK_SIZE, prefix_caching=False)
        self.handoffs = Handoffs(BLOCK_SIZE, self.table, router, pool=self, attempts=self)

    def send(self, worker_id: int | None, message: ToWorker) -> None:
        if worker_id in self.workers:
            self.workers[worker_id].inbox.put(message)

    def may_come_back(self, role: str) -> bool:
        return self.coming_back

    def retry(self, request: Request, reason: str) -> None:
        self.retried.append(request.request_id)

    def fail(self, request: Request, reason: str) -> None:
        self.failed.append(request.request_id)

    def inbox(self, worker_id: int) -> list[ToWorker]:
        inbox = self.workers[worker_id].inbox
        assert isinstance(inbox, Inbox)
        return inbox

    def parked(self, prompt_len: int = 3) -> Request:
        """A request prefilled by worker 0, its KV parked there."""
        request = self.table.add(list(range(prompt_len)), SamplingParams(max_tokens=8), 1.0)
        self.table.submit(request.request_id, PREFILL)
        self.table.on_started([request.wire_id], 2.0)
        out = Output(request.wire_id, [7], "x", False, None, handoff_blocks=[3])
        self.table.on_output(PREFILL, out, 3.0, 2.0)
        assert request.phase is Phase.PARKED
        return request

    def handoffs_to(self, worker_id: int) -> list[Handoff]:
        return [m for m in self.inbox(worker_id) if isinstance(m, Handoff)]


def test_a_handoff_goes_to_a_decode_worker_with_room() -> None:
    box = Box(decode_free=(8, 2))
    request = box.parked()
    box.handoffs.hand_off(request.kv)
    (sent,) = box.handoffs_to(DECODE)
    assert (sent.request_id, sent.source, sent.blocks) == (request.wire_id, PREFILL, [3])
    assert sent.token_ids == [0, 1, 2, 7]
    assert request.phase is Phase.HANDING_OFF and request.decode_worker == DECODE


def test_without_room_a_handoff_waits_and_goes_when_a_report_frees_blocks() -> None:
    box = Box(decode_free=(0, 0))
    request = box.parked()
    box.handoffs.hand_off(request.kv)
    assert box.handoffs.waiting == 1 and not box.handoffs_to(DECODE)
    assert request.phase is Phase.PARKED  # its KV stays where it is, nothing sent
    box.handoffs.retry_waiting()  # nothing changed: still waiting, still nothing sent
    assert box.handoffs.waiting == 1 and not box.handoffs_to(DECODE) + box.handoffs_to(OTHER)
    box.workers[OTHER].num_free = 4  # its next report: blocks freed
    box.handoffs.retry_waiting()
    assert box.handoffs.waiting == 0 and len(box.handoffs_to(OTHER)) == 1


def test_waiting_handoffs_go_oldest_first_as_room_comes() -> None:
    box = Box(decode_free=(0, 0))
    first, second = box.parked(), box.parked()
    box.handoffs.hand_off(first.kv)
    box.handoffs.hand_off(second.kv)
    box.workers[DECODE].num_free = 1  # room for one
    box.handoffs.retry_waiting()
    assert [h.request_id for h in box.handoffs_to(DECODE)] == [first.wire_id]
    assert box.handoffs.waiting == 1 and second.phase is Phase.PARKED


def test_a_refused_handoff_goes_elsewhere_and_the_refuser_waits_for_its_report() -> None:
    box = Box(decode_free=(8, 4))
    request = box.parked()
    box.handoffs.hand_off(request.kv)
    box.handoffs.on_result(HandoffResult(DECODE, request.wire_id, False))
    assert box.workers[DECODE].refused
    assert [h.request_id for h in box.handoffs_to(OTHER)] == [request.wire_id]
    # Both refuse: it waits, and is not sent again before a report.
    box.handoffs.on_result(HandoffResult(OTHER, request.wire_id, False))
    assert box.handoffs.waiting == 1
    box.handoffs.retry_waiting()
    assert len(box.handoffs_to(DECODE)) == 1 and len(box.handoffs_to(OTHER)) == 1
    box.workers[DECODE].refused = False  # what its next report does
    box.handoffs.retry_waiting()
    assert len(box.handoffs_to(DECODE)) == 2


def test_an_accepted_handoff_frees_the_prefill_blocks_and_counts_until_the_report() -> None:
    box = Box()
    request = box.parked()
    box.handoffs.hand_off(request.kv)
    box.handoffs.on_result(HandoffResult(DECODE, request.wire_id, True, 4096))
    assert Release(request.wire_id) in box.inbox(PREFILL)
    assert request.phase is Phase.DECODING and box.workers[DECODE].taken_blocks == 1


def test_a_cancelled_request_waiting_for_room_releases_its_blocks() -> None:
    box = Box(decode_free=(0, 0))
    request = box.parked()
    box.handoffs.hand_off(request.kv)
    box.table.forget(request.request_id)  # its consumer left
    box.workers[DECODE].num_free = 8
    box.handoffs.retry_waiting()
    assert Release(request.wire_id) in box.inbox(PREFILL) and not box.handoffs_to(DECODE)
    assert box.handoffs.waiting == 0


def test_a_stale_acceptance_is_undone() -> None:
    box = Box()
    request = box.parked()
    box.handoffs.hand_off(request.kv)
    box.table.forget(request.request_id)
    box.handoffs.on_result(HandoffResult(DECODE, request.wire_id, True, 4096))
    assert Abort(request.wire_id) in box.inbox(DECODE)


def test_a_handoff_whose_prefill_worker_died_is_prefilled_again() -> None:
    box = Box()
    request = box.parked()
    box.workers[PREFILL].alive = False
    box.handoffs.hand_off(request.kv)
    assert box.retried == [request.request_id] and not box.handoffs_to(DECODE)


def test_with_no_decode_worker_left_a_waiting_handoff_fails_unless_one_comes_back() -> None:
    box = Box(decode_free=(0, 0))
    request = box.parked()
    box.handoffs.hand_off(request.kv)
    for decode in (DECODE, OTHER):
        box.workers[decode].alive = False
    box.coming_back = True  # restarting: it keeps waiting
    box.handoffs.retry_waiting()
    assert box.handoffs.waiting == 1 and not box.failed
    box.coming_back = False  # crashed too often
    box.handoffs.retry_waiting()
    assert box.failed == [request.request_id] and Release(request.wire_id) in box.inbox(PREFILL)


def test_a_decode_worker_not_wired_to_the_source_is_not_asked() -> None:
    box = Box(decode_free=(8, 8))
    box.workers[DECODE].peers.clear()  # still being wired to worker 0
    request = box.parked()
    box.handoffs.hand_off(request.kv)
    assert not box.handoffs_to(DECODE) and len(box.handoffs_to(OTHER)) == 1


def test_a_handoff_to_a_lost_decode_worker_goes_on_from_its_parked_kv() -> None:
    box = Box()
    request = box.parked()
    box.handoffs.hand_off(request.kv)
    box.workers[DECODE].alive = False
    (sent,) = box.handoffs.sent_to(DECODE)
    box.handoffs.take_back(sent)
    assert len(box.handoffs_to(OTHER)) == 1 and request.decode_worker == OTHER


def test_a_handoff_from_a_worker_turned_decode_in_place_is_prefilled_again_at_once() -> None:
    # Worker 0 prefilled it, then turned decode in place (a pool move); its decode peer 1
    # is lost before answering. No decode worker is wired to a decode worker, 0 does not
    # hold its own pool, and a decode worker coming back would not be wired to 0 either:
    # waiting would only wait out its lease (the frozen box test's 30 s).
    box = Box()
    box.workers[OTHER].peers.clear()  # another box's decode worker restarting, say
    request = box.parked()
    box.handoffs.hand_off(request.kv)
    box.workers[PREFILL].role = "decode"
    box.workers[DECODE].alive = False
    box.coming_back = True
    (sent,) = box.handoffs.sent_to(DECODE)
    box.handoffs.take_back(sent)
    assert box.retried == [request.request_id] and box.handoffs.waiting == 0
    assert Release(request.wire_id) in box.inbox(PREFILL)  # its parked blocks freed now
    assert not box.handoffs_to(PREFILL) + box.handoffs_to(OTHER)


def test_a_handoff_from_a_worker_turned_decode_in_place_goes_to_a_decode_peer() -> None:
    box = Box(decode_free=(8, 0))
    request = box.parked()
    box.workers[PREFILL].role = "decode"
    box.workers[DECODE].alive = False
    box.handoffs.hand_off(request.kv)  # 2 holds its pool but has no room: it waits
    assert box.handoffs.waiting == 1 and not box.retried
    box.workers[OTHER].num_free = 8
    box.handoffs.retry_waiting()
    assert [h.request_id for h in box.handoffs_to(OTHER)] == [request.wire_id]


# ---------------------------------------------------------------- the wiring handshake


def unwired(role: str, worker_id: int) -> WorkerHandle:
    handle = worker(worker_id, role)
    handle.loaded = handle.ready = False
    return handle


def test_each_pair_is_wired_once_the_second_of_the_two_has_loaded() -> None:
    workers = {0: unwired("prefill", 0), 1: unwired("decode", 1)}
    sent: list[tuple[int | None, ToWorker]] = []
    wiring = Wiring(workers, lambda worker_id, message: sent.append((worker_id, message)))
    workers[1].loaded = True
    wiring.on_loaded(workers[1])  # no prefill worker has loaded: nothing to wire yet
    assert sent == [] and wiring.newly_wired() == [workers[1]]
    workers[1].ready = True
    workers[0].loaded = True
    wiring.on_loaded(workers[0])
    assert sent == [(0, SharePool(1))]
    assert wiring.newly_wired() == []  # the decode worker does not hold its pool yet
    wiring.on_pool_shared(PoolShared(0, 1, [(0, b"pool")]))
    assert sent[-1] == (1, PeerPool(0, [(0, b"pool")])) and workers[1].peers == {0}
    assert wiring.newly_wired() == [workers[0]]


def test_a_worker_back_in_the_decode_pool_is_asked_only_for_pools_it_lacks() -> None:
    # Worker 2 decoded beside prefill worker 0, was colocated (in place, keeping 0's
    # pool) while prefill worker 1 started, and now decodes again.
    workers = {0: worker(0, "prefill"), 1: worker(1, "prefill"), 2: worker(2, "decode")}
    workers[2].peers = {0}
    sent: list[tuple[int | None, ToWorker]] = []
    wiring = Wiring(workers, lambda worker_id, message: sent.append((worker_id, message)))
    wiring.on_loaded(workers[2])
    assert sent == [(1, SharePool(2))]


def test_across_boxes_only_single_device_workers_are_wired() -> None:
    group = unwired("prefill", 0)
    group.devices = (0, 3)  # a tensor-parallel group on the head
    workers = {0: group, 1: unwired("decode", 1), 2: unwired("decode", 2), 4: unwired("prefill", 4)}
    workers[1].box = "b"  # decode on another box; decode 2 and prefill 4 on the head
    sent: list[tuple[int | None, ToWorker]] = []
    wiring = Wiring(workers, lambda worker_id, message: sent.append((worker_id, message)))
    for handle in workers.values():
        handle.loaded = True
    wiring.on_loaded(group)
    assert sent == [(0, SharePool(2))]  # the group's shards are in two processes
    wiring.on_loaded(workers[4])
    assert sent[1:] == [(4, SharePool(1, True)), (4, SharePool(2))]
    for prefill, share in sent[:3]:
        assert isinstance(share, SharePool) and prefill is not None
        wiring.on_pool_shared(PoolShared(prefill, share.consumer, [(0, b"pool")]))
    assert workers[1].peers == {4} and workers[2].peers == {0, 4}
    ready = [w.worker_id for w in wiring.newly_wired()]
    assert sorted(ready) == [0, 1, 2, 4]  # nobody waits for a pair that cannot be wired


def test_a_group_with_no_decode_worker_in_its_box_fails_its_handoffs() -> None:
    box = Box()
    box.workers[PREFILL].devices = (PREFILL, 5)
    for decode in (DECODE, OTHER):
        box.workers[decode].box = "b"
    request = box.parked()
    box.handoffs.hand_off(request.kv)
    assert box.failed == [request.request_id] and not box.handoffs_to(DECODE)
    assert Release(request.wire_id) in box.inbox(PREFILL)


def test_a_stopping_prefill_worker_waits_until_its_pool_is_dropped() -> None:
    workers = {0: worker(0, "prefill"), 1: worker(1, "decode"), 2: worker(2, "decode")}
    workers[1].peers.add(0)
    workers[2].peers.add(0)
    sent: list[tuple[int | None, ToWorker]] = []
    wiring = Wiring(workers, lambda worker_id, message: sent.append((worker_id, message)))

    async def retire() -> bool:
        release = asyncio.create_task(wiring.release(0))
        await asyncio.sleep(0)
        assert sorted(sent) == [(1, DropPeer(0)), (2, DropPeer(0))]
        wiring.on_peer_dropped(PeerDropped(1, 0))
        await asyncio.sleep(0)
        waiting = not release.done()  # worker 2 has not answered yet
        wiring.on_peer_dropped(PeerDropped(2, 0))
        await release
        return waiting

    assert asyncio.run(retire())
    assert workers[1].peers == workers[2].peers == set()


def test_a_dead_prefill_workers_pool_is_dropped_without_waiting() -> None:
    workers = {0: worker(0, "prefill"), 1: worker(1, "decode")}
    workers[1].peers.add(0)
    sent: list[tuple[int | None, ToWorker]] = []
    wiring = Wiring(workers, lambda worker_id, message: sent.append((worker_id, message)))
    wiring.forget(0)
    assert sent == [(1, DropPeer(0))] and workers[1].peers == set()
