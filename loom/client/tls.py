"""A client's TLS: its context (TLS 1.2 or later, ALPN h2, as gRPC requires; the server checked
against a CA file or the system's CAs; a certificate of its own for mutual TLS), and the flags
that ask for it (`loom health`, `loom bench`, `loom chaos`)."""

from __future__ import annotations

import argparse
import ssl


def client_context(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A client's TLS context: the server's certificate checked against `ca_file` (else the
    system's CAs), and a certificate of its own for mutual TLS."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
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
