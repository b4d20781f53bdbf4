"""Whose a request is: its tenant, with the tenant's weight, its priority within the tenant, and
the client connection it came on. The fair share (loom/core/fair_share.py) schedules by it."""

from __future__ import annotations

import attrs

MAX_PRIORITY = 1_000_000  # a request's priority, either way


@attrs.frozen(kw_only=True)
class Tenancy:
    """Whose a request is, with what weight, and its `priority` within its tenant (lower first,
    as vLLM's)."""

    tenant: str = ""
    weight: float = 1.0
    priority: int = 0
    connection: str = ""  # the client connection it came on: inside a tenant, they share


SHARED = Tenancy()  # one tenant for all, at weight 1 and priority 0: what an engine alone sees
