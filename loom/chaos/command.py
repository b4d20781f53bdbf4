"""`loom chaos`: put a Loom server through kills, cancels, resets, slow and stopped readers, a
deadline sweep, overload, and hostile HTTP/2 peers (rapid reset, control-frame floods,
slowloris, unfinished header blocks), and check after every scenario that nothing leaked.

    loom chaos --address 127.0.0.1:50051      # every scenario but drain
    loom chaos --serve "--model sim" --json    # launches the server: the drain scenario too

It speaks only to the address it is given (or to the server it launched, on loopback). After
each scenario it checks the invariants of loom/chaos/invariants.py. Exit status: 0 when every
client ended as its scenario allows and every invariant held; 1 when anything broke (the table
and the problems below it say what); 2 when the server could not be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
from tqdm import tqdm

from loom.bench.serving import launched_process
from loom.chaos import hostile
from loom.chaos import scenarios as sc
from loom.chaos.clients import Target
from loom.chaos.invariants import Limits, check, probe_tokens
from loom.chaos.overload import overload
from loom.client.calls import model_info
from loom.client.channel import Client
from loom.client.tls import add_tls_arguments, tls_of
from loom.core.setting import above, at_least

Scenario = Callable[[sc.Run], Awaitable[sc.Result]]
SCENARIOS: dict[str, Scenario] = {
    "kill": sc.kill,
    "cancel": sc.cancel,
    "reset": sc.reset,
    "slow-readers": sc.slow_readers,
    "stopped-readers": sc.stopped_readers,
    "deadlines": sc.deadlines,
    "overload": overload,
    "rapid-reset": hostile.rapid_reset,
    "control-flood": hostile.control_flood,
    "slowloris": hostile.slowloris,
    "header-fragments": hostile.header_fragments,
    "drain": sc.drain,  # last: the server is gone after it
}


def add_parser(commands: Any) -> argparse.ArgumentParser:
    chaos: argparse.ArgumentParser = commands.add_parser(
        "chaos",
        help="test a server under cancellation, backpressure and overload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = chaos.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", help="HOST:PORT of a running Loom server")
    where.add_argument(
        "--serve", metavar="ARGS", help='launch `loom serve --port 0 ARGS`, e.g. "--model sim"'
    )
    add = chaos.add_argument
    add(
        "--scenarios",
        default=None,
        help="comma-separated (default: all; drain only against a server chaos launches)",
    )
    add("--clients", type=int, default=200, help="clients per scenario (default: 200)")
    add("--concurrency", type=int, default=64, help="clients at once (default: 64)")
    add("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    add("--overload-factor", type=int, default=3, help="burst, in queue limits (default: 3)")
    add("--stop-for", type=float, default=1.0, help="seconds a stopped reader stops (default: 1)")
    add(
        "--stop-tokens",
        type=int,
        default=600,
        help="tokens a stopped reader asks for, with 20 logprobs each: more than the server's "
        "buffers and windows hold (default: 600)",
    )
    add("--attack-frames", type=int, default=100_000, help="rapid-reset pairs, flood frames")
    add("--hold-connections", type=int, default=50, help="slowloris connections (default: 50)")
    add(
        "--hold-wait",
        type=float,
        default=15.0,
        help="seconds held connections wait to be closed (default: 15; the server's preface "
        "and header timeouts are 10 s, nginx's 60 s)",
    )
    add("--settle-timeout", type=float, default=30.0, help="seconds to idle after (default: 30)")
    add("--probe-timeout", type=float, default=30.0, help="the probe's deadline (default: 30)")
    add("--seed", type=int, default=0, help="(default: 0)")
    add("--json", action="store_true", help="print the results as JSON on stdout")
    add(
        "--api",
        default="grpc",
        choices=("grpc", "openai"),
        help="how the clients call: grpc, or openai (POST /v1/completions, streamed, over "
        "HTTP/1.1; the bare-HTTP/2 scenarios do not apply) (default: grpc)",
    )
    add("--http-address", default=None, help="with --address and --api openai: HOST:PORT")
    add("--api-key", default=None, help="sent as `authorization: Bearer KEY` (--api-key-file)")
    add_tls_arguments(chaos)
    return chaos


HOSTILE = ("rapid-reset", "control-flood", "slowloris", "header-fragments")  # bare HTTP/2


def scenario_names(args: argparse.Namespace) -> list[str]:
    """The scenarios to run: those asked for, or every one that applies; refused by name."""
    tls = tls_of(args) is not None
    bare = tls or args.api == "openai"  # no bare HTTP/2 to attack
    if args.scenarios is None:
        names = [name for name in SCENARIOS if name != "drain" or args.serve is not None]
        names = [name for name in names if not (bare and name in HOSTILE)]
    else:
        names = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        raise ValueError(f"--scenarios: unknown {unknown}; choose from {', '.join(SCENARIOS)}")
    hostile = ", ".join(sorted(set(names) & set(HOSTILE)))
    if args.api == "openai" and hostile:
        raise ValueError(f"--scenarios: {hostile} attack the gRPC port's HTTP/2: use --api grpc")
    if args.api == "openai" and args.address and not args.http_address:
        raise ValueError("--api openai with --address needs --http-address HOST:PORT")
    if tls and args.api == "openai":
        raise ValueError("--api openai: the chaos clients speak plaintext HTTP")
    if tls and hostile:
        raise ValueError(
            f"--scenarios: {hostile} speak bare HTTP/2 in plaintext (a socket read and written "
            "from two threads, which TLS cannot share): run them against a plaintext port"
        )
    if "drain" in names and args.serve is None:
        raise ValueError("--scenarios: drain needs a server chaos launches itself (--serve)")
    return names


def settings_of(args: argparse.Namespace) -> tuple[list[str], sc.Settings, Limits]:
    names = scenario_names(args)
    for flag, value, minimum in [
        ("--clients", args.clients, 1),
        ("--concurrency", args.concurrency, 1),
        ("--max-tokens", args.max_tokens, 1),
        ("--stop-tokens", args.stop_tokens, 1),
        ("--overload-factor", args.overload_factor, 2),
        ("--attack-frames", args.attack_frames, 1),
        ("--hold-connections", args.hold_connections, 1),
    ]:
        at_least(minimum)(flag, value)
    for flag, value in [
        ("--settle-timeout", args.settle_timeout),
        ("--probe-timeout", args.probe_timeout),
        ("--hold-wait", args.hold_wait),
    ]:
        above(0)(flag, value)
    at_least(0)("--stop-for", args.stop_for)
    fields = {f.name for f in attrs.fields(sc.Settings)}
    settings = sc.Settings(**{k: v for k, v in vars(args).items() if k in fields})
    return (
        names,
        settings,
        Limits(settle_timeout=args.settle_timeout, probe_timeout=args.probe_timeout),
    )


def run(args: argparse.Namespace) -> int:
    names, settings, limits = settings_of(args)
    with server(args) as (host, port, http_port, process):
        client = Client.of(args)
        try:
            info = asyncio.run(model_info(host, port, client))
        except OSError as exc:
            print(f"loom chaos: cannot reach {host}:{port}: {exc}", file=sys.stderr)
            return 2
        files = (args.tls_ca_file or "", args.tls_cert_file or "", args.tls_key_file or "")
        client_args = (args.api_key or "", *(files if client.tls else ()))
        target = Target(
            host=host,
            port=port,
            info=info,
            client=client,
            client_args=client_args,
            api=args.api,
            http_port=http_port,
        )
        results = asyncio.run(chaos(target, names, settings, limits, process))
    report(target, results, as_json=args.json)
    return 1 if any(r.problems for r in results) else 0


@contextmanager
def server(
    args: argparse.Namespace,
) -> Iterator[tuple[str, int, int | None, subprocess.Popen[str] | None]]:
    """The server's host, gRPC port, HTTP API port (with --api openai) and process (when
    launched). A launched server for --api openai gets an HTTP port, and connection caps
    that hold an HTTP/1.1 connection per stream of the overload burst."""
    if args.serve is None:
        host, port = address("--address", args.address)
        http_port = address("--http-address", args.http_address)[1] if args.http_address else None
        yield host, port, http_port, None
        return
    serve_args, ports = shlex.split(args.serve), dict[str, int]()
    if args.api == "openai":
        serve_args += ["--http-port", "0"]
        for flag in ("--max-connections", "--max-connections-per-peer"):
            if not any(arg.startswith(flag) for arg in serve_args):
                serve_args += [flag, "4096"]
    with launched_process(serve_args, ports=ports) as (port, process):
        yield "127.0.0.1", port, ports.get("http"), process


def address(flag: str, text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{flag} must be HOST:PORT, got {text!r}")
    return host, int(port)


async def chaos(
    target: Target,
    names: list[str],
    settings: sc.Settings,
    limits: Limits,
    process: subprocess.Popen[str] | None,
) -> list[sc.Result]:
    expected = await probe_tokens(target, limits.probe_timeout)
    baseline = await sc.well_behaved(target)
    results = []
    with tqdm(unit=" clients", file=sys.stderr, leave=False) as bar:
        run = sc.Run(target, settings, baseline, server=process)
        run.on_client = lambda: bar.update(1)
        for i, name in enumerate(names, 1):
            bar.set_description(f"scenario {i}/{len(names)}: {name}")
            result = await sc.timed_scenario(run, SCENARIOS[name])
            if name != "drain":
                result.problems += await check(target, expected, limits)
            results.append(result)
    return results


def report(target: Target, results: list[sc.Result], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(as_dict(target, results), indent=2))
        return
    print(f"loom chaos against {target.host}:{target.port} ({target.info.model})")
    print(f"{'scenario':16} {'clients':>7} {'seconds':>8}  {'verdict':8} outcomes")
    for r in results:
        verdict = "BROKEN" if r.problems else "ok"
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r.outcomes.items()))
        print(f"{r.name:16} {r.clients:>7} {r.seconds:>8.1f}  {verdict:8} {outcomes}")
    for r in results:
        for name, value in r.figures.items():
            print(f"  {r.name}: {name} = {value:.4g}")
        for problem in r.problems:
            print(f"  {r.name}: BROKEN: {problem}")


def as_dict(target: Target, results: list[sc.Result]) -> dict[str, Any]:
    return {
        "address": f"{target.host}:{target.port}",
        "model": target.info.model,
        "ok": not any(r.problems for r in results),
        "scenarios": [
            {
                "name": r.name,
                "clients": r.clients,
                "seconds": round(r.seconds, 3),
                "outcomes": dict(r.outcomes),
                "figures": r.figures,
                "problems": r.problems,
            }
            for r in results
        ],
    }
