"""The one call that verifies the appliance's GPU path on a GPU machine.

Each section is a function that runs in a child process of its own under a timeout (a
hung CUDA call or worker cannot stall the run), and its result is written into the JSON
report the moment it ends, so a run cut short still leaves every finished section:

1. environment     torch/CUDA/driver/Triton versions, topology.discover's devices (torch
                   ordinal, NVML index, UUID), CUDA_VISIBLE_DEVICES, /proc/devices, the
                   /dev/nvidia* nodes, nvidia-smi's banner and driver/compute capability
2. paged_bf16      the engine's bfloat16 paged steps (a chunked ~3k-token prefill, a
                   prefix-cache hit, mixed-length decode with prefills mixed in) against a
                   dense transformers model on the same weights, within the error a dense
                   bfloat16 model makes itself; which attention backend ran
3. triton_kernel   the Triton paged-attention kernel against float64 on random data, timed
4. cuda_tests      benchmarks/gpu_tests under pytest (host syncs, decode CUDA graphs and
                   batch.cuda_graphs, the handoff copy's side streams and IPC event)
5. appliance       1 prefill + 1 decode worker on the one GPU (KV pulled over CUDA IPC):
                   greedy parity with the in-process engine on 8 questions, 64 concurrent
                   requests, a SIGKILLed prefill worker the decode worker survives, every
                   KV block free after
6. handoff         the KV handoff copy against a plain device-to-device copy of the bytes
7. throughput      the default model's decode tokens/s at batch 1/16/64, prefill tokens/s
                   and peak memory up to an 8k prompt
8. bandwidth       an 8B-shaped random-weight model: decode ms/step and GB/s against the
                   HBM limit at batch 1/8/32/64 x context 512/2k/8k (eager, and with CUDA
                   graphs as batch.cuda_graphs turns them on), 8k and 32k chunked prefills
9. quant_decode    a 4-bit GGUF's decode on the GPU (Q4_0 blocks kept, the Triton kernels):
                   ms/step and GB/s at batch 1/8 against the dense bfloat16 model

Here, on the CPU (device cpu, Triton's interpreter, small shapes, about two minutes):
    .venv/bin/python benchmarks/gpu_check.py --dry-run
On the GPU machine (about 6 minutes on an H200, estimated: it has not run on one yet;
benchmarks/README.md says which wheels to bring and gives the exact commands):
    python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json
Options: --sections a,b to run some, --model for another GGUF file or HF folder,
--budget-s for the whole run, --section-timeout to cap every section, --wheels to print
the pinned packages the GPU machine lacks.

Exit status: 0 when every section passed (or was skipped, with the reason in the
report), 1 when one failed, erred, timed out or was left out of the time budget, 2 when
a run that is not a dry run finds no CUDA device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The sections live beside this script (benchmarks/gpu_sections/); the GPU machine runs a
# bare checkout, not installed, so the checkout's root goes on the path too.
HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from gpu_sections.appliance_e2e import one_gpu_as_two_devices  # noqa: E402
from gpu_sections.environment import print_wheels  # noqa: E402
from gpu_sections.runner import (  # noqa: E402
    BY_NAME,
    DRY_OUT,
    REAL_OUT,
    SECTIONS,
    child_main,
    orchestrate,
)

__all__ = ["main", "one_gpu_as_two_devices"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, small shapes")
    parser.add_argument("--out", help=f"the JSON report (default {REAL_OUT}; dry run {DRY_OUT})")
    parser.add_argument(
        "--sections",
        type=lambda text: [s for s in text.split(",") if s],
        default=[s.name for s in SECTIONS],
        help="comma-separated, of: " + ",".join(BY_NAME),
    )
    parser.add_argument("--model", help="a GGUF file or HF folder (default: the embedded one)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="for the whole run")
    parser.add_argument("--section-timeout", type=float, help="cap every section's timeout")
    parser.add_argument("--wheels", action="store_true", help="print the wheels to bring")
    parser.add_argument(
        "--inject-fault",
        action="store_true",
        help="paged_bf16 zeroes 16 cached keys of its long prompt: shows its bounds fail",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in BY_NAME]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(BY_NAME)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.wheels:
        return print_wheels()
    if args.child:
        return child_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
