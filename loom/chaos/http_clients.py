"""The clients of `loom chaos --api openai`: one streamed POST /v1/completions each, on an HTTP/1.1
connection of its own, behaving as a gRPC client of loom/chaos/clients.py does, over a bare
socket (so that it can stop reading, or end with an RST).

Outcomes name what a gRPC client would see, so that the scenarios judge both fronts alike: "ok"
(every event through `[DONE]`), the status a refusal maps to (429 RESOURCE_EXHAUSTED, 408
DEADLINE_EXCEEDED, 503 UNAVAILABLE, 499 CANCELLED, 400 INVALID_ARGUMENT), the same names for an
error event mid-stream, how the client left ("cancelled" and "dropped": it closed the
connection; "reset": an RST), "closed by the server" (a stream given up on: the gRPC reset's
twin) or "client timeout".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from typing import Any

from loom.chaos.clients import Behaviour, Target
from loom.client.sse import DONE, SseReader

STATUSES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    408: "DEADLINE_EXCEEDED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    503: "UNAVAILABLE",
}
CODES = {
    "deadline": "DEADLINE_EXCEEDED",
    "stalled": "RESOURCE_EXHAUSTED",
    "refused": "RESOURCE_EXHAUSTED",
    "error": "UNAVAILABLE",
    "aborted": "CANCELLED",
}
CLIENT_GRACE = 5.0  # seconds past its X-Request-Timeout a client waits for the server's 408
READ_LIMIT = 4096  # the client's own buffer: a stopped reader holds back the server soon


def body_of(message: Any) -> bytes:
    """A loom.v1 GenerateRequest as the same completion request."""
    sampling = message.sampling
    body: dict[str, Any] = {
        "prompt": list(message.token_ids.ids),
        "max_tokens": sampling.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if sampling.HasField("logprobs"):
        body["logprobs"] = sampling.logprobs
    return json.dumps(body).encode()


def head_of(target: Target, body: bytes, behaviour: Behaviour) -> bytes:
    lines = [
        "POST /v1/completions HTTP/1.1",
        f"Host: {target.host}:{target.http_port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    key = target.client_args[0] if target.client_args else ""
    if key:
        lines.append(f"Authorization: Bearer {key}")
    if behaviour.timeout is not None:
        lines.append(f"X-Request-Timeout: {behaviour.timeout:g}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def http_stream_once(target: Target, message: Any, behaviour: Behaviour) -> str:
    """One call behaving as told: its outcome."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if behaviour.leave == "stop":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, READ_LIMIT)
    sock.setblocking(False)
    writer: asyncio.StreamWriter | None = None
    try:
        await asyncio.get_running_loop().sock_connect(sock, (target.host, target.http_port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=READ_LIMIT)
        body = body_of(message)
        writer.write(head_of(target, body, behaviour) + body)
        wait = None if behaviour.timeout is None else behaviour.timeout + CLIENT_GRACE
        return await asyncio.wait_for(read_stream(reader, writer, behaviour), wait)
    except TimeoutError:
        return "client timeout"
    except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
        return "closed by the server"
    except Exception as exc:  # reported, not raised: a finding
        return type(exc).__name__
    finally:
        if writer is not None:
            writer.close()
        else:
            sock.close()


async def read_stream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, behaviour: Behaviour
) -> str:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status = int(head.split(" ", 2)[1])
    if status != 200:
        return STATUSES.get(status, f"HTTP {status}")
    received, stopped, events = 0, False, SseReader()
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        if size == 0:
            return "closed by the server"  # the body ended without [DONE]
        for chunk in events.feed((await reader.readexactly(size + 2))[:-2]):
            if chunk == DONE:
                return "ok"
            if "error" in chunk:
                return CODES.get(chunk["error"].get("code"), "error event")
            received += 1
            if behaviour.release is not None and behaviour.release.is_set():
                return "released"
            if behaviour.leave is not None and received > behaviour.after and not stopped:
                if (left := await leave(behaviour, writer)) is not None:
                    return left
                stopped = True
            if behaviour.interval:
                await asyncio.sleep(behaviour.interval)


async def leave(behaviour: Behaviour, writer: asyncio.StreamWriter) -> str | None:
    """Leave as the behaviour says: how it left; None when it reads on. HTTP has no way to
    cancel one stream but closing its connection: "cancel" and "drop" both close it."""
    if behaviour.leave in ("cancel", "drop"):
        writer.close()
        return "cancelled" if behaviour.leave == "cancel" else "dropped"
    if behaviour.leave == "reset":
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        return "reset"
    await asyncio.sleep(behaviour.stop_for)  # "stop": reads nothing for a while, then reads on
    return None
