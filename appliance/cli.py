"""The `appliance` command."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from appliance.admin.token import TokenError
from appliance.model.errors import ModelLoadError
from appliance.settings.config import Settings, SettingsError, load_settings
from appliance.settings.flags import add_settings_flags, settings_from_flags
from appliance.workers.fork_server import worker_context

SETTINGS_HELP = (
    "Every setting is a flag below, an APPLIANCE_* variable and a key of the --config file; "
    "a flag overrides the variable, which overrides the file."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description=__doc__)
    parser.add_argument("--version", action="version", version=f"appliance {_version()}")
    parser.add_argument("--config", type=Path, help="TOML settings file")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, settings: bool = False) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help,
            description=help + (". " + SETTINGS_HELP if settings else ""),
            usage=f"appliance {name} [options]" if settings else None,
        )
        # --config after the subcommand too; SUPPRESS keeps the one given before it.
        sub.add_argument(
            "--config", type=Path, default=argparse.SUPPRESS, help="TOML settings file"
        )
        if settings:
            add_settings_flags(sub, Settings)
        return sub

    gen = command("generate", "stream the model's answer to a prompt", settings=True)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the text")

    command("serve", "serve the OpenAI-compatible API", settings=True)
    command("agent", "lend this box's devices to a head on another box", settings=True)
    con = command("console", "watch and tune a running appliance (a terminal UI on its admin API)")
    con.add_argument("--url", help="the appliance's address (default from host and port)")
    con.add_argument(
        "--token-file", type=Path, help="its admin token (default: what that server wrote)"
    )

    from appliance.bench.cli import add_parser as add_bench_parser
    from appliance.cluster.certs_cli import add_parser as add_certs_parser
    from appliance.model.hub_cli import add_parser as add_hub_parser
    from appliance.ops.kv_store_cli import add_parser as add_kv_store_parser
    from appliance.planner.plan_cli import add_parser as add_plan_parser
    from appliance.planner.profile_cli import add_parser as add_profile_parser

    add_bench_parser(commands)
    add_profile_parser(commands)
    add_plan_parser(commands)
    add_hub_parser(commands)
    add_certs_parser(commands)
    add_kv_store_parser(commands)
    return parser


def _version() -> str:
    try:
        return version("appliance")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def settings_of(args: argparse.Namespace, **more: object) -> Settings:
    """The settings a command runs with: its flags over the environment over the file."""
    return load_settings(args.config, **{**settings_from_flags(args), **more})


def serve(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    # The workers' fork server starts now: its import of torch (~1.5 s) runs beside the
    # server's own imports, the layout's planning and the tokenizer's load.
    worker_context()
    from appliance.server.serve import serve as run_server

    return run_server(settings)


def agent(args: argparse.Namespace) -> int:
    import logging
    import ssl
    from multiprocessing import AuthenticationError

    from appliance.cluster.agent import REFUSED_EXIT, BoxRefused, run_agent
    from appliance.kv.remote_pool import MissingNixl

    settings = settings_of(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        return run_agent(settings)
    except AuthenticationError:
        reason = f"the head at {settings.cluster.head} refused this box: its cluster secret differs"
    except ssl.SSLError as error:  # a certificate of another CA, or not fit for its role
        reason = (
            f"no TLS link with the head at {settings.cluster.head}: {error} (the head and "
            "this box need certificates of the same `appliance certs` CA)"
        )
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

    settings = settings_of(args)
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
        if hasattr(args, "run"):  # pull, models, certs, kv-store
            return int(args.run(args))
        commands = {"serve": serve, "console": console, "generate": generate, "agent": agent}
        return commands[args.command](args)
    except (SettingsError, ModelLoadError, TokenError, ValueError, ConnectionError) as exc:
        print(f"appliance: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
