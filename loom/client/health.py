"""`loom health`: ask a server's grpc.health.v1 whether it is SERVING, for docker and k8s probes.

Exit status: 0 when SERVING; 1 when the server answers anything else (NOT_SERVING while the
model loads, UNKNOWN, SERVICE_UNKNOWN); 2 when nothing answers in time (nothing listening, as
when the server drains: it closes its port at once; connection refused; timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from loom.client.calls import health
from loom.client.channel import Client
from loom.client.tls import add_tls_arguments, tls_of


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        "health",
        help="exit 0 if a server's health is SERVING (for docker and Kubernetes probes)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument(
        "--address", default="127.0.0.1:50051", help="HOST:PORT (default: 127.0.0.1:50051)"
    )
    parser.add_argument(
        "--service", default="", help='the service to ask about (default: "", the server)'
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds before giving up (default: 5)"
    )
    add_tls_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    host, _, port = args.address.rpartition(":")
    client = Client(tls=tls_of(args))
    try:
        probe = health(host or "127.0.0.1", int(port), client, args.service, args.timeout)
        status = asyncio.run(asyncio.wait_for(probe, args.timeout))
    except Exception as exc:  # refused, timed out, reset: nothing healthy answered
        print(f"{args.address}: no answer ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1
