"""The server's TLS context (`--tls-cert-file`, `--tls-key-file`, and `--tls-client-ca-file`
for mutual TLS): TLS 1.2 or later, ALPN h2 as gRPC requires (http/1.1 on the HTTP port). A bad
file fails at start, as a ValueError naming the setting. A client's: loom/client/tls.py."""

from __future__ import annotations

import ssl

from loom.server.boundary import BoundaryConfig


def server_context(
    config: BoundaryConfig, alpn: tuple[str, ...] = ("h2",)
) -> ssl.SSLContext | None:
    """The server's TLS context, or None to serve plaintext (the HTTP API's: ALPN http/1.1)."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(list(alpn))
    try:
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"tls_cert_file, tls_key_file: {exc}") from None
    if config.tls_client_ca_file is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_verify_locations(config.tls_client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls_client_ca_file: {exc}") from None
    return context
