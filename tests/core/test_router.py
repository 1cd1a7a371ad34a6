"""Where handoffs go, on plain data: the decode worker best linked to the prefill worker
that holds the KV, among those with room; most free blocks where links are equal (CPU)."""

from __future__ import annotations

from collections import Counter

from nvml_boxes import PCIE_4GPU, cpu_box, gpus
from worker_handles import worker_handle

from appliance.core.router import Router
from appliance.pools.worker_handle import WorkerHandle
from appliance.topology.devices import Topology
from appliance.topology.partition import partition

BLOCKS = 3  # KV blocks each handoff below needs


def worker(worker_id: int, role: str, device: int, free: int = 0) -> WorkerHandle:
    return worker_handle(worker_id, role, device=device, free=free)


def hand_off(
    router: Router, decodes: list[WorkerHandle], source: WorkerHandle, in_flight: Counter[int]
) -> int:
    """Route one handoff as the supervisor does, counting its blocks as in flight to the
    worker picked (no report has shown them yet); the device it landed on."""
    picked = router.decode(decodes, in_flight, source, BLOCKS)
    in_flight[picked.worker_id] += BLOCKS
    return picked.device_index


def pcie_box() -> tuple[Topology, Router]:
    """The recorded 4xA100 PCIe box, NVLink bridges joining 0-1 and 2-3, and its router."""
    topology = gpus(PCIE_4GPU)
    part = partition(topology, "disaggregated")
    assert (part.prefill, part.decode) == ((0, 2), (1, 3))
    return topology, Router(16, True, topology.bandwidth_rank)


def test_handoffs_from_0_stay_on_its_nvlink_partner_1_until_1_is_full() -> None:
    _, router = pcie_box()
    p0, d1, d3 = worker(0, "prefill", 0), worker(1, "decode", 1, 20), worker(3, "decode", 3, 90)
    in_flight: Counter[int] = Counter()
    landed = [hand_off(router, [d1, d3], p0, in_flight) for _ in range(8)]
    # 1 has room for six (18 of its 20 blocks), although 3 has far more free all along.
    assert landed == [1] * 6 + [3] * 2
    d1.num_free, in_flight[d1.worker_id] = 20, 0  # its report: those requests finished
    assert hand_off(router, [d1, d3], p0, in_flight) == 1  # room again: back to the partner


def test_handoffs_from_2_stay_on_its_nvlink_partner_3_until_3_is_full() -> None:
    _, router = pcie_box()
    p2, d1, d3 = worker(2, "prefill", 2), worker(1, "decode", 1, 90), worker(3, "decode", 3, 20)
    in_flight: Counter[int] = Counter()
    landed = [hand_off(router, [d1, d3], p2, in_flight) for _ in range(8)]
    assert landed == [3] * 6 + [1] * 2


def test_both_prefill_workers_feed_their_own_partner_at_once() -> None:
    _, router = pcie_box()
    p0, p2 = worker(0, "prefill", 0), worker(2, "prefill", 2)
    d1, d3 = worker(1, "decode", 1, 30), worker(3, "decode", 3, 30)
    in_flight: Counter[int] = Counter()
    landed = [(s.device_index, hand_off(router, [d1, d3], s, in_flight)) for s in [p0, p2] * 5]
    assert set(landed) == {(0, 1), (2, 3)}


def test_without_room_anywhere_the_most_free_worker_is_asked() -> None:
    _, router = pcie_box()
    p0, d1, d3 = worker(0, "prefill", 0), worker(1, "decode", 1, 1), worker(3, "decode", 3, 2)
    assert router.decode([d1, d3], {}, p0, BLOCKS) is d3  # the partner has less free


def test_on_cpu_devices_links_are_equal_and_the_most_free_blocks_decide() -> None:
    topology = cpu_box(cores=4, devices=4)
    router = Router(16, True, topology.bandwidth_rank)
    d1, d2, d3 = worker(1, "decode", 1, 10), worker(2, "decode", 2, 40), worker(3, "decode", 3, 40)
    d2.running, d3.running = 5, 2
    for source in (worker(0, "prefill", 0), worker(4, "prefill", 1)):  # whichever device
        assert router.decode([d1, d2, d3], {}, source, BLOCKS) is d3  # ties: fewer running
        assert router.decode([d1, d2, d3], {3: 3}, source, BLOCKS) is d2
        assert router.decode([d1, d2, d3], {2: 31, 3: 31}, source, BLOCKS) is d1
