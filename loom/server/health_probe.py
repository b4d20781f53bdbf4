"""`loom health`: ask a server's grpc.health.v1 whether it is SERVING, for docker and k8s probes.

Exit status: 0 when SERVING; 1 when the server answers anything else (NOT_SERVING while the
model loads, UNKNOWN, SERVICE_UNKNOWN); 2 when nothing answers in time (nothing listening, as
when the server drains: it closes its port at once; connection refused; timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import sys
from typing import Any

from grpclib.client import Channel
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from loom.server.tls import client_context


def add_parser(commands: Any) -> argparse.ArgumentParser:
    health: argparse.ArgumentParser = commands.add_parser(
        "health",
        help="exit 0 if a server's health is SERVING (for docker and Kubernetes probes)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    health.add_argument(
        "--address", default="127.0.0.1:50051", help="HOST:PORT (default: 127.0.0.1:50051)"
    )
    health.add_argument(
        "--service", default="", help='the service to ask about (default: "", the server)'
    )
    health.add_argument(
        "--timeout", type=float, default=5.0, help="seconds before giving up (default: 5)"
    )
    add_tls_arguments(health)
    return health


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """A client's TLS flags (loom health, loom bench, loom chaos)."""
    add = parser.add_argument
    add("--tls", action="store_true", help="connect over TLS, checking the system's CAs")
    add("--tls-ca-file", help="connect over TLS, checking the server against these CAs (PEM)")
    add("--tls-cert-file", help="mutual TLS: this client's certificate (PEM)")
    add("--tls-key-file", help="mutual TLS: its private key (PEM)")


def tls_of(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The client TLS context the flags ask for, or None for plaintext."""
    if not (args.tls or args.tls_ca_file or args.tls_cert_file):
        return None
    return client_context(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)


async def check(host: str, port: int, service: str, tls: ssl.SSLContext | None) -> str:
    async with Channel(host, port, ssl=tls) as channel:
        response = await HealthStub(channel).Check(HealthCheckRequest(service=service))
        return HealthCheckResponse.ServingStatus.Name(response.status)


def run(args: argparse.Namespace) -> int:
    host, _, port = args.address.rpartition(":")
    try:
        probe = check(host or "127.0.0.1", int(port), args.service, tls_of(args))
        status = asyncio.run(asyncio.wait_for(probe, args.timeout))
    except Exception as exc:  # refused, timed out, reset: nothing healthy answered
        print(f"{args.address}: no answer ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1
