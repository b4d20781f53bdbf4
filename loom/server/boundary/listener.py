"""The listening socket, accepted by hand so that the connection caps hold at the accept itself.

asyncio's own server accepts as many connections as wait, and only then runs their protocols:
a burst of 1,100 takes 1,100 descriptors before any cap is checked, and past the descriptor
limit it stops accepting for a second, everyone's connections refused alike. Here each accept
is counted at once: over `max_connections` in all or `max_connections_per_peer` from one
address, the connection is sent a GOAWAY that says which limit and closed, still within the
accept; the others go to the endpoint. The caps stay `FD_RESERVE` below the descriptor limit,
whose soft value is first raised to the hard one (as Go's runtime does at start), so accepting
never fails for want of a descriptor; if it fails anyway (ENFILE: the whole machine's), accepting
pauses for `RETRY_DELAY`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import resource
import socket
import struct
from collections import Counter
from collections.abc import Callable

from h2.errors import ErrorCodes

from loom.server.boundary.config import BoundaryConfig
from loom.server.boundary.frames import goaway, refusal_preface

log = logging.getLogger(__name__)
FD_RESERVE = 64  # descriptors left for the model's files, logs, the metrics port, threads
BACKLOG = 1024  # the listen queue (nginx: 511; grpclib: 100, too few for a burst of clients)
ACCEPTS_PER_TURN = 128  # then the loop's other work gets its turn
RETRY_DELAY = 0.1
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def descriptor_room() -> int:
    """Connections the descriptor limit leaves room for, after raising it to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return max(1, soft - FD_RESERVE)


def peer_host(address: object) -> str:
    return str(address[0]) if isinstance(address, tuple) and address else str(address)


class Listener:
    def __init__(
        self,
        config: BoundaryConfig,
        on_accept: Callable[[socket.socket, str], None],
        refused: Callable[[str], None],
    ) -> None:
        self.config = config
        self.on_accept = on_accept  # hands an accepted socket (and its peer host) on
        self.refused = refused
        self.max_connections = min(config.max_connections, descriptor_room())
        if self.max_connections < config.max_connections:
            log.warning(
                "max_connections lowered to %d: the descriptor limit allows no more",
                self.max_connections,
            )
        self.num_connections = 0
        self.per_peer = Counter[str]()
        self.socks: list[socket.socket] = []

    def listen(self, host: str, port: int) -> int:
        """Listen on every address `host` names (`localhost`: IPv4 and IPv6), on `port` (0
        picks one, the same for all); the bound port."""
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # v4 has its own
            if self.socks:  # the port the first one picked
                address = (address[0], self.socks[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
            self.socks.append(sock)
        self.resume()
        return int(self.socks[0].getsockname()[1])

    def accept_ready(self, sock: socket.socket) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            if not self.accept_one(sock):
                return

    def accept_one(self, sock: socket.socket) -> bool:
        """Accept a waiting connection; False when none waits (or accepting must pause)."""
        try:
            conn, address = sock.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if exc.errno not in OUT_OF_RESOURCES:
                raise
            log.warning("accept failed (%s); pausing for %.1f s", exc, RETRY_DELAY)
            self.pause(RETRY_DELAY)
            return False
        host = peer_host(address)
        refusal = self.over_cap(host)
        if refusal is not None:
            self.refuse(conn, *refusal)
            return True
        self.num_connections += 1
        self.per_peer[host] += 1
        self.on_accept(conn, host)
        return True

    def over_cap(self, host: str) -> tuple[str, str] | None:
        if self.num_connections >= self.max_connections:
            limit = self.max_connections
            return "max_connections", (
                f"the server has {limit} connections open; the limit is max_connections={limit}"
            )
        limit = self.config.max_connections_per_peer
        if self.per_peer[host] >= limit:
            return "max_connections_per_peer", (
                f"{host} has {limit} connections open; the limit is "
                f"max_connections_per_peer={limit}"
            )
        return None

    def refuse(self, conn: socket.socket, cause: str, why: str) -> None:
        """Tell a connection over a cap why (SETTINGS, GOAWAY), and close it: what it has sent
        is read first, so that the close is not a reset that would lose the GOAWAY."""
        self.refused(cause)
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.send(refusal_preface() + goaway(ErrorCodes.ENHANCE_YOUR_CALM, 0, why))
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(65536):
                pass
        conn.close()

    def released(self, host: str) -> None:
        """A connection the listener accepted has closed."""
        self.num_connections -= 1
        self.per_peer[host] -= 1
        if not self.per_peer[host]:
            del self.per_peer[host]

    def pause(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        for sock in self.socks:
            loop.remove_reader(sock.fileno())
        loop.call_later(seconds, self.resume)

    def resume(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self.socks:
            loop.add_reader(sock.fileno(), self.accept_ready, sock)

    def close(self) -> int:
        """Stop listening, after accepting what waits in the backlog (closing the socket would
        reset those connections, and a proxy that has sent a call on one takes the reset for a
        failed call rather than a refused connection it may try elsewhere): how many. The
        handshakes are stopped first (`stop_handshakes`), so that none completes into the
        backlog between the last accept and the close (CI saw nginx's call reset there)."""
        taken = 0
        loop = asyncio.get_running_loop()
        for sock in self.socks:
            stop_handshakes(sock)
            while self.accept_one(sock):
                taken += 1
            loop.remove_reader(sock.fileno())
            sock.close()
        self.socks.clear()
        return taken


SO_ATTACH_FILTER = 26  # Linux's, which the socket module does not name
DROP_ALL = struct.pack("HBBI", 0x06, 0, 0, 0)  # classic BPF, one instruction: BPF_RET|BPF_K 0


def stop_handshakes(sock: socket.socket) -> None:
    """Drop every packet that comes for a listening socket from now on (Linux: a socket
    filter, which the kernel applies to a listener's SYNs and to its handshakes' last ACKs):
    a connection being made then completes into no backlog, and meets the closed port when
    its SYN is sent again (a refusal, which a proxy tries elsewhere). Connections already in
    the backlog are accepted as before. Elsewhere, nothing."""
    program = ctypes.create_string_buffer(DROP_ALL)
    fprog = struct.pack("HL", 1, ctypes.addressof(program))  # struct sock_fprog
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
