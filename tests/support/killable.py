"""Client processes to kill: a fork server that has imported grpclib and h2 once and forks a
streaming client on demand, in a millisecond rather than a new interpreter's second, so that a
test can SIGKILL hundreds of real client processes at random points of their streams.

    python -m tests.support.killable HOST PORT [HTTP_PORT]
    stdin: "grpclib MAX_TOKENS", "h2 MAX_TOKENS" or "http MAX_TOKENS", a line each -> stdout:
    the child's pid

- grpclib: grpclib's client, one channel, one Generate stream read to the end. Killed, the
  kernel closes its socket: a FIN, or an RST when unread data is left in it.
- h2: a bare h2 client whose socket has SO_LINGER 0, so that its death is a TCP RST whatever
  it had read; it answers SETTINGS and PINGs and keeps its window open, as a reader does.

- http: a streamed /v1/completions on the HTTP API's port, read over a bare socket.

Children are reaped by the kernel (SIGCHLD ignored); the test kills them by pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import sys

import h2.connection
import h2.events
from grpclib.client import Channel

from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub


def request(max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 4, 5]), sampling=sampling)


async def grpclib_client(host: str, port: int, max_tokens: int) -> None:
    async with Channel(host, port) as channel, LoomStub(channel).Generate.open() as stream:
        await stream.send_message(request(max_tokens), end=True)
        async for _ in stream:
            pass


def h2_client(host: str, port: int, max_tokens: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.connect((host, port))
    connection = h2.connection.H2Connection()
    connection.initiate_connection()
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", f"{host}:{port}")]
    headers += [(":path", "/loom.v1.Loom/Generate"), ("content-type", "application/grpc")]
    connection.send_headers(1, [*headers, ("te", "trailers")])
    body = request(max_tokens).SerializeToString()
    connection.send_data(1, b"\0" + len(body).to_bytes(4, "big") + body, end_stream=True)
    while True:
        sock.sendall(connection.data_to_send())
        data = sock.recv(65536)
        if not data:
            return
        for event in connection.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                connection.acknowledge_received_data(event.flow_controlled_length, 1)


def http_client(host: str, port: int, max_tokens: int) -> None:
    body = json.dumps(
        {
            "prompt": [3, 4, 5],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        while sock.recv(65536):
            pass


def child(kind: str, host: str, port: int, max_tokens: int) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        if kind == "grpclib":
            asyncio.run(grpclib_client(host, port, max_tokens))
        elif kind == "http":
            http_client(host, int(sys.argv[3]), max_tokens)
        else:
            h2_client(host, port, max_tokens)
    finally:
        os._exit(0)


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    print("ready", flush=True)
    for line in sys.stdin:
        kind, max_tokens = line.split()
        pid = os.fork()
        if pid == 0:
            sys.stdin.close()
            child(kind, host, port, int(max_tokens))
        print(pid, flush=True)


if __name__ == "__main__":
    main()
