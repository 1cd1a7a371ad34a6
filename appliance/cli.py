"""The `appliance` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from appliance.admin.token import TokenError
from appliance.config import SettingsError, load_settings
from appliance.model.errors import ModelLoadError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description=__doc__)
    parser.add_argument("--config", type=Path, help="TOML settings file")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="stream the model's answer to a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--model", type=Path, help="GGUF file or Hugging Face folder")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the text")

    srv = commands.add_parser(
        "serve", help="serve the OpenAI-compatible API (settings: APPLIANCE_* or --config)"
    )
    srv.add_argument("--host", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, help="port (default 8000)")
    srv.add_argument("--mode", choices=["disaggregated", "colocated"])
    srv.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    srv.add_argument("--model", type=Path, help="GGUF file or Hugging Face folder")
    srv.add_argument(
        "--layout",
        choices=["manual", "auto"],
        help="auto: run the layout `appliance plan` ranks first (settings: planner.*)",
    )

    agent = commands.add_parser(
        "agent",
        help="lend this box's devices to a head on another box (settings: cluster.*)",
    )
    agent.add_argument("--head", help="the head's host:port (cluster.listen there)")
    agent.add_argument("--box", help="this box's name (default: the host name)")
    agent.add_argument("--address", help="this box's address to connect from")
    agent.add_argument("--pool", choices=["prefill", "decode", "colocated"])
    agent.add_argument("--secret-file", type=Path, help="the shared secret every box holds")
    agent.add_argument("--cpu-devices", type=int, help="CPU devices (core sets) it offers")

    con = commands.add_parser(
        "console", help="watch and tune a running appliance (a terminal UI on its admin API)"
    )
    con.add_argument("--url", help="the appliance's address (default from host and port)")
    con.add_argument(
        "--token-file", type=Path, help="its admin token (default: what that server wrote)"
    )

    from appliance.bench.cli import add_parser as add_bench_parser
    from appliance.planner.plan_cli import add_parser as add_plan_parser
    from appliance.planner.profile_cli import add_parser as add_profile_parser

    add_bench_parser(commands)
    add_profile_parser(commands)
    add_plan_parser(commands)
    return parser


def serve(args: argparse.Namespace) -> int:
    from appliance.server.serve import serve as run_server

    settings = load_settings(
        args.config,
        host=args.host,
        port=args.port,
        mode=args.mode,
        dtype=args.dtype,
        model=args.model,
    )
    if args.layout is not None:
        planner = settings.planner.model_copy(update={"layout": args.layout})
        settings = settings.model_copy(update={"planner": planner})
    return run_server(settings)


def agent(args: argparse.Namespace) -> int:
    import logging
    from multiprocessing import AuthenticationError

    from appliance.cluster.agent import REFUSED_EXIT, BoxRefused, run_agent
    from appliance.kv.remote import MissingNixl

    given = {"head": args.head, "box": args.box, "pool": args.pool, "address": args.address}
    cluster = {k: v for k, v in given.items() if v is not None}
    if args.secret_file is not None:
        cluster["secret_file"] = args.secret_file
    settings = load_settings(args.config, cpu_devices=args.cpu_devices, cluster=cluster or None)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        return run_agent(settings)
    except AuthenticationError:
        reason = f"the head at {settings.cluster.head} refused this box: its cluster secret differs"
    except (BoxRefused, MissingNixl) as refusal:
        reason = str(refusal)
    # Not ValueError's exit 2: a head not up yet or a device error at boot is worth a
    # retry, a refusal is not.
    print(f"appliance: {reason}", file=sys.stderr)
    return REFUSED_EXIT


def console(args: argparse.Namespace) -> int:
    from urllib.parse import urlsplit

    from tui.app import run_console

    port = urlsplit(args.url).port if args.url else None
    settings = load_settings(args.config, port=port)
    url = args.url or f"http://{_local_host(settings.host)}:{settings.port}"
    run_console(url, args.token_file or settings.admin_token_path())
    return 0


def _local_host(host: str) -> str:
    """How this machine reaches a server bound to `host`, as a URL's host part."""
    wildcard = {"0.0.0.0": "127.0.0.1", "::": "::1"}
    host = wildcard.get(host, host)
    return f"[{host}]" if ":" in host else host


def generate(args: argparse.Namespace) -> int:
    from appliance.engine.llm_engine import LLMEngine
    from appliance.engine.sequence import SamplingParams

    settings = load_settings(args.config, dtype=args.dtype, model=args.model)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    engine = LLMEngine.from_settings(settings)
    tok = engine.tokenizer
    ids = (
        tok.encode(args.prompt)
        if args.raw
        else tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    )
    for output in engine.stream(ids, params):
        sys.stdout.write(output.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench":
            from appliance.bench.cli import run as run_bench

            return run_bench(args)
        if args.command == "profile":
            from appliance.planner.profile_cli import run as run_profile

            return run_profile(args)
        if args.command == "plan":
            from appliance.planner.plan_cli import run as run_plan

            return run_plan(args)
        commands = {"serve": serve, "console": console, "generate": generate, "agent": agent}
        return commands[args.command](args)
    except (SettingsError, ModelLoadError, TokenError, ValueError, ConnectionError) as exc:
        print(f"appliance: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
