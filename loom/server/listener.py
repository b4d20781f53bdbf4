"""A listening socket, accepted by hand so that the connection caps hold at the accept itself;
one for each port (gRPC, HTTP), all counting against one set of caps (loom/server/caps.py).

asyncio's own server accepts as many connections as wait, and only then runs their protocols:
a burst of 1,100 takes 1,100 descriptors before any cap is checked, and past the descriptor
limit it stops accepting for a second, everyone's connections refused alike. Here each accept
is counted at once: over `max_connections` in all or `max_connections_per_peer` from one
address, the connection is told which limit in its port's protocol (`refusal`: a GOAWAY, a 503)
and closed, still within the accept; the others go to the front. If accepting fails anyway
(ENFILE: the whole machine's descriptors), it pauses for `RETRY_DELAY`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import socket
import struct
from collections.abc import Callable

from loom.server.caps import ConnectionCaps, Seat

log = logging.getLogger(__name__)
BACKLOG = 1024  # the listen queue (nginx: 511; grpclib: 100, too few for a burst of clients)
ACCEPTS_PER_TURN = 128  # then the loop's other work gets its turn
RETRY_DELAY = 0.1
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def peer_host(address: object) -> str:
    return str(address[0]) if isinstance(address, tuple) and address else str(address)


class Listener:
    def __init__(
        self,
        caps: ConnectionCaps,
        on_accept: Callable[[socket.socket, Seat], None],
        refused: Callable[[str], None],
        refusal: Callable[[str, str], bytes],
    ) -> None:
        self.caps = caps  # shared by every port's listener
        self.on_accept = on_accept  # hands an accepted socket (and its place) on
        self.refused = refused
        self.refusal = refusal  # what a connection over a cap is told: the port's protocol
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
        refusal = self.caps.over_cap(host)
        if refusal is not None:
            self.refuse(conn, *refusal)
            return True
        self.on_accept(conn, self.caps.take(host))
        return True

    def refuse(self, conn: socket.socket, cause: str, why: str) -> None:
        """Tell a connection over a cap why (gRPC: SETTINGS and GOAWAY; HTTP: a 503), and close
        it: what it has sent is read first, so that the close is not a reset that would lose
        the answer."""
        self.refused(cause)
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.send(self.refusal(cause, why))
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(65536):
                pass
        conn.close()

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
