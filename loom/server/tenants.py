"""Who a call is for: its tenant, named before anything of the call is read.

    an API key (--api-key-file)  `authorization: Bearer KEY`, as OpenAI clients send it; when
                                 keys are configured, every call but a health probe needs one
                                 (UNAUTHENTICATED otherwise, before its request is read)
    else a trusted proxy's word  `loom-tenant: NAME`, honoured only from a peer address in
                                 --trusted-proxies (nginx or an ingress sets it; from anyone
                                 else it is ignored)
    else the client certificate  its subject's commonName, with mutual TLS
    else the peer's address      its IP

The key file has one key a line: `KEY TENANT [weight=W] [admin]`; `#` starts a comment. A key
is looked up by its SHA-256 (the time a dict lookup takes says nothing of the key) and then
compared with `hmac.compare_digest`. A tenant's weight is its share of the queue, the running
slots and the tokens served, against the other tenants that want them (loom/core/fair_share.py);
an admin key sees every tenant's figures.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from grpclib import GRPCError, Status

from loom.core.setting import setting

HEALTH_PREFIX = "/grpc.health.v1.Health/"
MAX_TENANT_CHARS = 128


def networks(text: str) -> tuple[str, ...]:
    """`10.0.0.0/8,127.0.0.1` → its networks (checked by the setting)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def check_networks(name: str, value: Sequence[str]) -> None:
    for network in value:
        try:
            ipaddress.ip_network(network, strict=False)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None


@attrs.frozen(kw_only=True)
class TenantConfig:
    api_key_file: str | None = setting(
        None,
        "require an API key (`authorization: Bearer KEY`): a file of `KEY TENANT [weight=W] "
        "[admin]` lines",
    )
    trusted_proxies: tuple[str, ...] = setting(
        (),
        "comma-separated addresses or networks whose `loom-tenant` header names the tenant",
        check=check_networks,
        parse=networks,
    )
    auth_health: bool = setting(
        False, "health checks need an API key too (by default probes need none)"
    )


@attrs.frozen
class Tenant:
    name: str
    weight: float = 1.0
    admin: bool = False


def read_key_file(path: str) -> dict[bytes, tuple[bytes, Tenant]]:
    """The keys, by their SHA-256: each with itself (to compare) and its tenant."""
    keys: dict[bytes, tuple[bytes, Tenant]] = {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"api_key_file: {exc}") from None
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"api_key_file {path}, line {number}"
        if len(words) < 2:
            raise ValueError(f"{where}: a key and its tenant, got {len(words)} words")
        key, name, *options = words
        tenant = Tenant(name, **parsed_options(options, where))
        digest = hashlib.sha256(key.encode()).digest()
        if digest in keys:
            raise ValueError(f"{where}: the key is already given to {keys[digest][1].name!r}")
        keys[digest] = (key.encode(), tenant)
    if not keys:
        raise ValueError(f"api_key_file {path}: no keys")
    return keys


def parsed_options(options: list[str], where: str) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for option in options:
        if option == "admin":
            parsed["admin"] = True
        elif option.startswith("weight="):
            try:
                weight = float(option.removeprefix("weight="))
            except ValueError:
                weight = float("nan")
            if not (0.01 <= weight <= 100):
                raise ValueError(f"{where}: weight must be in [0.01, 100], got {option!r}")
            parsed["weight"] = weight
        else:
            raise ValueError(f"{where}: unknown option {option!r} (weight=W or admin)")
    return parsed


class Tenants:
    def __init__(self, config: TenantConfig) -> None:
        self.config = config
        self.keys = read_key_file(config.api_key_file) if config.api_key_file else None
        self.proxies = [ipaddress.ip_network(n, strict=False) for n in config.trusted_proxies]

    def identify(self, path: str, metadata: Any, address: Any, cert: Any) -> Tenant | None:
        """The call's tenant; raises UNAUTHENTICATED for a missing or wrong key. None: a health
        probe that needs no key."""
        if self.keys is not None:
            if path.startswith(HEALTH_PREFIX) and not self.config.auth_health:
                return None
            return by_key(self.keys, metadata.get("authorization"))
        host = address[0] if address else ""
        named = metadata.get("loom-tenant")
        if named and self.trusted(host):
            if len(named) > MAX_TENANT_CHARS:
                raise GRPCError(
                    Status.INVALID_ARGUMENT,
                    f"loom-tenant: {len(named)} characters, more than {MAX_TENANT_CHARS}",
                )
            return Tenant(named)
        subject = common_name(cert)
        return Tenant(subject) if subject else Tenant(host)

    def trusted(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.proxies)


def by_key(keys: dict[bytes, tuple[bytes, Tenant]], authorization: str | None) -> Tenant:
    """The tenant whose key the call presents."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise GRPCError(
            Status.UNAUTHENTICATED, "an API key is required: `authorization: Bearer KEY`"
        )
    try:
        presented = key.strip().encode()
    except UnicodeEncodeError:  # not text (an HTTP header's stray bytes): no key is
        presented = b""
    found = keys.get(hashlib.sha256(presented).digest())
    if found is None or not presented or not hmac.compare_digest(found[0], presented):
        raise GRPCError(Status.UNAUTHENTICATED, "the API key is not valid")
    return found[1]


def common_name(cert: Any) -> str | None:
    """The commonName of a certificate's subject, as `getpeercert()` gives it."""
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
