"""Device discovery and prefill/decode partitioning on plain-data models of real boxes.

NVML cannot run here, so GPU discovery is driven by `FakeNvml` (tests/helpers/nvml_boxes.py),
which answers pynvml's calls from its box descriptions (and keeps pynvml's own constants
and errors). The pure mapping from NVML's list to torch ordinals is tested in
test_device_mapping.py; here it is tested through discovery, with links,
CUDA_VISIBLE_DEVICES and host facts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pynvml
import pytest
from nvml_boxes import (
    H100_NVSWITCH,
    MIB,
    MIG_BOX,
    MIG_UUIDS,
    MIXED,
    NO_GPUS,
    NO_SIGNS,
    PCIE_4GPU,
    SIGNS,
    TWO_GPU_NO_P2P,
    FakeNvml,
    cpu_box,
    cuda_torch,
    gpus,
)
from tests_root import ROOT as ROOT_DIR

from appliance.pools.supervisor import worker_layout
from appliance.settings.config import SettingsError, load_settings, parse_devices
from appliance.topology.cpu import cpu_devices, pin_to_cores
from appliance.topology.cuda_order import TorchFacts
from appliance.topology.devices import Device, DeviceError, Link, NvmlFailed, Topology
from appliance.topology.discovery import HostFacts, discover
from appliance.topology.nvml import discover_gpus
from appliance.topology.partition import (
    Partition,
    pair_decode,
    partition,
    prefill_count,
    tp_groups,
)

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
    assert [d.ordinal for d in topology.devices] == list(range(8))
    assert [d.nvml_index for d in topology.devices] == list(range(8))
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


def test_nvml_that_fails_to_init_says_why() -> None:
    nvml = FakeNvml(H100_NVSWITCH, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(NvmlFailed, match="NVML did not start: Driver Not Loaded"):
        discover_gpus(nvml)


def test_nvml_without_gpus_yields_nothing() -> None:
    nvml = FakeNvml(NO_GPUS)
    assert discover_gpus(nvml) is None and not nvml.open


def test_nvml_error_midway_says_why_and_shuts_down() -> None:
    box = {**PCIE_4GPU, "gpus": [*PCIE_4GPU["gpus"][:3], {**PCIE_4GPU["gpus"][3], "lost": True}]}
    nvml = FakeNvml(box)
    with pytest.raises(NvmlFailed, match="NVML failed reading the GPUs: GPU is lost"):
        discover_gpus(nvml)
    assert not nvml.open


def test_the_real_pynvml_finds_gpus_or_says_why_not() -> None:
    try:
        topology = discover_gpus(pynvml)  # NvmlFailed here (no driver); GPUs on a GPU box
    except NvmlFailed as exc:
        assert str(exc).startswith("NVML did not start: ")
    else:
        assert topology is None or {d.kind for d in topology.devices} == {"cuda"}


def test_discover_auto_prefers_gpus_and_falls_back_to_cpu_without_nvidia_signs() -> None:
    h100 = FakeNvml(H100_NVSWITCH)
    found = discover("auto", 1, nvml=h100, host=NO_SIGNS, torch_facts=cuda_torch(8))
    assert [d.kind for d in found.devices] == ["cuda"] * 8
    for nvml in (
        FakeNvml(H100_NVSWITCH, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND),
        FakeNvml(NO_GPUS),
    ):
        (device,) = discover("auto", 1, nvml=nvml, host=NO_SIGNS).devices
        assert device.kind == "cpu" and device.cores == tuple(sorted(os.sched_getaffinity(0)))


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "RM has detected an NVML/RM version mismatch"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "Insufficient Permissions"),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"),
    ],
)
def test_discover_auto_on_nvidia_hardware_says_what_failed_instead_of_using_the_cpu(
    error: int, reason: str
) -> None:
    nvml = FakeNvml(H100_NVSWITCH, init_error=error)
    with pytest.raises(DeviceError) as info:
        discover("auto", 128, nvml=nvml, host=SIGNS, torch_facts=cuda_torch(8))
    message = str(info.value)
    assert message.startswith("APPLIANCE_DEVICE=auto: this host shows NVIDIA hardware")
    assert "/dev/nvidia0, /proc/driver/nvidia/version" in message
    assert f"NVML did not start: {reason}" in message
    assert "not falling back to the CPU" in message and "APPLIANCE_DEVICE=cpu" in message
    assert "\n" not in message


def test_discover_auto_on_nvidia_hardware_with_a_lost_gpu_or_no_gpu_says_so() -> None:
    box = {**PCIE_4GPU, "gpus": [*PCIE_4GPU["gpus"][:3], {**PCIE_4GPU["gpus"][3], "lost": True}]}
    with pytest.raises(DeviceError, match="NVML failed reading the GPUs: GPU is lost"):
        discover("auto", 1, nvml=FakeNvml(box), host=SIGNS)
    with pytest.raises(DeviceError, match=r"NVIDIA hardware .* \(NVML lists no GPU\)"):
        discover("auto", 1, nvml=FakeNvml(NO_GPUS), host=SIGNS)


def test_discover_cuda_without_gpus_says_so() -> None:
    broken = FakeNvml(H100_NVSWITCH, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(
        DeviceError,
        match=r"APPLIANCE_DEVICE=cuda but NVML found no NVIDIA GPU \(NVML did not start: Dri",
    ):
        discover("cuda", 1, nvml=broken, host=NO_SIGNS)
    with pytest.raises(DeviceError, match=r"APPLIANCE_DEVICE=cuda .*\(NVML lists no GPU\)"):
        discover("cuda", 1, nvml=FakeNvml(NO_GPUS), host=NO_SIGNS)


def test_discover_refuses_gpus_torch_cannot_use() -> None:
    cpu_build = TorchFacts("2.6.0+cpu", None, False, 0)
    with pytest.raises(DeviceError, match=r"torch 2.6.0\+cpu is a CPU-only build .* 8 GPU"):
        discover("auto", 1, nvml=FakeNvml(H100_NVSWITCH), host=NO_SIGNS, torch_facts=cpu_build)
    visible = HostFacts("4,5,6,7")
    with pytest.raises(DeviceError, match=r"torch sees 8 CUDA device.* expects the 4 GPU"):
        discover("cuda", 1, nvml=FakeNvml(H100_NVSWITCH), host=visible, torch_facts=cuda_torch(8))
    topology = discover("cuda", 1, FakeNvml(H100_NVSWITCH), host=visible, torch_facts=cuda_torch(4))
    assert len(topology.devices) == 4


# --- GPUs through CUDA_VISIBLE_DEVICES -------------------------------------------------


def test_a_visible_subset_gets_ordinals_from_zero_and_keeps_nvml_for_stats() -> None:
    topology = gpus(H100_NVSWITCH, "4,5,6,7")
    devices = topology.devices
    assert [(d.index, d.ordinal, d.nvml_index) for d in devices] == [
        (0, 0, 4),
        (1, 1, 5),
        (2, 2, 6),
        (3, 3, 7),
    ]
    assert [d.pci_bus_id for d in devices] == [
        f"00000000:{b}:00.0" for b in ("9a", "ab", "ba", "db")
    ]
    assert devices[1].utilization == 100  # NVML GPU 5's statistics, not GPU 1's
    assert {topology.links[a][b] for a in range(4) for b in range(4) if a != b} == {
        Link("nvlink", 18)
    }


def test_visible_gpus_take_the_order_cuda_visible_devices_gives() -> None:
    topology = gpus(PCIE_4GPU, "3,0")
    assert [d.nvml_index for d in topology.devices] == [3, 0]
    assert topology.links[0][1] == Link("p2p-pcie")


def test_an_nvlink_to_a_hidden_gpu_is_not_taken_for_a_switch() -> None:
    # GPU 0's 12 NVLinks go to GPU 1; with GPU 1 hidden, 0 and 2 still share only PCIe.
    topology = gpus(PCIE_4GPU, "0,2")
    assert topology.links[0][1] == Link("p2p-pcie")


def test_mixed_gpus_are_numbered_by_pci_bus_not_by_speed() -> None:
    topology = gpus(MIXED)
    names = [d.name for d in topology.devices]
    assert names == ["NVIDIA GeForce RTX 4090", "NVIDIA H100 PCIe"] * 2
    assert [d.ordinal for d in topology.devices] == [0, 1, 2, 3]
    assert [d.uuid for d in topology.devices][::2] == ["GPU-4090a", "GPU-4090b"]
    assert topology.links[1][3] == Link("nvlink", 12)  # the two H100s, wherever they sit
    assert [d.utilization for d in topology.devices][::2] == [5, 7]


def test_nvml_listing_gpus_out_of_bus_order_still_gets_bus_ordinals() -> None:
    # NVML's index is not promised to follow the bus: the H100s listed first here.
    box = {**MIXED, "gpus": [MIXED["gpus"][i] for i in (1, 3, 0, 2)]}
    topology = gpus(box)
    assert [d.pci_bus_id[9:11] for d in topology.devices] == ["01", "21", "41", "81"]
    assert [d.nvml_index for d in topology.devices] == [2, 0, 3, 1]
    assert topology.links[1][3] == Link("nvlink", 12)


def test_mixed_gpus_picked_by_uuid() -> None:
    topology = gpus(MIXED, "GPU-4090b,GPU-4090a")
    assert [(d.ordinal, d.pci_bus_id) for d in topology.devices] == [
        (0, "00000000:41:00.0"),
        (1, "00000000:01:00.0"),
    ]


@pytest.mark.parametrize("visible", ["", "-1"])
def test_hiding_every_gpu_is_refused_not_served_on_the_cpu(visible: str) -> None:
    for setting in ("auto", "cuda"):
        with pytest.raises(DeviceError) as info:
            discover(setting, 1, nvml=FakeNvml(H100_NVSWITCH), host=HostFacts(visible))
        assert str(info.value) == (
            f"CUDA_VISIBLE_DEVICES={visible!r} hides all 8 GPU(s) NVML lists "
            "(8x NVIDIA H100 80GB HBM3): unset it to serve on them, or set "
            "APPLIANCE_DEVICE=cpu to serve on the CPU"
        )


def test_a_gpu_in_mig_mode_is_refused_by_name_unless_hidden() -> None:
    nvml = FakeNvml(MIG_BOX)
    with pytest.raises(DeviceError) as info:
        discover_gpus(nvml)
    assert str(info.value) == (
        "GPU 3 (NVIDIA A100 80GB PCIe 00000000:41:00.0) is in MIG mode; MIG instances are "
        "not supported yet: disable MIG (nvidia-smi -i 3 -mig 0) or hide it with "
        "CUDA_VISIBLE_DEVICES"
    )
    assert not nvml.open
    # By bus (17, 31, 41, b1) NVML's GPU 3 is CUDA's 2: hiding it leaves the other three.
    topology = gpus(MIG_BOX, "0,1,3")
    assert [d.nvml_index for d in topology.devices] == [0, 1, 2]
    with pytest.raises(DeviceError, match=r"GPU 3 .* is in MIG mode"):
        discover_gpus(FakeNvml(MIG_BOX), MIG_UUIDS[1])


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


@pytest.mark.process  # a child python that imports torch
def test_pin_to_cores_pins_every_thread_and_torch() -> None:
    # A subprocess, so this test process keeps its affinity and torch thread count.
    script = """
import json, os, threading, torch
from appliance.topology.cpu import pin_to_cores
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
    root = ROOT_DIR
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


def test_explicit_pools_are_paired_by_links() -> None:
    part = partition(gpus(PCIE_4GPU), "disaggregated", parse_devices("1"), parse_devices("0,2-3"))
    assert (part.prefill, part.decode, part.pairs) == ((1,), (0, 2, 3), {0: 1, 2: 1, 3: 1})


def test_one_list_leaves_the_rest_to_the_other_pool() -> None:
    topology = gpus(PCIE_4GPU)
    part = partition(topology, "disaggregated", prefill=parse_devices("0-2"))
    assert (part.decode, part.pairs) == ((3,), {3: 2})  # 3's NVLink partner
    assert partition(topology, "disaggregated", decode=parse_devices("3")).prefill == (0, 1, 2)


def test_both_lists_may_leave_devices_idle() -> None:
    part = partition(gpus(PCIE_4GPU), "disaggregated", parse_devices("0"), parse_devices("2"))
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
        partition(gpus(PCIE_4GPU), "disaggregated", parse_devices(prefill), parse_devices(decode))
    assert message in str(info.value)


# --- colocated workers beside the pools -------------------------------------------------


@pytest.mark.parametrize(
    ("prefill", "decode", "colocated", "expected"),
    [
        (None, None, "1-3", ((), (0,))),  # one device left: it decodes
        (None, None, "3", ((0,), (1, 2))),  # three left: split as the automatic split does
        (None, "1", "0", ((2, 3), (1,))),
        ("1", "2", "0", ((1,), (2,))),  # device 3 idle
        (None, "1-3", "0", ((), (1, 2, 3))),  # decode workers with no prefill pool: allowed
    ],
)
def test_colocated_devices_sit_beside_the_pools(
    prefill: str | None, decode: str | None, colocated: str, expected: tuple
) -> None:
    lists = parse_devices(prefill), parse_devices(decode), parse_devices(colocated)
    part = partition(gpus(PCIE_4GPU), "disaggregated", *lists)
    assert (part.prefill, part.decode) == expected
    assert part.colocated == parse_devices(colocated)
    assert set(part.pairs) == set(part.decode) if part.prefill else part.pairs == {}


@pytest.mark.parametrize(
    ("prefill", "decode", "colocated", "message"),
    [
        ("0", "1", "0", "device 0 is in both APPLIANCE_PREFILL_DEVICES='0' and APPLIANCE_COLO"),
        (None, "2", "2", "device 2 is in both APPLIANCE_DECODE_DEVICES='2' and APPLIANCE_COLO"),
        ("1-3", None, "0", "APPLIANCE_PREFILL_DEVICES='1,2,3' has no decode pool to hand off"),
        (None, None, "5", "APPLIANCE_COLOCATED_DEVICES='5' names device 5"),
    ],
)
def test_bad_colocated_lists_name_the_setting(
    prefill: str | None, decode: str | None, colocated: str, message: str
) -> None:
    lists = parse_devices(prefill), parse_devices(decode), parse_devices(colocated)
    with pytest.raises(ValueError) as info:
        partition(gpus(PCIE_4GPU), "disaggregated", *lists)
    assert message in str(info.value)


def test_colocated_devices_run_one_colocated_worker_each() -> None:
    settings = load_settings(
        device="cpu", cpu_devices=3, prefill_devices="1", decode_devices="2", colocated_devices="0"
    )
    topology = cpu_box(cores=3, devices=3)
    part = partition(topology, "disaggregated", (1,), (2,), (0,))
    assert worker_layout(topology, part, settings) == [
        ("prefill", (1,)),
        ("decode", (2,)),
        ("colocated", (0,)),
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mode": "colocated", "colocated_devices": "0"}, "in colocated mode choose the devices"),
        ({"colocated_devices": "0", "decode_tp": 2}, "set prefill_tp and decode_tp to 1"),
    ],
)
def test_colocated_devices_settings_refuse_what_cannot_run(values: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(device="cpu", **values)


def test_pair_decode_breaks_ties_by_load_then_index() -> None:
    topology = cpu_box(cores=5, devices=5)
    assert pair_decode(topology, [3, 1], [0, 2, 4]) == {0: 1, 2: 3, 4: 1}


# --- colocated mode --------------------------------------------------------------------


def test_colocated_puts_every_device_in_both_pools_without_pairs() -> None:
    part = partition(gpus(H100_NVSWITCH), "colocated")
    assert part == Partition("colocated", tuple(range(8)), tuple(range(8)), {})


def test_colocated_works_on_one_device_and_uses_listed_devices() -> None:
    assert partition(cpu_box(cores=2, devices=1), "colocated").prefill == (0,)
    part = partition(gpus(PCIE_4GPU), "colocated", parse_devices("1"), parse_devices("3"))
    assert part.prefill == part.decode == (1, 3) and part.pairs == {}
    with pytest.raises(ValueError, match="APPLIANCE_DECODE_DEVICES='5'"):
        partition(gpus(PCIE_4GPU), "colocated", decode=parse_devices("5"))


def test_devices_are_frozen() -> None:
    device = Device("cpu", 0, "cpu0", 1, 1)
    with pytest.raises(AttributeError):
        device.index = 1  # type: ignore[misc]


def test_a_gpu_device_needs_a_torch_ordinal_and_may_share_it() -> None:
    with pytest.raises(ValueError, match=r"GPU device 1 .* needs a torch ordinal"):
        Device("cuda", 1, "NVIDIA H200", 1, 1)
    two = [Device("cuda", i, "NVIDIA H200", 1, 1, ordinal=0) for i in (0, 1)]
    assert [d.ordinal for d in Topology.without_links(two).devices] == [0, 0]


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
