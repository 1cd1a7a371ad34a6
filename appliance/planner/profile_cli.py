"""The `appliance profile` command: time this box's steps for the configured model and
write the profile the planner reads (planner/profiler.py)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from appliance.planner.profile import Profile, profiles_folder
from appliance.planner.profiler import cpu_unit_runs, gpu_unit_runs, profile_box
from appliance.settings.config import Settings, load_settings
from appliance.topology.discovery import discover


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add `profile` to the `appliance` command's subcommands."""
    cmd = commands.add_parser(
        "profile",
        help="time this box's model steps for the planner (at most a few minutes)",
    )
    cmd.add_argument("--model", type=Path, help="GGUF file or Hugging Face folder")
    cmd.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    cmd.add_argument("--quick", action="store_true", help="fewer steps, one run each")
    cmd.add_argument(
        "--out", type=Path, help="write the profile here (default: under cache_dir/profiles)"
    )


def run(args: argparse.Namespace) -> int:
    """Profile, write the file, print where and a summary."""
    settings = load_settings(args.config, model=args.model, dtype=args.dtype)
    began = time.monotonic()
    profile = measure(settings, args.quick)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(profile.model_dump_json(indent=1))
        path = args.out
    else:
        path = profile.save(profiles_folder(settings.cache_dir))
    print(summary(profile))
    print(f"profile written to {path} ({time.monotonic() - began:.0f} s)")
    return 0


def measure(settings: Settings, quick: bool = False) -> Profile:
    """This box's profile for `settings`' model: every worker size, progress on stderr."""
    topology = discover(settings.device, 1, share_cores=False)
    device = topology.devices[0]
    if device.kind == "cpu":
        cores = len(os.sched_getaffinity(0))
        runs, atoms = cpu_unit_runs(cores), cores
    else:
        runs, atoms = gpu_unit_runs(topology.devices), len(topology.devices)
    settings = settings.model_copy(update={"device": device.kind})
    return profile_box(settings, runs, atoms, quick, progress=_say)


def summary(profile: Profile) -> str:
    """A few lines: per worker size, a 512-token prompt and a decode step of 16 at 512."""
    lines = [f"{profile.key.model}, {profile.key.dtype}, {profile.key.weights}"]
    lines.append(f"{profile.key.device_kind}, {profile.atoms} to split")
    for unit, cost in sorted(profile.workers.items()):
        prompt = cost.prefill.seconds(512, 1, 512 * 513 // 2, 0)
        decode = cost.decode.seconds(16, 16, 0, 16 * 512)
        lines.append(
            f"  worker {unit}: prompt 512 {prompt * 1e3:.0f} ms, decode step of 16 at 512 "
            f"{decode * 1e3:.1f} ms, {cost.kv_blocks} KV blocks, contention x{cost.contention:.2f}"
        )
    return "\n".join(lines)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
