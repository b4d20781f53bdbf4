"""The clients `loom chaos` runs: one grpclib stream each, behaving one way, and what became of it.

An outcome is a short string: "ok" (read to the end), a gRPC status name (the server ended the
call: RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ...), what the client did when it left ("cancelled":
RST_STREAM; "dropped": the connection closed; "reset": the TCP connection aborted, an RST), or
"client timeout" (grpclib's own deadline fired first). Anything else is the name of an exception
the client did not expect: a finding.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import attrs
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.config import Configuration

from loom.client import calls
from loom.client.channel import PLAIN, SMALL_WINDOWS, Client
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub

LEAVES = ("cancel", "drop", "reset", "stop")
KILLED_CLIENT = """
import asyncio, sys
from grpclib.client import Channel
from loom.client.tls import client_context
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub

async def main():
    key, *files = sys.argv[4:] or [""]
    tls = client_context(*(f or None for f in files)) if files else None
    metadata = {"authorization": f"Bearer {key}"} if key else None
    async with Channel(sys.argv[1], int(sys.argv[2]), ssl=tls) as channel:
        async with LoomStub(channel).Generate.open(metadata=metadata) as stream:
            n = int(sys.argv[3])
            sampling = pb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 4]), sampling=sampling)
            await stream.send_message(request, end=True)
            async for _ in stream:
                print("token", flush=True)
                await asyncio.sleep(0.05)

asyncio.run(main())
"""


KILLED_HTTP_CLIENT = """
import json, socket, sys, time
host, port, n, key = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
body = json.dumps({"prompt": [3, 4], "max_tokens": n, "temperature": 0, "ignore_eos": True,
                   "stream": True}).encode()
auth = f"Authorization: Bearer {key}\\r\\n" if key else ""
sock = socket.create_connection((host, port))
sock.sendall((f"POST /v1/completions HTTP/1.1\\r\\nHost: {host}\\r\\n{auth}"
              f"Content-Type: application/json\\r\\nContent-Length: {len(body)}\\r\\n\\r\\n"
              ).encode() + body)
seen = b""
while b"data: {" not in seen:
    seen += sock.recv(65536)
print("token", flush=True)
while sock.recv(65536):
    time.sleep(0.05)
"""


@attrs.frozen(kw_only=True)
class Target:
    """The server under test: its address and what GetModelInfo said of it; with `api`
    "openai", its clients call the HTTP API at `http_port` (loom/chaos/http_clients.py)."""

    host: str
    port: int
    info: pb.ModelInfo
    api: str = "grpc"
    http_port: int | None = None
    client: Client = PLAIN  # TLS, and the API key every call carries
    # For client processes: the API key ("": none), then the TLS files (CA, certificate, key).
    client_args: tuple[str, ...] = ()

    def channel(self, config: Configuration | None = None) -> Channel:
        return self.client.channel(self.host, self.port, config=config)

    async def stats_until(self, done: Callable[[Any], object], seconds: float) -> Any:
        """Its stats, polled until `done(stats)` (at most `seconds`)."""
        return await calls.stats_until(self.host, self.port, done, seconds, self.client)

    async def health(self) -> str:
        return await calls.health(self.host, self.port, self.client)


@attrs.frozen(kw_only=True)
class Behaviour:
    leave: str | None = None  # one of LEAVES, or None: read to the end
    after: int = 0  # messages read before leaving
    interval: float = 0.0  # seconds between reads: a slow reader
    stop_for: float = 0.0  # "stop": seconds it reads nothing (small windows), then reads on
    timeout: float | None = None  # the call's gRPC deadline
    release: asyncio.Event | None = None  # once set, cancel at the next message: "released"
    channel: Channel | None = None  # a connection shared with others, else one of its own


def request(rng: random.Random, vocab_size: int, max_tokens: int, prompt_len: int = 0) -> Any:
    """Greedy, EOS ignored: a prompt of random token ids (1 to 24 of them unless given)."""
    length = prompt_len or rng.randint(1, 24)
    prompt = [rng.randrange(vocab_size) for _ in range(length)]
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


async def stream_once(target: Target, message: Any, behaviour: Behaviour) -> str:
    """One call, on a connection of its own, behaving as told: its outcome."""
    channel = behaviour.channel or target.channel(
        SMALL_WINDOWS if behaviour.leave == "stop" else None
    )
    try:
        async with LoomStub(channel).Generate.open(timeout=behaviour.timeout) as stream:
            await stream.send_message(message, end=True)
            received, stopped = 0, False
            async for _ in stream:
                received += 1
                if behaviour.release is not None and behaviour.release.is_set():
                    await stream.cancel()
                    return "released"
                if behaviour.leave is not None and received > behaviour.after and not stopped:
                    if (left := await leave(behaviour, stream, channel)) is not None:
                        return left
                    stopped = True
                if behaviour.interval:
                    await asyncio.sleep(behaviour.interval)
        return "ok"
    except GRPCError as exc:
        return exc.status.name
    except TimeoutError:
        return "client timeout"
    except Exception as exc:  # reported, not raised: a finding
        return type(exc).__name__
    finally:
        if behaviour.channel is None:
            channel.close()


async def leave(behaviour: Behaviour, stream: Any, channel: Channel) -> str | None:
    """Leave the call as the behaviour says: how it left; None when it reads on."""
    if behaviour.leave == "cancel":
        await stream.cancel()
        return "cancelled"
    if behaviour.leave == "drop":
        channel.close()
        return "dropped"
    if behaviour.leave == "reset":
        reset(channel)
        return "reset"
    await asyncio.sleep(behaviour.stop_for)  # "stop": reads nothing for a while, then reads on
    return None


def reset(channel: Channel) -> None:
    """Abort the channel's TCP connection with SO_LINGER 0: the server reads an RST."""
    protocol = channel._protocol  # grpclib has no public way to reach the socket
    if protocol is None:
        return
    transport = protocol.connection._transport
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def kill_clients(target: Target, count: int, max_tokens: int) -> int:
    """Client processes SIGKILLed once each has read a token: how many died so."""
    if target.api == "openai":
        key = target.client_args[0] if target.client_args else ""
        args = [target.host, str(target.http_port), str(max_tokens), key]
        command = [sys.executable, "-c", KILLED_HTTP_CLIENT, *args]
    else:
        args = [target.host, str(target.port), str(max_tokens), *target.client_args]
        command = [sys.executable, "-c", KILLED_CLIENT, *args]
    processes = [
        await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE) for _ in range(count)
    ]
    for process in processes:
        assert process.stdout is not None
        try:
            await asyncio.wait_for(process.stdout.readline(), 60)
        finally:
            process.send_signal(signal.SIGKILL)
    for process in processes:
        await process.wait()
    return sum(process.returncode == -signal.SIGKILL for process in processes)
