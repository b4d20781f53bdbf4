"""A client that sends large JSON bodies all but their last bytes, then those together, in a
process of its own: `python -m tests.support.hostile_bodies HOST PORT COUNT MIB`. Each body is COUNT
connections' `{"prompt": [0, 0, ...]}` of about MIB MiB (numbers: the costliest JSON to read).
It prints "held" once every body but its last byte is sent, sends the last bytes when a line
comes on stdin, and prints each response's status line."""

from __future__ import annotations

import socket
import sys


def body(mib: float) -> bytes:
    count = int(mib * (1 << 20)) // 2
    return b'{"prompt": [' + b",".join([b"0"] * count) + b"]}"


def main(host: str, port: int, count: int, mib: float) -> None:
    data = body(mib)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    socks = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=120)
        sock.sendall(head + data[:-1])
        socks.append(sock)
    print("held", flush=True)
    sys.stdin.readline()
    for sock in socks:
        sock.sendall(data[-1:])
    for sock in socks:
        print(sock.recv(4096).split(b"\r\n", 1)[0].decode(), flush=True)
        sock.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
