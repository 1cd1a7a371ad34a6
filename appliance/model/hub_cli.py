"""The `appliance pull` and `appliance models` commands: fetch a model by name into the
local Hugging Face cache, and list the models there the appliance can serve."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from appliance.model import hub
from appliance.model.errors import ModelLoadError
from appliance.model.hub import LocalModel


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add `pull` and `models` to the `appliance` command's subcommands; each sets
    args.run to `run`."""
    pull = commands.add_parser(
        "pull",
        help="download a model by name (org/name or org/name:QUANT) into the Hugging Face cache",
    )
    pull.add_argument(
        "name", help="org/name (a safetensors folder or a GGUF repo) or org/name:QUANT"
    )
    pull.add_argument("--revision", help="a branch, tag or commit (default: main)")
    pull.set_defaults(run=run)
    models = commands.add_parser(
        "models", help="list the models in the local Hugging Face cache that can be served"
    )
    models.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run `pull` or `models`; a refusal is one line on stderr and exit code 2."""
    try:
        if args.command == "pull":
            path = hub.pull(args.name, args.revision)
            print(f"{args.name}: {path}")
            return 0
        return _print_models(hub.list_local(), hub.cache_dir())
    except (ValueError, ModelLoadError) as exc:
        print(f"appliance: {exc}", file=sys.stderr)
        return 2


def _print_models(models: list[LocalModel], cache: Path) -> int:
    if not models:
        print(f"no servable models in the Hugging Face cache {cache} (`appliance pull org/name`)")
        return 0
    rows = [("NAME", "KIND", "QUANTS", "REVISION", "SIZE")]
    for m in models:
        revision = m.commit[:7] + (f" ({', '.join(m.refs)})" if m.refs else "")
        rows.append((m.repo_id, m.kind, ", ".join(m.quants) or "-", revision, _size(m.size)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    print(f"(cache: {cache}; serve one with --model NAME, a GGUF quant with NAME:QUANT)")
    return 0


def _size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def main(argv: list[str] | None = None) -> int:
    """`python -m appliance.model.hub_cli pull|models ...`, for use before cli.py wires these in."""
    parser = argparse.ArgumentParser(prog="appliance")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
