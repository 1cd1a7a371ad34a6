"""`appliance certs`: make the cluster's CA and certificates (certs.py) and say which files
go to which box and which settings name them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from appliance.cluster.certs import CA_NAME, DEFAULT_DAYS, HEAD_NAME, CertError, make_certs


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add `certs` to the `appliance` command's subcommands (it sets args.run)."""
    certs = commands.add_parser(
        "certs",
        help="make the TLS certificates of the link between boxes: a CA for this cluster, "
        "the head's, and one per box",
        description="Make the TLS certificates of the link between boxes into a folder: a "
        "CA of this cluster's own (unless the folder holds one: then the boxes are added to "
        "it), the head's certificate, and one per box named. Copy ca.crt and a box's own "
        "two files to each box; keep ca.key off the boxes.",
    )
    certs.add_argument("boxes", nargs="*", help="the boxes' names (each agent's --box)")
    certs.add_argument("--out", type=Path, required=True, help="the folder to write into")
    certs.add_argument(
        "--head", default=HEAD_NAME, help=f"the head's certificate's name (default {HEAD_NAME})"
    )
    certs.add_argument("--days", type=int, default=DEFAULT_DAYS, help="how long they are valid")
    certs.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Make them and print where each goes; a refusal is one line on stderr, exit 2."""
    try:
        issued = make_certs(args.out, list(args.boxes), args.head, args.days)
    except (CertError, OSError) as error:
        print(f"appliance: {error}", file=sys.stderr)
        return 2
    ca = args.out / f"{CA_NAME}.crt"
    for one in issued:
        print(
            f"{one.name}: --cluster.ca-file {ca} --cluster.cert-file {one.cert} "
            f"--cluster.key-file {one.key}"
        )
    if not issued:
        print(f"nothing new: {args.out} holds the CA and the head's certificate already")
    return 0
