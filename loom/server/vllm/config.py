"""The vLLM engine protocol's own settings (the rest, its limits on calls, sizes and tenants, are
the gRPC port's)."""

from __future__ import annotations

import attrs

from loom.core.setting import at_least, setting


@attrs.frozen(kw_only=True)
class VllmConfig:
    max_kv_subscriptions: int = setting(
        16,
        "vllm.grpc.engine SubscribeKvEvents streams open at once (a gateway's feed of the "
        "prefix cache: each is read on every engine step); beyond, RESOURCE_EXHAUSTED",
        check=at_least(1),
    )
    max_kv_subscriptions_per_tenant: int = setting(
        4, "of those, one tenant's at once (an admin's count against this alone)", check=at_least(1)
    )
    kv_subscribe_interval: float = setting(
        1.0,
        "seconds between two new SubscribeKvEvents streams of one tenant (each begins with a "
        "snapshot of its cached blocks)",
        check=at_least(0.0),
    )
