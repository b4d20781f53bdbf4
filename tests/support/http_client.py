"""Plain HTTP for the HTTP API's tests, what the `openai` client hides: status, headers and the
body's bytes as they came (http.client, in a worker thread: the server runs in trio)."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

import trio
from openai import OpenAI

HOST = "127.0.0.1"


def post_sync(
    port: int, path: str, body: Any, headers: dict[str, str] | None = None, method: str = "POST"
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(HOST, port, timeout=60)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        connection.request(
            method, path, body=data if method == "POST" else None, headers=all_headers
        )
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


async def post(
    port: int, path: str, body: Any, headers: dict[str, str] | None = None, method: str = "POST"
) -> tuple[int, dict[str, str], bytes]:
    return await trio.to_thread.run_sync(post_sync, port, path, body, headers, method)


def openai_client(port: int, api_key: str = "none") -> OpenAI:
    return OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key=api_key, max_retries=0, timeout=60)


def read_all(sock: socket.socket, seconds: float = 10) -> bytes:
    """What the server sends until it closes the connection (or `seconds` pass)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data
