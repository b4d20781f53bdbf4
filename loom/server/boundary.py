"""Every limit of the network boundary, a `loom serve` flag each, with the default it takes and
where that default comes from (read in the servers people trust; each source is named by file
and identifier, so that a reader can check it):

- connections in all: 1024, and never more than the descriptor limit allows. nginx's
  `worker_connections` is 512; Go's runtime raises RLIMIT_NOFILE to its hard limit at start
  (`syscall/rlimit.go`), and so does Loom.
- connections per peer address: 256, a quarter, so that one host cannot take them all. Neither
  nginx (`limit_conn` has no default) nor Envoy limits it by default; behind a proxy every
  client is the proxy (nginx opens a connection per call upstream): raise it there.
- the preface: 10 s (golang.org/x/net/http2 `prefaceTimeout`; grpc-go allows 120 s for the
  whole handshake).
- an unfinished header block: 10 s (nginx arms `client_header_timeout`, 60 s, while a block
  is incomplete); its size: 16 KiB (gRPC C-core's `GRPC_ARG_ABSOLUTE_MAX_METADATA_SIZE`;
  grpc-java 8 KiB, nginx 32 KiB).
- a request message: 10 s from the call's start (nginx `client_body_timeout` 60 s; grpc-go has
  none); 4 MiB (grpc-go `defaultServerMaxReceiveMessageSize`, C-core and grpc-java alike);
  64 MiB of them being received at once, server-wide (Loom's own: sixteen of the largest).
- an idle connection: 300 s (nginx `keepalive_timeout` 75 s, Envoy `idle_timeout` 1 h), longer
  than nginx's upstream pool keeps one (60 s), so that a proxy closes first.
- streams per connection: 32 (nginx 128, x/net 250, Envoy 1024).
- streams that did no work: judged after 100 streams; if over half were reset within 1 s of
  opening or refused at once, GOAWAY(ENHANCE_YOUR_CALM). Envoy's premature-reset rule (1 s,
  50%, judged after 500); nginx closes after max(streams, 100) refused streams.
- control frames: a burst of 1000, refilled at 100 a second and by 10 for each frame of work
  sent (Envoy allows 10 WINDOW_UPDATEs per DATA frame sent,
  `max_inbound_window_update_frames_per_data_frame_sent`; x/net and nginx close at 10,000
  queued control frames).
- a peer that does not read: past 64 KiB unsent (asyncio's high-water mark) it is not read
  from (grpc-go stops reading once 100 control answers are queued); past 60 s, closed (nginx
  `send_timeout`).
"""

from __future__ import annotations

import attrs

from loom.core.setting import above, at_least, byte_size, setting

# Fixed limits on a request's fields, the same on both ports.
MAX_REQUEST_ID_CHARS = 128
MAX_CHAT_MESSAGES = 4096
# Log-probabilities a whole (unstreamed) answer holds, every choice's (tokens x (top + 1)).
MAX_WHOLE_LOGPROBS = 1 << 17


@attrs.frozen(kw_only=True)
class BoundaryConfig:
    max_connections: int = setting(
        1024,
        "client connections open at once; beyond, a connection is sent GOAWAY and closed "
        "(never more than the descriptor limit allows)",
        check=at_least(1),
    )
    max_connections_per_peer: int = setting(
        256,
        "connections open at once from one address (behind a proxy every client is the proxy: "
        "raise it to --max-connections there)",
        check=at_least(1),
    )
    preface_timeout: float = setting(
        10.0, "seconds a new connection has to send its HTTP/2 preface", check=above(0)
    )
    header_timeout: float = setting(
        10.0,
        "seconds a header block may stay unfinished (HEADERS without END_HEADERS)",
        check=above(0),
    )
    max_header_bytes: int = setting(
        16 << 10,
        "largest header block (as sent, HPACK-compressed, and as decoded), e.g. 16KiB",
        check=at_least(1024),
        parse=byte_size,
    )
    request_timeout: float = setting(
        10.0,
        "seconds from a call's start to its whole request message (the client's deadline, "
        "if sooner)",
        check=above(0),
    )
    idle_timeout: float = setting(
        300.0, "seconds a connection with no stream open is kept before GOAWAY", check=above(0)
    )
    max_streams_per_connection: int = setting(
        32,
        "streams one connection may have open at once (HTTP/2 MAX_CONCURRENT_STREAMS; those "
        "over it are refused RESOURCE_EXHAUSTED)",
        check=at_least(1),
    )
    max_request_bytes: int = setting(
        4 << 20,
        "largest request message accepted, e.g. 4MiB; larger ones are refused unread",
        check=at_least(1),
        parse=byte_size,
    )
    max_buffered_request_bytes: int = setting(
        64 << 20,
        "request messages being received at once, server-wide, by the sizes they declare; "
        "beyond, RESOURCE_EXHAUSTED before the body is read",
        check=at_least(1),
        parse=byte_size,
    )
    reset_streams_judged: int = setting(
        100,
        "streams a connection opens before its share of streams reset within 1 s or refused "
        "is judged: over half, GOAWAY(ENHANCE_YOUR_CALM) (rapid reset, CVE-2023-44487)",
        check=at_least(1),
    )
    control_frame_burst: int = setting(
        1000,
        "PING, SETTINGS, WINDOW_UPDATE, PRIORITY and empty DATA frames a connection may send "
        "at once; beyond, GOAWAY(ENHANCE_YOUR_CALM)",
        check=at_least(10),
    )
    control_frames_per_second: float = setting(
        100.0,
        "how fast that allowance refills (and by 10 for each frame of work sent)",
        check=above(0),
    )
    write_timeout: float = setting(
        60.0,
        "seconds a peer may leave what it was sent untaken before its connection is closed",
        check=above(0),
    )
    tls_cert_file: str | None = setting(
        None, "serve TLS (ALPN h2) with this certificate chain, PEM; with --tls-key-file"
    )
    tls_key_file: str | None = setting(None, "the certificate's private key, PEM")
    tls_client_ca_file: str | None = setting(
        None, "mutual TLS: require client certificates signed by these CAs, PEM"
    )
    write_buffer_bytes: int = setting(
        64 << 10,
        "bytes written to one connection and not yet taken by its peer before the server "
        "stops reading from it",
        check=at_least(1024),
        parse=byte_size,
    )

    def __attrs_post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
