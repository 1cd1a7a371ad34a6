"""Which GPU each torch ordinal is: NVML's list mapped the way CUDA numbers GPUs under
CUDA_DEVICE_ORDER=PCI_BUS_ID and CUDA_VISIBLE_DEVICES, on recorded boxes (no GPU needed);
then what a worker does with the ordinal, and how `serve` reports GPUs it cannot use.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
import torch
from tests_root import ROOT

from appliance import cli
from appliance.settings.config import load_settings
from appliance.topology import discovery
from appliance.topology.cuda_order import (
    NvmlGpu,
    TorchFacts,
    check_torch,
    cuda_order,
    read_torch,
)
from appliance.topology.devices import Device, DeviceError
from appliance.topology.discovery import HostFacts, read_host
from appliance.workers import worker

# --- recorded boxes (nvidia-smi -L and nvidia-smi --query-gpu=index,pci.bus_id,mig.mode) -

H100 = "NVIDIA H100 80GB HBM3"
HGX_H100 = [
    NvmlGpu(i, f"00000000:{bus}:00.0", f"GPU-{tag}-5b4c-a0b2-5c1bdb5d0d31", H100)
    for i, (bus, tag) in enumerate(
        [
            ("18", "8932f937"),
            ("2a", "1bd5e0f2"),
            ("3a", "a0c37c6e"),
            ("5d", "a0c3e4d1"),  # shares "GPU-a0c3" with GPU 2
            ("9a", "f1e2d3c4"),
            ("ab", "0b9e8f7a"),
            ("ba", "77aa01b2"),
            ("db", "c3d4e5f6"),
        ]
    )
]

# Two H100s and two RTX 4090s, alternating by PCI bus; CUDA's default FASTEST_FIRST order
# would number both H100s first. NVML lists GPUs by bus on real boxes.
RTX = "NVIDIA GeForce RTX 4090"
MIXED = [
    NvmlGpu(0, "00000000:01:00.0", "GPU-4090-aaaa", RTX),
    NvmlGpu(1, "00000000:21:00.0", "GPU-h100-aaaa", "NVIDIA H100 PCIe"),
    NvmlGpu(2, "00000000:41:00.0", "GPU-4090-bbbb", RTX),
    NvmlGpu(3, "00000000:81:00.0", "GPU-h100-bbbb", "NVIDIA H100 PCIe"),
]

# Four A100s; NVML's GPU 3 (bus 41, so CUDA's 2) is in MIG mode with two MIG devices.
A100 = "NVIDIA A100-SXM4-80GB"
MIG_UUIDS = ("MIG-8fe5b8a4-9b0e-5b4c-a0b2-5c1bdb5d0d31", "MIG-1dc3ec24-8a73-5e2c-9c1a-3a6e")
MIG_BOX = [
    NvmlGpu(0, "00000000:17:00.0", "GPU-a100-0000", A100),
    NvmlGpu(1, "00000000:31:00.0", "GPU-a100-1111", A100),
    NvmlGpu(2, "00000000:b1:00.0", "GPU-a100-2222", A100),
    NvmlGpu(3, "00000000:41:00.0", "GPU-a100-3333", A100, mig=True, mig_uuids=MIG_UUIDS),
]
MIG_MESSAGE = (
    "GPU 3 (NVIDIA A100-SXM4-80GB 00000000:41:00.0) is in MIG mode; MIG instances are not "
    "supported yet: disable MIG (nvidia-smi -i 3 -mig 0) or hide it with CUDA_VISIBLE_DEVICES"
)


def nvml_indices(gpus: list[NvmlGpu], visible: str | None) -> list[int]:
    """NVML's index of torch's cuda:0, cuda:1, ..."""
    return [gpu.index for gpu in cuda_order(gpus, visible)]


# --- CUDA_VISIBLE_DEVICES --------------------------------------------------------------


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, [0, 1, 2, 3, 4, 5, 6, 7]),  # unset: every GPU, by bus
        ("4,5,6,7", [4, 5, 6, 7]),  # ordinals 0-3 are NVML's 4-7
        ("6,4", [6, 4]),  # in the list's order
        (" 1, 2 ", [1, 2]),  # spaces around entries are fine
        ("4-7", [4]),  # not a range: read like strtoul, '4-7' is 4
        ("", []),
        ("-1", []),
        ("0,2,-1,1", [0, 2]),  # an invalid entry hides itself and all after it
        ("0,9,1", [0]),  # so does an index past the last GPU
        ("0,gpu1,1", [0]),  # and anything that is no index or UUID
        ("1,,2", [1]),
        ("1,1", []),  # a GPU named twice hides all
        ("GPU-0b9e8f7a-5b4c-a0b2-5c1bdb5d0d31,GPU-8932f937-5b4c-a0b2-5c1bdb5d0d31", [5, 0]),
        ("GPU-77aa,GPU-c3d4", [6, 7]),  # a unique prefix is enough
        ("GPU-77aa,GPU-a0c3,GPU-c3d4", [6]),  # an ambiguous prefix names nothing
        ("GPU-ffff,1", []),  # an unknown UUID ends the list before anything
        ("3,GPU-f1e2d3c4", [3, 4]),  # indices and UUIDs mix
        ("0,GPU-8932f937", []),  # GPU 0 twice
    ],
)
def test_visible_devices_on_an_hgx_box(visible: str | None, expected: list[int]) -> None:
    assert nvml_indices(HGX_H100, visible) == expected


def test_ordinals_follow_the_pci_bus_not_nvml_order_or_speed() -> None:
    assert [g.name for g in cuda_order(MIXED, None)] == [RTX, "NVIDIA H100 PCIe"] * 2
    # NVML's index is not promised to follow the bus: the H100s listed first here.
    listed = [MIXED[1], MIXED[3], MIXED[0], MIXED[2]]
    assert [g.uuid for g in cuda_order(listed, None)] == [g.uuid for g in MIXED]
    assert [g.uuid for g in cuda_order(listed, "1,3")] == ["GPU-h100-aaaa", "GPU-h100-bbbb"]


def test_bus_ids_order_by_their_numbers() -> None:
    gpus = [
        NvmlGpu(0, "00000001:01:00.0", "GPU-b", RTX),  # a second PCI domain
        NvmlGpu(1, "00000000:c1:00.0", "GPU-a", RTX),
    ]
    assert [g.uuid for g in cuda_order(gpus, None)] == ["GPU-a", "GPU-b"]


def test_a_gpu_in_mig_mode_is_refused_by_name() -> None:
    with pytest.raises(DeviceError) as info:
        cuda_order(MIG_BOX, None)
    assert str(info.value) == MIG_MESSAGE


@pytest.mark.parametrize(
    "visible",
    ["2", "GPU-a100-3333", MIG_UUIDS[0], "MIG-1dc3", "0,MIG-GPU-a100-3333/1/0"],
)
def test_a_visible_mig_gpu_or_mig_device_is_refused_by_name(visible: str) -> None:
    with pytest.raises(DeviceError) as info:
        cuda_order(MIG_BOX, visible)
    assert str(info.value) == MIG_MESSAGE


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("0,1,3", [0, 1, 2]),  # CUDA's 2 is the MIG GPU: hidden
        ("0,-1,2", [0]),  # hidden behind an invalid entry
        ("1,MIG-ffff,2", [1]),  # a MIG UUID nobody has is an invalid entry
        ("MIG-GPU-a100-0000/1/0", []),  # a GPU not in MIG mode has no MIG devices
    ],
)
def test_a_hidden_mig_gpu_is_fine(visible: str, expected: list[int]) -> None:
    assert nvml_indices(MIG_BOX, visible) == expected


# --- what torch can use ----------------------------------------------------------------


def gpu_devices(count: int) -> list[Device]:
    return [Device("cuda", i, H100, 1, 1, ordinal=i) for i in range(count)]


def test_torch_that_sees_the_mapped_gpus_passes() -> None:
    check_torch(gpu_devices(4), TorchFacts("2.6.0+cu124", "12.4", True, 4), "4,5,6,7")


@pytest.mark.parametrize(
    ("facts", "visible", "message"),
    [
        (
            TorchFacts("2.6.0+cpu", None, False, 0),
            None,
            "torch 2.6.0+cpu is a CPU-only build but this box has the 8 GPU(s) NVML found "
            "(8x NVIDIA H100 80GB HBM3): install torch built for CUDA (install.sh picks it "
            "on a GPU box), or set APPLIANCE_DEVICE=cpu",
        ),
        (
            TorchFacts("2.6.0+cu128", "12.8", False, 0),
            None,
            "torch 2.6.0+cu128 (built for CUDA 12.8) cannot use the 8 GPU(s) NVML found "
            "(8x NVIDIA H100 80GB HBM3): torch.cuda.is_available() is False, most often "
            "because the driver is older than CUDA 12.8 needs (nvidia-smi shows the newest "
            "CUDA it supports): update the driver or install torch built for an older CUDA",
        ),
        (
            TorchFacts("2.6.0+cu124", "12.4", True, 7),
            "GPU-8932f937",
            "torch sees 7 CUDA device(s) but expects the 8 GPU(s) NVML found "
            "(8x NVIDIA H100 80GB HBM3) with CUDA_VISIBLE_DEVICES 'GPU-8932f937': name the "
            "GPUs to use by UUID (nvidia-smi -L) in CUDA_VISIBLE_DEVICES, or set "
            "APPLIANCE_DEVICE=cpu",
        ),
        (
            TorchFacts("2.6.0+cu124", "12.4", True, 9),
            None,
            "torch sees 9 CUDA device(s) but expects the 8 GPU(s) NVML found "
            "(8x NVIDIA H100 80GB HBM3) with CUDA_VISIBLE_DEVICES unset",
        ),
    ],
)
def test_torch_that_cannot_use_the_gpus_is_one_line_saying_why(
    facts: TorchFacts, visible: str | None, message: str
) -> None:
    with pytest.raises(DeviceError) as info:
        check_torch(gpu_devices(8), facts, visible)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_this_torch_is_described_as_it_is() -> None:
    facts = read_torch()
    assert facts.version == torch.__version__ and facts.cuda == torch.version.cuda
    assert facts.available == torch.cuda.is_available()
    assert facts.device_count == (torch.cuda.device_count() if facts.available else 0)


# --- host facts ------------------------------------------------------------------------


def test_host_facts_read_cuda_visible_devices_and_nvidia_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "nvidiactl").touch()
    signs = (str(tmp_path / "nvidiactl"), str(tmp_path / "version"))
    monkeypatch.setattr(discovery, "NVIDIA_SIGNS", signs)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8932f937,1")
    host = read_host()
    assert host.cuda_visible_devices == "GPU-8932f937,1"
    assert host.nvidia_signs == (str(tmp_path / "nvidiactl"),)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert read_host().cuda_visible_devices is None


# --- the worker's side -----------------------------------------------------------------


def test_a_worker_runs_on_the_ordinal_in_pci_bus_order(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")  # restored after the test
    # Appliance device 5 runs on torch's cuda:2 (CUDA_VISIBLE_DEVICES=5,6,2 say).
    device = Device("cuda", 5, H100, 1, 1, ordinal=2, nvml_index=2)
    settings = worker.use_device(load_settings(), device)
    assert chosen == [2] and settings.device == "cuda"
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_gpu_check_puts_two_devices_on_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    h200 = SimpleNamespace(name="NVIDIA H200", total_memory=143771 << 20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: h200)
    devices = gpu_check.one_gpu_as_two_devices().devices
    assert [(d.index, d.ordinal, d.name) for d in devices] == [
        (0, 0, "NVIDIA H200"),
        (1, 0, "NVIDIA H200"),
    ]


# --- serve -----------------------------------------------------------------------------


class MismatchedNvml:
    """An NVML whose library no longer matches the loaded driver (after a driver update)."""

    NVMLError = pynvml.NVMLError

    def nvmlInit(self) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)


def test_serve_on_a_gpu_box_whose_nvml_fails_is_one_line_not_cpu_workers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def gpu_host() -> HostFacts:
        return HostFacts(None, ("/dev/nvidia0",))

    monkeypatch.setattr(discovery, "read_host", gpu_host)
    monkeypatch.setattr(discovery, "import_nvml", MismatchedNvml)
    monkeypatch.setenv("APPLIANCE_DEVICE", "auto")
    # One CPU worker per core of a big box: were it taken, this fails at once (2 cores
    # here) instead of serving on the CPU.
    monkeypatch.setenv("APPLIANCE_CPU_DEVICES", "128")
    monkeypatch.setenv("APPLIANCE_CPU_SHARE_CORES", "false")
    assert cli.main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "appliance: APPLIANCE_DEVICE=auto: this host shows NVIDIA hardware (/dev/nvidia0) "
        "but NVML found no usable GPU (NVML did not start: RM has detected an NVML/RM "
        "version mismatch); not falling back to the CPU: fix the driver until nvidia-smi "
        "lists the GPUs, or set APPLIANCE_DEVICE=cpu\n"
    )
