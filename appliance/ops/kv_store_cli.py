"""`appliance kv-store show|clear`: the box's KV store from the command line (issue 41).

Both ask the running appliance through its admin API (the admin token from the file the
server wrote): `show` prints the store's tiers from GET /admin/state, `clear` drops every
block no worker is reading with POST /admin/kv_store/clear. With nothing listening at
the address, `show` counts the disk tier's block files and `clear --force` deletes them
(the host tier's shared memory dies with its owner). Without --force, `clear` deletes
nothing there: an appliance still starting, or listening at another address with the
same disk_path, would lose its blocks behind its back. An address that takes the
connection but does not answer (a timeout, a broken reply) is an error, never "none".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

from appliance.admin.schema import KVStoreView, Snapshot
from appliance.admin.token import read_token
from appliance.kv_store.disk_tier import DiskTier
from appliance.settings.config import Settings, load_settings

TIMEOUT_S = 30.0
MIB = 1 << 20


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add `kv-store` to the `appliance` command's subcommands (it sets args.run)."""
    store = commands.add_parser(
        "kv-store",
        help="show or clear the box's KV store (its host and disk tiers)",
        description="Show the box's KV store (blocks, bytes and hits per tier) or clear it: "
        "through the running appliance's admin API, or, with none running, from the disk "
        "tier's folder (kv_store.disk_path).",
    )
    store.add_argument("action", choices=["show", "clear"])
    store.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML settings")
    store.add_argument("--url", help="the appliance's address (default from host and port)")
    store.add_argument(
        "--token-file", type=Path, help="its admin token (default: what that server wrote)"
    )
    store.add_argument(
        "--force",
        action="store_true",
        help="with no appliance listening, let clear delete the disk tier's files (no "
        "appliance may be using kv_store.disk_path: one starting, or at another address)",
    )
    store.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Show or clear; exit 0, or 1 with the reason on stderr."""
    from urllib.parse import urlsplit

    port = urlsplit(args.url).port if args.url else None
    settings = load_settings(getattr(args, "config", None), port=port)
    url = args.url or f"http://{_local_host(settings.host)}:{settings.port}"
    token_file = args.token_file or settings.admin_token_path()
    try:
        if not answers(url):  # (a stopped server leaves no token file behind either)
            return offline(args.action, settings, url, args.force)
        if args.action == "show":
            print(show_served(url, token_file))
        else:
            print(clear_served(url, token_file))
    except AdminRefused as refused:
        print(f"appliance: {refused}", file=sys.stderr)
        return 1
    except httpx.TransportError as error:
        print(f"appliance at {url} did not answer: {_reason(error)}", file=sys.stderr)
        return 1
    return 0


def offline(action: str, settings: Settings, url: str, force: bool) -> int:
    """Nothing listens at `url`: the disk tier from its folder (clear only if forced)."""
    if action == "clear" and not force:
        where = settings.kv_store.disk_path or "(kv_store.disk_path unset)"
        print(
            f"no appliance listens at {url}: clearing would delete the disk tier's files "
            f"at {where}; add --force if no appliance uses them (one starting, or one at "
            "another address with the same kv_store.disk_path)",
            file=sys.stderr,
        )
        return 1
    print(f"no appliance listens at {url}: the disk tier directly", file=sys.stderr)
    print(show_disk(settings) if action == "show" else clear_disk(settings))
    return 0


def _reason(error: httpx.TransportError) -> str:
    """One line for a failed call (httpx's message may be empty)."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _local_host(host: str) -> str:
    """How this machine reaches a server bound to `host` (as `appliance console` does)."""
    wildcard = {"0.0.0.0": "127.0.0.1", "::": "::1"}
    host = wildcard.get(host, host)
    return f"[{host}]" if ":" in host else host


def answers(url: str) -> bool:
    """Whether an appliance answers at `url` (any answer, a refusal included); False
    only where the connection is refused (nothing listening). Anything else that fails
    (a timeout, a dropped connection, an unknown host) raises httpx.TransportError."""
    try:
        httpx.get(url + "/admin/state", timeout=TIMEOUT_S)
    except httpx.ConnectError as error:
        if _refused(error):
            return False
        raise  # a name that does not resolve, no route: not known to be nobody
    return True


def _refused(error: BaseException) -> bool:
    """Whether the connection was refused (httpx wraps the OSError, maybe twice)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class AdminRefused(RuntimeError):
    """The admin API answered with an error (its message)."""


def _call(method: str, url: str, token_file: Path) -> dict:
    headers = {"Authorization": f"Bearer {read_token(token_file)}"}
    reply = httpx.request(method, url, headers=headers, timeout=TIMEOUT_S)
    if reply.status_code != 200:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text
        raise AdminRefused(f"{reply.status_code}: {message}")
    found: dict = reply.json()
    return found


def show_served(url: str, token_file: Path) -> str:
    """The running store's figures, one line a tier."""
    snapshot = Snapshot.model_validate(_call("GET", url + "/admin/state", token_file))
    if snapshot.kv_store is None:
        return f"the KV store at {url} is off (kv_store.enabled) or not open yet"
    return render(snapshot.kv_store, url)


def render(view: KVStoreView, where: str) -> str:
    """A store's figures as a small table: tiers, blocks, bytes, hits."""
    lines = [
        f"KV store at {where}: {view.lookups} lookups, {view.misses} short of the prompt, "
        f"{view.refused} disk blocks refused",
        f"{'tier':<6}{'blocks':>9}{'used MiB':>11}{'capacity MiB':>14}{'hits':>8}"
        f"{'read MiB':>10}{'written MiB':>13}",
    ]
    for tier in view.capacity_bytes:
        lines.append(
            f"{tier:<6}{view.blocks.get(tier, 0):>9}{view.used_bytes.get(tier, 0) / MIB:>11.1f}"
            f"{view.capacity_bytes[tier] / MIB:>14.1f}{view.hits.get(tier, 0):>8}"
            f"{view.bytes_read.get(tier, 0) / MIB:>10.1f}"
            f"{view.bytes_written.get(tier, 0) / MIB:>13.1f}"
        )
    return "\n".join(lines)


def clear_served(url: str, token_file: Path) -> str:
    """Clear the running store; what each tier lost."""
    cleared = _call("POST", url + "/admin/kv_store/clear", token_file)["cleared"]
    parts = ", ".join(f"{n} {tier}" for tier, n in cleared.items())
    return f"cleared the KV store at {url}: {parts} blocks"


def _disk_folder(settings: Settings) -> Path | None:
    folder = settings.kv_store.disk_path
    return folder if folder is not None and folder.is_dir() else None


def show_disk(settings: Settings) -> str:
    """The disk tier's block files, counted from the folder."""
    folder = _disk_folder(settings)
    if folder is None:
        return f"no disk tier at {settings.kv_store.disk_path or '(kv_store.disk_path unset)'}"
    files = [p for p in folder.glob("*/*.kv") if p.is_file()]
    used = sum(p.stat().st_size for p in files)
    return f"disk tier at {folder}: {len(files)} blocks, {used / MIB:.1f} MiB"


def clear_disk(settings: Settings) -> str:
    """Delete the disk tier's block files (only the tier's own names)."""
    folder = _disk_folder(settings)
    if folder is None:
        where = settings.kv_store.disk_path or "(kv_store.disk_path unset)"
        return f"no disk tier at {where}: nothing to clear"
    return f"cleared the disk tier at {folder}: {DiskTier(folder).clear()} blocks deleted"
