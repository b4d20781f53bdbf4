"""Which `Host` the HTTP front answers to, and which web pages' origins may read its answers.

A web page can make a browser send requests to a Loom on the user's own machine: to another
origin (CORS), and, by DNS rebinding (the page's own name made to resolve to 127.0.0.1), as
its own origin, where the browser then lets it read every answer. The `Host` a request names
tells the two apart: a rebound page's is its own name.

- `allowed_hosts` unset: a front listening on a loopback address answers to the localhost
  names (`localhost`, `*.localhost`) and any IP address (a name no page can rebind), as Jupyter
  does; a front listening beyond loopback (`0.0.0.0`: behind a proxy, in a container, in a
  cluster) is reached by names it cannot know, and answers to any. Set: exactly those names
  (`.example.com` for a domain and its subdomains, `*` for any). A request with no `Host`
  (HTTP/1.0) passes: every browser sends one.
- `allowed_origins` empty: no CORS headers, so no other origin's page may read an answer, nor
  send a JSON body (its preflight is refused). Named (or `*`): those origins may.
"""

from __future__ import annotations

import ipaddress

PREFLIGHT = {"Access-Control-Allow-Methods": "GET, POST", "Access-Control-Max-Age": "600"}
HEADERS = "Authorization, Content-Type, X-Request-Id, X-Request-Timeout"


class OriginPolicy:
    def __init__(
        self,
        listen_host: str,
        allowed_hosts: tuple[str, ...] | None,
        allowed_origins: tuple[str, ...],
    ) -> None:
        self.allowed_hosts = None if allowed_hosts is None else set(map(allowed, allowed_hosts))
        self.local_only = allowed_hosts is None and is_loopback(listen_host)
        self.allowed_origins = set(allowed_origins)

    def host_allowed(self, host_header: str | None) -> bool:
        if host_header is None:
            return True
        name = host_name(host_header)
        if self.allowed_hosts is not None:
            return "*" in self.allowed_hosts or any(
                name == allowed or (allowed.startswith(".") and f".{name}".endswith(allowed))
                for allowed in self.allowed_hosts
            )
        if not self.local_only:
            return True
        return name == "localhost" or name.endswith(".localhost") or is_address(name)

    def preflight(self, asked: str | None) -> dict[str, str]:
        """A preflight's answer, for an allowed origin: the headers it asks to send (an SDK's
        own, say), or Loom's."""
        return {**PREFLIGHT, "Access-Control-Allow-Headers": asked or HEADERS}

    def cors(self, origin: str | None) -> dict[str, str]:
        """The CORS headers for every response to a request from `origin`."""
        if origin is None or not (origin in self.allowed_origins or "*" in self.allowed_origins):
            return {}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}


def host_name(host_header: str) -> str:
    """`Host: [::1]:8000` -> `::1`; `Example.COM.:80` -> `example.com`."""
    text = host_header.strip().lower()
    if text.startswith("["):
        address, _, rest = text[1:].partition("]")
        return address if rest == "" or (rest[:1] == ":" and rest[1:].isdigit()) else text
    name, colon, port = text.rpartition(":")
    if colon and port.isdigit():
        text = name
    return text.rstrip(".")


def allowed(entry: str) -> str:
    """An `--allowed-hosts` entry as a Host's name is compared: `.example.com` and `*` kept,
    a port or a final dot dropped, lowercased."""
    entry = entry.strip().lower()
    return entry if entry == "*" or entry.startswith(".") else host_name(entry)


def is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(listen_host: str) -> bool:
    if listen_host == "localhost":
        return True
    try:
        return ipaddress.ip_address(listen_host).is_loopback
    except ValueError:
        return False
