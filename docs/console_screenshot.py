"""Regenerates docs/console.svg: the console attached to a real appliance (3 CPU devices,
1 prefill + 2 decode) while `appliance bench` loads it with the chat mix, with a device
moving from the decode to the prefill pool.

    .venv/bin/python docs/console_screenshot.py        # about a minute
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

from appliance.bench.compare import Target, running
from tui.app import ConsoleApp
from tui.client import AdminClient

DOCS = Path(__file__).resolve().parent
SIZE = (140, 44)
LOAD_S = 20.0  # how long the bench runs before the move, so the sparklines fill
MOVE_S = 6.0  # how long after the move the picture is taken: mid-drain or just after


def start_bench(url: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "appliance.cli", "bench", "--url", url]
    command += ["--workload", "chat", "--request-rate", "1.5", "--num-requests", "200"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def take(url: str, token: str, out: Path) -> None:
    app = ConsoleApp(AdminClient(url, token))
    async with app.run_test(size=SIZE) as pilot:
        await asyncio.sleep(LOAD_S)
        app.query_one("#device-2").focus()
        await pilot.press("m", "y")
        await asyncio.sleep(MOVE_S)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        token_file = Path(folder) / "admin.token"
        appliance = Target(
            "appliance",
            [sys.executable, "-m", "appliance.cli", "serve"],
            {
                "APPLIANCE_CPU_DEVICES": "3",
                "APPLIANCE_CPU_SHARE_CORES": "true",
                "APPLIANCE_PREFILL_DEVICES": "0",
                "APPLIANCE_DECODE_DEVICES": "1,2",
                "APPLIANCE_ADMIN__TOKEN_FILE": str(token_file),
            },
            port_flag=None,
        )
        with running(appliance, Path(folder) / "logs") as url:
            bench = start_bench(url)
            try:
                asyncio.run(take(url, token_file.read_text(), DOCS / "console.svg"))
            finally:
                bench.kill()
    print(f"wrote {DOCS / 'console.svg'}")


if __name__ == "__main__":
    main()
