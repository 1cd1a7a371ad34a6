"""Device discovery and prefill/decode partitioning on plain-data models of real boxes.

NVML cannot run here, so GPU discovery is driven by `FakeNvml`, which answers pynvml's
calls from the box descriptions below (and keeps pynvml's own constants and errors).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from appliance.topology import (
    Device,
    Link,
    Partition,
    Topology,
    cpu_devices,
    discover,
    discover_gpus,
    pair_decode,
    parse_devices,
    partition,
    pin_to_cores,
    prefill_count,
    tp_groups,
)

MIB = 1 << 20

# --- recorded boxes --------------------------------------------------------------------

# HGX H100 baseboard: each GPU's 18 NVLinks go 5/4/4/5 to four NVSwitch chips, so NVML
# reports switch bus ids, not GPUs, at the far end of every link.
_SWITCHES = ("00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0")
_H100_PORTS = [_SWITCHES[0]] * 5 + [_SWITCHES[1]] * 4 + [_SWITCHES[2]] * 4 + [_SWITCHES[3]] * 5

H100_NVSWITCH = {
    "gpus": [
        {
            "name": "NVIDIA H100 80GB HBM3",
            "bus": f"00000000:{bus}:00.0",
            "total": 81559 * MIB,
            "free": 81004 * MIB,
            "util": util,
            "nvlinks": _H100_PORTS,
        }
        for bus, util in zip(
            ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db"),
            (0, 0, 7, 0, 0, 100, 0, 0),
            strict=True,
        )
    ],
    "p2p": True,
}

# Four PCIe A100s with NVLink bridges (3 bridges = 12 links) joining 0-1 and 2-3; one of
# the 2-3 links is down. P2P over PCIe works between all pairs.
_A100 = {"name": "NVIDIA A100 80GB PCIe", "total": 81920 * MIB, "free": 81038 * MIB, "util": 3}
PCIE_4GPU = {
    "gpus": [
        {**_A100, "bus": "00000000:17:00.0", "nvlinks": ["00000000:31:00.0"] * 12},
        {**_A100, "bus": "00000000:31:00.0", "nvlinks": ["00000000:17:00.0"] * 12},
        {**_A100, "bus": "00000000:b1:00.0", "nvlinks": ["00000000:ca:00.0"] * 12},
        {**_A100, "bus": "00000000:ca:00.0", "nvlinks": ["00000000:b1:00.0"] * 11 + [None]},
    ],
    "p2p": True,
}

# Two consumer GPUs: no NVLink (NVML answers NOT_SUPPORTED) and P2P disabled by the driver;
# the second one does not report utilization.
_RTX = {"name": "NVIDIA GeForce RTX 4090", "total": 24564 * MIB, "free": 24212 * MIB}
TWO_GPU_NO_P2P = {
    "gpus": [
        {**_RTX, "bus": "00000000:01:00.0", "util": 12, "nvlinks": None},
        {**_RTX, "bus": "00000000:41:00.0", "util": None, "nvlinks": None},
    ],
    "p2p": False,
}

NO_GPUS = {"gpus": [], "p2p": False}


@dataclass(frozen=True)
class _Handle:
    index: int


def _pci(bus_id: str) -> SimpleNamespace:
    domain, bus, rest = bus_id.split(":")
    device = rest.split(".")[0]
    return SimpleNamespace(
        busId=bus_id, domain=int(domain, 16), bus=int(bus, 16), device=int(device, 16)
    )


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeNvml:
    """The part of pynvml that discovery calls, answering from a box description."""

    NVMLError = pynvml.NVMLError
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
    NVML_P2P_CAPS_INDEX_READ = pynvml.NVML_P2P_CAPS_INDEX_READ  # really `(0,)` in pynvml
    NVML_P2P_STATUS_OK = pynvml.NVML_P2P_STATUS_OK

    def __init__(self, box: dict[str, Any], init_error: int | None = None) -> None:
        self.box = box
        self.init_error = init_error
        self.open = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise _error(self.init_error)
        self.open = True

    def nvmlShutdown(self) -> None:
        self.open = False

    def _gpu(self, handle: _Handle) -> dict[str, Any]:
        assert self.open, "NVML called before nvmlInit or after nvmlShutdown"
        gpu = self.box["gpus"][handle.index]
        if gpu.get("lost"):
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def nvmlDeviceGetCount(self) -> int:
        assert self.open
        return len(self.box["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        return _Handle(index)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._gpu(handle)["name"]

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:
        gpu = self._gpu(handle)
        return SimpleNamespace(
            total=gpu["total"], free=gpu["free"], used=gpu["total"] - gpu["free"]
        )

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:
        util = self._gpu(handle)["util"]
        if util is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=util, memory=0)

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> SimpleNamespace:
        return _pci(self._gpu(handle)["bus"])

    def _remote(self, handle: _Handle, link: int) -> str | None:
        links = self._gpu(handle)["nvlinks"]
        if links is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link >= len(links):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return links[link]

    def nvmlDeviceGetNvLinkState(self, handle: _Handle, link: int) -> int:
        up = self._remote(handle, link) is not None
        return pynvml.NVML_FEATURE_ENABLED if up else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: _Handle, link: int) -> SimpleNamespace:
        remote = self._remote(handle, link)
        if remote is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _pci(remote)

    def nvmlDeviceGetP2PStatus(self, a: _Handle, b: _Handle, index: int) -> int:
        if not isinstance(index, int):  # what ctypes does with pynvml's tuple constant
            raise ctypes.ArgumentError("argument 3: Don't know how to convert parameter 3")
        self._gpu(a)
        self._gpu(b)
        ok = self.box["p2p"] and index == 0
        return pynvml.NVML_P2P_STATUS_OK if ok else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED


def gpus(box: dict[str, Any]) -> Topology:
    topology = discover_gpus(FakeNvml(box))
    assert topology is not None
    return topology


def cpu_box(cores: int, devices: int) -> Topology:
    return Topology.without_links(cpu_devices(devices, cores=range(cores)))


# --- data ------------------------------------------------------------------------------


def test_link_rank_orders_nvlink_count_then_pcie_then_none() -> None:
    ranks = [Link("nvlink", 18), Link("nvlink", 12), Link("p2p-pcie"), Link("none")]
    assert [link.rank for link in ranks] == sorted((link.rank for link in ranks), reverse=True)
    assert len({link.rank for link in ranks}) == 4


def test_topology_rejects_a_link_matrix_of_the_wrong_size() -> None:
    devices = cpu_devices(2, cores=[0, 1])
    with pytest.raises(ValueError, match="2x2"):
        Topology(devices, ((Link("none"),),))


# --- GPU discovery ---------------------------------------------------------------------


def test_h100_nvswitch_box_links_every_pair_with_18_nvlinks() -> None:
    nvml = FakeNvml(H100_NVSWITCH)
    topology = discover_gpus(nvml)
    assert topology is not None and not nvml.open  # shut NVML down again
    assert [d.index for d in topology.devices] == list(range(8))
    first = topology.devices[0]
    assert (first.kind, first.name, first.total_memory) == (
        "cuda",
        "NVIDIA H100 80GB HBM3",
        81559 * MIB,
    )
    assert (first.free_memory, first.pci_bus_id) == (81004 * MIB, "00000000:18:00.0")
    assert topology.devices[5].utilization == 100
    pairs = [(a, b) for a in range(8) for b in range(8) if a != b]
    assert {topology.links[a][b] for a, b in pairs} == {Link("nvlink", 18)}


def test_pcie_box_sees_its_two_nvlink_pairs_and_pcie_p2p_elsewhere() -> None:
    topology = gpus(PCIE_4GPU)
    links = topology.links
    assert links[0][1] == links[1][0] == Link("nvlink", 12)
    assert links[2][3] == links[3][2] == Link("nvlink", 11)  # the down link is not counted
    for a, b in [(0, 2), (0, 3), (1, 2), (1, 3)]:
        assert links[a][b] == links[b][a] == Link("p2p-pcie")
    rank = topology.bandwidth_rank
    assert rank(0, 1) > rank(2, 3) > rank(0, 2) > Link("none").rank


def test_two_gpus_without_p2p_or_nvlink_have_no_link() -> None:
    topology = gpus(TWO_GPU_NO_P2P)
    assert topology.links[0][1] == Link("none")
    assert [d.utilization for d in topology.devices] == [12, None]


def test_nvml_that_fails_to_init_yields_nothing() -> None:
    nvml = FakeNvml(H100_NVSWITCH, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert discover_gpus(nvml) is None


def test_nvml_without_gpus_yields_nothing() -> None:
    nvml = FakeNvml(NO_GPUS)
    assert discover_gpus(nvml) is None and not nvml.open


def test_nvml_error_midway_yields_nothing_and_shuts_down() -> None:
    box = {**PCIE_4GPU, "gpus": [*PCIE_4GPU["gpus"][:3], {**PCIE_4GPU["gpus"][3], "lost": True}]}
    nvml = FakeNvml(box)
    assert discover_gpus(nvml) is None and not nvml.open


def test_the_real_pynvml_never_crashes_discovery() -> None:
    topology = discover_gpus(pynvml)  # None here (no driver); GPUs on a GPU box
    assert topology is None or {d.kind for d in topology.devices} == {"cuda"}


def test_discover_auto_prefers_gpus_and_falls_back_to_cpu() -> None:
    assert len(discover("auto", 1, nvml=FakeNvml(H100_NVSWITCH)).devices) == 8
    broken = FakeNvml(H100_NVSWITCH, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    (device,) = discover("auto", 1, nvml=broken).devices
    assert device.kind == "cpu" and device.cores == tuple(sorted(os.sched_getaffinity(0)))


def test_discover_cuda_without_gpus_says_so() -> None:
    broken = FakeNvml(H100_NVSWITCH, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(ValueError, match="APPLIANCE_DEVICE=cuda but NVML found no NVIDIA GPU"):
        discover("cuda", 1, nvml=broken)
    with pytest.raises(ValueError, match="APPLIANCE_DEVICE=cuda"):
        discover("cuda", 1, nvml=FakeNvml(NO_GPUS))


def test_discover_cpu_ignores_gpus_and_bad_setting_is_named() -> None:
    (device,) = discover("cpu", 1, nvml=FakeNvml(H100_NVSWITCH)).devices
    assert device.kind == "cpu"
    with pytest.raises(ValueError, match="APPLIANCE_DEVICE='tpu'"):
        discover("tpu", 1)


# --- CPU devices -----------------------------------------------------------------------


def test_two_cores_make_two_one_core_devices() -> None:
    devices = cpu_devices(2, cores=[0, 1])
    assert [d.cores for d in devices] == [(0,), (1,)]
    assert [d.name for d in devices] == ["cpu0 (cores 0)", "cpu1 (cores 1)"]
    assert all(d.kind == "cpu" and d.utilization is None for d in devices)


def test_sixteen_cores_split_six_five_five_and_share_memory() -> None:
    devices = cpu_devices(3, cores=range(16))
    assert [d.cores for d in devices] == [
        tuple(range(6)),
        tuple(range(6, 11)),
        tuple(range(11, 16)),
    ]
    assert devices[0].name == "cpu0 (cores 0-5)"
    page = os.sysconf("SC_PAGE_SIZE")
    assert 0 < 3 * devices[0].total_memory <= os.sysconf("SC_PHYS_PAGES") * page


def test_scattered_cores_are_named_one_by_one() -> None:
    devices = cpu_devices(2, cores={6, 0, 4, 2})
    assert [d.cores for d in devices] == [(0, 2), (4, 6)]
    assert devices[1].name == "cpu1 (cores 4,6)"


def test_default_cores_are_this_process_affinity() -> None:
    (device,) = cpu_devices(1)
    assert device.cores == tuple(sorted(os.sched_getaffinity(0)))


def test_more_cpu_devices_than_cores_is_an_error() -> None:
    with pytest.raises(ValueError, match="asked for 3 CPU devices but only 2 usable cores"):
        cpu_devices(3, cores=[0, 1])
    with pytest.raises(ValueError, match="at least 1 CPU device"):
        cpu_devices(0, cores=[0, 1])


def test_pin_to_cores_pins_every_thread_and_torch() -> None:
    # A subprocess, so this test process keeps its affinity and torch thread count.
    script = """
import json, os, threading, torch
from appliance.topology import pin_to_cores
core = min(os.sched_getaffinity(0))
done = threading.Event()
thread = threading.Thread(target=done.wait)
thread.start()
pin_to_cores([core])
print(json.dumps({"core": core, "main": sorted(os.sched_getaffinity(0)),
                  "thread": sorted(os.sched_getaffinity(thread.native_id)),
                  "torch": torch.get_num_threads()}))
done.set()
"""
    before = os.sched_getaffinity(0)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["main"] == seen["thread"] == [seen["core"]] and seen["torch"] == 1
    assert os.sched_getaffinity(0) == before


def test_pin_to_no_cores_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one core"):
        pin_to_cores([])


# --- automatic partitions --------------------------------------------------------------


def check(topology: Topology, part: Partition, prefill: int) -> None:
    """Pools of the expected size that cover the box, and best-linked pairs."""
    assert len(part.prefill) == prefill and not set(part.prefill) & set(part.decode)
    assert sorted(part.prefill + part.decode) == list(range(len(topology.devices)))
    assert sorted(part.pairs) == list(part.decode)
    for d, p in part.pairs.items():
        assert p in part.prefill
        best = max(topology.bandwidth_rank(d, q) for q in part.prefill)
        assert topology.bandwidth_rank(d, p) == best


@pytest.mark.parametrize(("n", "prefill"), [(2, 1), (3, 1), (4, 2), (8, 3), (16, 6)])
def test_prefill_count_is_a_third_rounded_up(n: int, prefill: int) -> None:
    assert prefill_count(n) == prefill


def test_h100_box_splits_three_prefill_five_decode_evenly() -> None:
    topology = gpus(H100_NVSWITCH)
    part = partition(topology, "disaggregated")
    check(topology, part, 3)
    assert part.prefill == (0, 1, 2)
    assert part.pairs == {3: 0, 4: 1, 5: 2, 6: 0, 7: 1}  # equal links: fewest paired wins


def test_pcie_box_puts_one_device_of_each_nvlink_pair_in_prefill() -> None:
    topology = gpus(PCIE_4GPU)
    part = partition(topology, "disaggregated")
    check(topology, part, 2)
    assert (part.prefill, part.decode, part.pairs) == ((0, 2), (1, 3), {1: 0, 3: 2})
    assert all(topology.links[d][p].kind == "nvlink" for d, p in part.pairs.items())


def test_split_follows_the_nvlink_pairs_not_the_indices() -> None:
    # NVLink bridges join 0-3 and 1-2, so prefill must take one of each: not 0 and 2.
    nv, pcie = Link("nvlink", 4), Link("p2p-pcie")
    links = [[pcie] * 4 for _ in range(4)]
    links[0][3] = links[3][0] = links[1][2] = links[2][1] = nv
    topology = Topology(tuple(gpus(PCIE_4GPU).devices), tuple(map(tuple, links)))
    part = partition(topology, "disaggregated")
    check(topology, part, 2)
    assert part.prefill == (0, 1) and part.pairs == {2: 1, 3: 0}


def test_two_gpus_without_p2p_still_split_one_and_one() -> None:
    topology = gpus(TWO_GPU_NO_P2P)
    part = partition(topology, "disaggregated")
    check(topology, part, 1)
    assert part.pairs == {1: 0}


def test_cpu_boxes_split_their_core_sets() -> None:
    two = partition(cpu_box(cores=2, devices=2), "disaggregated")
    assert (two.prefill, two.decode, two.pairs) == ((0,), (1,), {1: 0})
    topology = cpu_box(cores=16, devices=3)
    sixteen = partition(topology, "disaggregated")
    check(topology, sixteen, 1)
    assert sixteen.prefill == (0,) and len(topology.devices[0].cores) == 6


def test_large_box_uses_the_greedy_split() -> None:
    topology = cpu_box(cores=24, devices=24)  # C(24, 8) sets: too many to try all
    part = partition(topology, "disaggregated")
    check(topology, part, 8)
    assert max(list(part.pairs.values()).count(p) for p in part.prefill) == 2  # 16 over 8


def test_one_device_box_suggests_colocated_mode() -> None:
    with pytest.raises(ValueError, match=r"at least 2 devices.*APPLIANCE_MODE=colocated"):
        partition(cpu_box(cores=2, devices=1), "disaggregated")


def test_unknown_mode_is_named() -> None:
    with pytest.raises(ValueError, match="APPLIANCE_MODE='mixed'"):
        partition(cpu_box(cores=2, devices=2), "mixed")


# --- explicit device lists -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0,1", (0, 1)), ("0-3", (0, 1, 2, 3)), (" 0-1, 3 ", (0, 1, 3)), ("2,2", (2,))],
)
def test_parse_devices(text: str, expected: tuple[int, ...]) -> None:
    assert parse_devices(text, "APPLIANCE_PREFILL_DEVICES") == expected


@pytest.mark.parametrize("text", [None, "", "  "])
def test_blank_device_list_means_automatic(text: str | None) -> None:
    assert parse_devices(text, "APPLIANCE_PREFILL_DEVICES") is None


@pytest.mark.parametrize(("text", "message"), [("a", "like '0,1' or '0-3'"), ("3-1", "backwards")])
def test_unreadable_device_list_names_the_setting(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"APPLIANCE_DECODE_DEVICES='{text}'.*{message}"):
        parse_devices(text, "APPLIANCE_DECODE_DEVICES")


def test_explicit_pools_are_paired_by_links() -> None:
    part = partition(gpus(PCIE_4GPU), "disaggregated", prefill="1", decode="0,2-3")
    assert (part.prefill, part.decode, part.pairs) == ((1,), (0, 2, 3), {0: 1, 2: 1, 3: 1})


def test_one_list_leaves_the_rest_to_the_other_pool() -> None:
    topology = gpus(PCIE_4GPU)
    part = partition(topology, "disaggregated", prefill="0-2")
    assert (part.decode, part.pairs) == ((3,), {3: 2})  # 3's NVLink partner
    assert partition(topology, "disaggregated", decode="3").prefill == (0, 1, 2)


def test_both_lists_may_leave_devices_idle() -> None:
    part = partition(gpus(PCIE_4GPU), "disaggregated", prefill="0", decode="2")
    assert (part.prefill, part.decode, part.pairs) == ((0,), (2,), {2: 0})


@pytest.mark.parametrize(
    ("prefill", "decode", "message"),
    [
        ("0,7", None, "APPLIANCE_PREFILL_DEVICES='0,7' names device 7, but this box has 4"),
        (None, "9", "APPLIANCE_DECODE_DEVICES='9' names device 9"),
        ("0,1", "1-3", "device 1 is in both APPLIANCE_PREFILL_DEVICES='0,1' and APPLIANCE_DECODE"),
        ("0-3", None, "APPLIANCE_DECODE_DEVICES is empty"),
        (None, "0-3", "APPLIANCE_PREFILL_DEVICES is empty"),
    ],
)
def test_bad_device_lists_name_the_setting(
    prefill: str | None, decode: str | None, message: str
) -> None:
    with pytest.raises(ValueError) as info:
        partition(gpus(PCIE_4GPU), "disaggregated", prefill=prefill, decode=decode)
    assert message in str(info.value)


def test_pair_decode_breaks_ties_by_load_then_index() -> None:
    topology = cpu_box(cores=5, devices=5)
    assert pair_decode(topology, [3, 1], [0, 2, 4]) == {0: 1, 2: 3, 4: 1}


# --- colocated mode --------------------------------------------------------------------


def test_colocated_puts_every_device_in_both_pools_without_pairs() -> None:
    part = partition(gpus(H100_NVSWITCH), "colocated")
    assert part == Partition("colocated", tuple(range(8)), tuple(range(8)), {})


def test_colocated_works_on_one_device_and_uses_listed_devices() -> None:
    assert partition(cpu_box(cores=2, devices=1), "colocated").prefill == (0,)
    part = partition(gpus(PCIE_4GPU), "colocated", prefill="1", decode="3")
    assert part.prefill == part.decode == (1, 3) and part.pairs == {}
    with pytest.raises(ValueError, match="APPLIANCE_DECODE_DEVICES='5'"):
        partition(gpus(PCIE_4GPU), "colocated", decode="5")


def test_devices_are_frozen() -> None:
    device = Device("cpu", 0, "cpu0", 1, 1)
    with pytest.raises(AttributeError):
        device.index = 1  # type: ignore[misc]


def test_tensor_parallel_groups_take_the_nvlink_pairs_whatever_the_order() -> None:
    topology = gpus(PCIE_4GPU)  # NVLink joins 0-1 and 2-3; PCIe elsewhere
    assert tp_groups(topology, [0, 2, 1, 3], 2, "prefill_tp") == [(0, 1), (2, 3)]
    assert tp_groups(topology, [3, 1, 2, 0], 4, "decode_tp") == [(0, 1, 2, 3)]
    assert tp_groups(topology, [2, 0], 1, "decode_tp") == [(0,), (2,)]


def test_tensor_parallel_groups_on_a_switch_box_are_in_device_order() -> None:
    topology = gpus(H100_NVSWITCH)  # every pair equally linked
    assert tp_groups(topology, range(8), 4, "prefill_tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_a_pool_the_degree_does_not_divide_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"decode_tp=2 does not divide the pool's 3 device"):
        tp_groups(cpu_box(4, 4), [1, 2, 3], 2, "decode_tp")
