"""Which Host the HTTP front answers to and which origins get CORS headers (socket-free)."""

from __future__ import annotations

import pytest

from loom.server.openai.origin_policy import OriginPolicy, host_name


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:8000", "localhost"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("Example.COM.:80", "example.com"),
        ("127.0.0.1", "127.0.0.1"),
    ],
)
def test_origin_policy_host_name_drops_port_case_and_final_dot(header: str, name: str) -> None:
    assert host_name(header) == name


def test_origin_policy_on_loopback_answers_localhost_names_and_addresses_only() -> None:
    policy = OriginPolicy("127.0.0.1", None, ())
    for host in ("localhost", "LOCALHOST:8000", "app.localhost", "127.0.0.1:8000", "[::1]:1"):
        assert policy.host_allowed(host), host
    assert policy.host_allowed("10.1.2.3")  # an address no page can rebind
    for host in ("rebound.attacker.example", "localhost.attacker.example", "example.com:8000"):
        assert not policy.host_allowed(host), host
    assert policy.host_allowed(None)  # HTTP/1.0 without Host: no browser sends it


def test_origin_policy_beyond_loopback_answers_any_name_unless_told() -> None:
    """In a container or a cluster (0.0.0.0), clients come by names the server cannot know."""
    assert OriginPolicy("0.0.0.0", None, ()).host_allowed("loom.default.svc:8000")
    named = OriginPolicy("0.0.0.0", ("loom.internal", ".example.com"), ())
    assert named.host_allowed("loom.internal:8000")
    assert named.host_allowed("example.com")
    assert named.host_allowed("api.example.com")
    assert not named.host_allowed("evil-example.com")
    assert not named.host_allowed("127.0.0.1")
    assert OriginPolicy("127.0.0.1", ("*",), ()).host_allowed("anything.example")


def test_origin_policy_cors_headers_only_for_named_origins() -> None:
    assert OriginPolicy("127.0.0.1", None, ()).cors("https://app.example") == {}
    policy = OriginPolicy("127.0.0.1", None, ("https://app.example",))
    assert policy.cors("https://app.example")["Access-Control-Allow-Origin"] == (
        "https://app.example"
    )
    assert policy.cors("https://evil.example") == {}
    assert policy.cors(None) == {}
    assert OriginPolicy("127.0.0.1", None, ("*",)).cors("https://any.example") != {}


def test_origin_policy_odd_hosts_and_entries() -> None:
    """A bracket followed by a name is not an address; entries are compared as Hosts are
    (their port and final dot dropped, lowercased); a preflight allows what it asks for."""
    policy = OriginPolicy("127.0.0.1", None, ())
    assert not policy.host_allowed("[::1].evil.example")
    assert not policy.host_allowed("[::1]x")
    named = OriginPolicy("0.0.0.0", ("Loom.Internal.:8000",), ())
    assert named.host_allowed("loom.internal")
    asked = "x-stainless-os, content-type"
    assert policy.preflight(asked)["Access-Control-Allow-Headers"] == asked
    assert "Authorization" in policy.preflight(None)["Access-Control-Allow-Headers"]
