"""What a benchmark run sees of the server: its stats (GetServerStats), polled while it runs."""

from __future__ import annotations

import asyncio

from loom.client.calls import server_stats
from loom.client.channel import Client
from loom.v1 import loom_pb2 as pb


class ServerWatch:
    """Polls GetServerStats during a run: the most KV blocks in use; the run's preemptions and
    prompt tokens from the stats before and after it."""

    def __init__(self, host: str, port: int, client: Client, first: pb.ServerStats) -> None:
        self.host, self.port, self.client = host, port, client
        self.max_used_blocks = 0
        self.first = first

    @classmethod
    async def started(cls, host: str, port: int, client: Client) -> ServerWatch:
        """A watch holding the stats from before the run's first request."""
        return cls(host, port, client, await server_stats(host, port, client))

    async def stats(self) -> pb.ServerStats:
        return await server_stats(self.host, self.port, self.client)

    async def watch(self) -> None:
        while True:
            stats = await self.stats()
            self.max_used_blocks = max(
                self.max_used_blocks, stats.num_total_blocks - stats.num_free_blocks
            )
            await asyncio.sleep(0.25)

    async def summary(self) -> dict[str, int]:
        """The run's figures: its preemptions, prompt tokens (computed, and found in the
        prefix cache) and draft tokens (speculative decoding: steps with drafts, draft tokens
        and those accepted) from the difference of the stats before and after."""
        last, first = await self.stats(), self.first
        queried = last.prefix_cache_queries - first.prefix_cache_queries
        cached = last.prefix_cache_hits - first.prefix_cache_hits
        return {
            "num_total_blocks": last.num_total_blocks,
            "max_used_blocks": self.max_used_blocks,
            "num_preemptions": last.num_preemptions - first.num_preemptions,
            "prompt_tokens_computed": queried - cached,
            "prompt_tokens_cached": cached,
            "spec_drafts": last.spec_decode.num_drafts - first.spec_decode.num_drafts,
            "spec_draft_tokens": (
                last.spec_decode.num_draft_tokens - first.spec_decode.num_draft_tokens
            ),
            "spec_accepted_tokens": (
                last.spec_decode.num_accepted_tokens - first.spec_decode.num_accepted_tokens
            ),
        }
