"""Tenants through SMG: in its HTTP mode the gateway passes each client's `Authorization`
through, so a replica with an API key file names each request's tenant by its own key, and its
fair share and stats see the real tenants, not one gateway. The gateway has a key of its own
for what it asks itself (the model, the loads).

Rules: one `loom serve --model sim:...,tokenizer=default --api-key-file` process; the real
`smg`; the official openai client, one per tenant.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import openai
import pytest
from grpclib.client import Channel

from loom.bench.serving import launched_process
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub
from tests.support.grpc_client import HOST, run_client
from tests.support.smg_front import Gateway, smg_front

KEYS = "key-of-a a\nkey-of-b b weight=2\nkey-of-root ops admin\nkey-of-smg gateway\n"
# The gateway's own key (its registration, health and load polls), and each tenant's, which
# it checks and passes through.
SMG_KEYS = ("--tenant-api-key", "a:key-of-a", "--tenant-api-key", "b:key-of-b")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Gateway]]:
    """A replica with keys behind SMG in its HTTP mode: the replica's gRPC port, the gateway."""
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(KEYS)
    args = [
        *("--model", "sim:step_ms=2,tokenizer=default", "--served-model-name", "sim"),
        *("--http-port", "0", "--api-key-file", str(key_file)),
    ]
    ports: dict[str, int] = {}
    with ExitStack() as stack:
        grpc_port, _ = stack.enter_context(launched_process(args, ports=ports))
        urls = [f"http://{HOST}:{ports['http']}"]
        front = stack.enter_context(smg_front(urls, *SMG_KEYS, api_key="key-of-smg"))
        yield grpc_port, front


def ask(gateway: Gateway, key: str, words: int) -> None:
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0) as client:
        prompt = " ".join(["sea"] * words)
        client.completions.create(model="sim", prompt=prompt, max_tokens=2, temperature=0)


async def admin_stats(port: int) -> pb.ServerStats:
    async with Channel(HOST, port) as channel:
        metadata = {"authorization": "Bearer key-of-root"}
        return await LoomStub(channel).GetServerStats(pb.GetServerStatsRequest(), metadata=metadata)


def test_smg_passes_each_clients_key_so_loom_sees_each_tenant(
    keyed: tuple[int, Gateway],
) -> None:
    port, gateway = keyed
    ask(gateway, "key-of-a", 10)
    ask(gateway, "key-of-b", 30)
    tenants = run_client(admin_stats, port).tenants
    assert set(tenants) == {"a", "b"}  # not one tenant for the gateway
    assert tenants["a"].num_prompt_tokens < tenants["b"].num_prompt_tokens
    assert tenants["b"].weight == 2.0


def test_smg_refuses_a_key_it_does_not_know(keyed: tuple[int, Gateway]) -> None:
    _, gateway = keyed
    with pytest.raises(openai.AuthenticationError):
        ask(gateway, "key-of-nobody", 3)
