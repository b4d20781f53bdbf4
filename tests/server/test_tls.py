"""TLS and mutual TLS at the network boundary (loom/server/tls.py), with certificates
made at test time (trustme), against grpclib and grpcio clients: both are served over TLS (ALPN
h2); without a client certificate a mutual-TLS server refuses the handshake; a plaintext
client to a TLS port is refused cleanly (no traceback in the server's log), and the server
serves on.

Rules: port 0; the server in this process; clients in worker threads; every test under
`fail_after`.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
import trustme
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError

from loom.client.calls import health
from loom.client.channel import Client
from loom.client.tls import client_context
from loom.engine.config import EngineConfig
from loom.engine.engine import Engine
from loom.model.loader import LoadedModel
from loom.server.boundary import BoundaryConfig
from loom.server.config import ServerConfig
from loom.server.openai.config import HttpConfig
from loom.server.supervisor import Supervisor
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub
from tests.support.grpc_client import HOST, greedy, in_asyncio, token_ids
from tests.support.server_harness import serving

GENERATE = "/loom.v1.Loom/Generate"


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1, and a client certificate, as PEM files."""
    ca = trustme.CA()
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key", "ccert", "ckey")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server = ca.issue_cert(HOST, "localhost")
    server.cert_chain_pems[0].write_to_path(str(files["cert"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    client = ca.issue_cert("tenant-a@example.com", common_name="tenant-a")
    client.cert_chain_pems[0].write_to_path(str(files["ccert"]))
    client.private_key_pem.write_to_path(str(files["ckey"]))
    return files


@asynccontextmanager
async def tls_serving(
    loaded: LoadedModel, pki: dict[str, Path], *, mutual: bool = False, **limits: Any
) -> AsyncIterator[int]:
    """A server of TLS with the test's certificate; `mutual`: wanting clients' too."""
    boundary = BoundaryConfig(
        tls_cert_file=str(pki["cert"]),
        tls_key_file=str(pki["key"]),
        tls_client_ca_file=str(pki["ca"]) if mutual else None,
        **limits,
    )
    async with serving(loaded, boundary=boundary) as (_, port):
        yield port


def files_of(pki: dict[str, Path], *names: str) -> list[str]:
    return [str(pki[name]) for name in names]


async def grpclib_generate(port: int, context: ssl.SSLContext | None) -> list[int]:
    async with Channel(HOST, port, ssl=context) as channel:
        return token_ids(list(await LoomStub(channel).Generate(greedy([1, 2], 4), timeout=10)))


async def server_stats(port: int, context: ssl.SSLContext) -> pb.ServerStats:
    async with Channel(HOST, port, ssl=context) as channel:
        return await LoomStub(channel).GetServerStats(pb.GetServerStatsRequest(), timeout=10)


def grpcio_generate(port: int, ca: Path, cert: Path | None = None, key: Path | None = None) -> int:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )
    with grpc.secure_channel(f"{HOST}:{port}", credentials) as channel:
        call = channel.unary_stream(
            GENERATE,
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        responses = list(call(greedy([1, 2], 4), timeout=10))
    return sum(len(r.delta.token_ids or r.final.delta.token_ids) for r in responses)


async def test_tls_grpclib_and_grpcio_clients_are_served(
    tiny_chat: LoadedModel, pki: dict[str, Path]
) -> None:
    async with tls_serving(tiny_chat, pki) as port:
        with trio.fail_after(30):
            context = client_context(str(pki["ca"]))
            assert len(await in_asyncio(grpclib_generate, port, context)) == 4
            assert await trio.to_thread.run_sync(grpcio_generate, port, pki["ca"]) == 4
            assert await in_asyncio(health, HOST, port, Client(tls=context)) == "SERVING"


async def test_tls_mutual_wants_a_client_certificate_from_the_ca(
    tiny_chat: LoadedModel, pki: dict[str, Path]
) -> None:
    ca = str(pki["ca"])
    async with tls_serving(tiny_chat, pki, mutual=True) as port:
        with trio.fail_after(30):
            with_cert = client_context(ca, *files_of(pki, "ccert", "ckey"))
            assert len(await in_asyncio(grpclib_generate, port, with_cert)) == 4
            served = await trio.to_thread.run_sync(
                grpcio_generate, port, pki["ca"], pki["ccert"], pki["ckey"]
            )
            assert served == 4
            seen = await in_asyncio(server_stats, port, with_cert)
            assert set(seen.tenants) == {"tenant-a"}  # the certificate's subject names it
            with pytest.raises((ssl.SSLError, OSError, StreamTerminatedError)):
                await in_asyncio(grpclib_generate, port, client_context(ca))  # no certificate
            with pytest.raises(grpc.RpcError) as refused:
                await trio.to_thread.run_sync(grpcio_generate, port, pki["ca"])
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


async def test_tls_a_plaintext_client_is_refused_cleanly_and_the_server_serves_on(
    tiny_chat: LoadedModel, pki: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    async with tls_serving(tiny_chat, pki) as port:
        with trio.fail_after(30):
            with pytest.raises(Exception):  # noqa: B017, PT011 (grpclib's word for it varies)
                await in_asyncio(grpclib_generate, port, None)
            context = client_context(str(pki["ca"]))
            assert len(await in_asyncio(grpclib_generate, port, context)) == 4
    failures = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert failures == [], [r.getMessage() for r in failures]


def test_tls_settings_go_together_and_a_bad_file_fails_at_start(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file go together"):
        BoundaryConfig(tls_cert_file="cert.pem")
    with pytest.raises(ValueError, match="tls_client_ca_file needs"):
        BoundaryConfig(tls_client_ca_file="ca.pem")
    boundary = BoundaryConfig(tls_cert_file="no.pem", tls_key_file="no.pem")
    with pytest.raises(ValueError, match="tls_cert_file, tls_key_file: "):
        Supervisor(Engine(EngineConfig(), lambda: tiny), ServerConfig(boundary=boundary))


def handshake_without_alpn(port: int, ca: str) -> bytes:
    """A TLS client that offers no ALPN (no h2): what the server sends it after the handshake."""
    context = ssl.create_default_context(cafile=ca)
    with (
        socket.create_connection((HOST, port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=HOST) as tls,
    ):
        try:
            return tls.recv(65536)
        except (ConnectionResetError, ssl.SSLError):
            return b""


async def test_tls_a_client_that_does_not_agree_to_h2_is_closed(
    tiny_chat: LoadedModel, pki: dict[str, Path]
) -> None:
    async with tls_serving(tiny_chat, pki) as port:
        with trio.fail_after(30):
            received = await trio.to_thread.run_sync(handshake_without_alpn, port, str(pki["ca"]))
            assert received == b""  # closed, no HTTP/2 preface sent to it
            context = client_context(str(pki["ca"]))
            assert len(await in_asyncio(grpclib_generate, port, context)) == 4


def silent_until_closed(port: int) -> bytes:
    """A TCP client that never starts the TLS handshake: what it reads before the server closes
    it (the socket gives up after 8 s)."""
    with socket.create_connection((HOST, port), timeout=8) as sock:
        try:
            return sock.recv(65536)
        except ConnectionResetError:
            return b""


async def test_tls_a_handshake_never_begun_is_closed_at_the_preface_timeout(
    tiny_chat: LoadedModel, pki: dict[str, Path]
) -> None:
    async with tls_serving(tiny_chat, pki, preface_timeout=1.0) as port:
        with trio.fail_after(30):
            assert await trio.to_thread.run_sync(silent_until_closed, port) == b""
            context = client_context(str(pki["ca"]))
            assert len(await in_asyncio(grpclib_generate, port, context)) == 4


async def test_tls_the_http_api_serves_the_same_certificate_with_alpn_http_1_1(
    tiny_chat: LoadedModel, pki: dict[str, Path]
) -> None:
    boundary = BoundaryConfig(
        tls_cert_file=str(pki["cert"]), tls_key_file=str(pki["key"]), preface_timeout=1
    )
    body = json.dumps({"prompt": "Hello", "max_tokens": 3}).encode()

    def call(port: int) -> tuple[int, bytes, str | None]:
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        context.set_alpn_protocols(["http/1.1"])
        connection = http.client.HTTPSConnection(HOST, port, context=context, timeout=30)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert connection.sock is not None
        protocol = connection.sock.selected_alpn_protocol()
        reply = response.status, response.read(), protocol
        connection.close()
        return reply

    def plaintext(port: int) -> bytes:
        with socket.create_connection((HOST, port), timeout=30) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            return sock.recv(4096)

    async with serving(tiny_chat, boundary=boundary, http=HttpConfig(http_port=0)) as (server, _):
        with trio.fail_after(60):
            status, raw, protocol = await trio.to_thread.run_sync(call, server.http_port)
            refused = await trio.to_thread.run_sync(plaintext, server.http_port)
    assert (status, protocol) == (200, "http/1.1")
    assert json.loads(raw)["usage"]["completion_tokens"] == 3
    assert not refused.startswith(b"HTTP/1.1 200")  # plaintext on the TLS port gets nothing
