"""How a client calls a server over gRPC: plaintext or TLS, and metadata sent with every call
(an API key, a tenant's name)."""

from __future__ import annotations

import argparse
import ssl
from typing import Any

import attrs
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.events import SendRequest, listen

from loom.client.tls import tls_of

# The smallest HTTP/2 windows: a client that stops reading holds back the server at once.
SMALL_WINDOWS = Configuration(http2_connection_window_size=65535, http2_stream_window_size=65535)


@attrs.frozen(kw_only=True)
class Client:
    tls: ssl.SSLContext | None = None
    metadata: dict[str, str] | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> Client:
        """The client the TLS flags and `--api-key` ask for."""
        key = getattr(args, "api_key", None)
        return cls(tls=tls_of(args), metadata={"authorization": f"Bearer {key}"} if key else None)

    def channel(self, host: str, port: int, **options: Any) -> Channel:
        """A channel whose every call carries the metadata (grpclib's SendRequest event)."""
        channel = Channel(host, port, ssl=self.tls, **options)
        metadata = self.metadata or {}

        async def add_metadata(event: SendRequest) -> None:
            for key, value in metadata.items():
                event.metadata[key] = value

        if metadata:
            listen(channel, SendRequest, add_metadata)
        return channel

    def with_metadata(self, **metadata: str) -> Client:
        return attrs.evolve(self, metadata={**(self.metadata or {}), **metadata})


PLAIN = Client()
