"""`python -m tui --url URL --token-file PATH`: run the console against an appliance."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from appliance.admin.token import TokenError, read_token


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, read the token and run the console; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tui", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the appliance's URL")
    token = parser.add_mutually_exclusive_group(required=True)
    token.add_argument("--token-file", type=Path, help="the admin token file the server wrote")
    token.add_argument("--token", help="the admin token itself")
    args = parser.parse_args(argv)
    try:
        secret = args.token or read_token(args.token_file)
    except TokenError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from tui.app import run_console  # Textual loads only once the arguments are good

    run_console(args.url, secret)
    return 0


if __name__ == "__main__":
    sys.exit(main())
