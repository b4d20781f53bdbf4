"""A kill storm of 1,000 clients against a real server (tests/support/storm.py): afterwards every
block is free, no client saw INTERNAL, the engine is the one it started with, and a normal request
is still answered correctly.

Rules: port 0; the whole storm under `fail_after`; its clients run on an asyncio loop in a
worker thread, and some in processes of their own, SIGKILLed mid-stream.
"""

from __future__ import annotations

import trio

from loom.engine.engine import EngineState
from loom.model.loader import LoadedModel
from tests.support.greedy import reference_tokens
from tests.support.grpc_client import (
    HOST,
    generate,
    greedy,
    in_asyncio,
    token_ids,
    wait_all_blocks_free,
)
from tests.support.server_harness import serving
from tests.support.storm import storm


async def test_storm_of_a_thousand_clients_leaves_every_block_free(tiny_chat: LoadedModel) -> None:
    expected = reference_tokens(tiny_chat.model, [9, 9, 9], 20)
    config = {"output_buffer_size": 4, "stall_timeout": 3.0}
    async with serving(tiny_chat, **config) as (server, port):
        with trio.fail_after(300):
            outcomes = await in_asyncio(
                storm, HOST, port, num_clients=1000, concurrency=64, vocab_size=512, seed=7
            )
            stats = await wait_all_blocks_free(port)
            assert (stats.num_running, stats.num_waiting, stats.num_paused) == (0, 0, 0)
            assert token_ids(await in_asyncio(generate, port, greedy([9, 9, 9], 20))) == expected
        readers = {outcome for outcome in outcomes if outcome.startswith("read:")}
        assert readers == {"read: ok"}, outcomes
        assert not any(o.endswith(("INTERNAL", "UNKNOWN")) for o in outcomes), outcomes
        assert sum(outcomes.values()) == 1000 + outcomes["killed process"]
        assert outcomes["killed process"] == 20
        assert server.engine.state is EngineState.SERVING
        print(dict(outcomes), dict(stats.finished))
