"""Loom as a vllm.grpc.engine worker behind the real SMG gateway (`smg` from PyPI), on loopback:
SMG finds out what Loom is, takes its tokenizer from it, templates and tokenizes each chat
itself, sends token ids, and makes OpenAI's answers from the token ids Loom returns; every
greedy answer through SMG is Loom's own for the same request.

Rules: replicas are `loom serve --model sim:...,tokenizer=default` processes (the simulated
model with SmolLM2's tokenizer: a step is a sleep, so they do not fight over the 2 cores); the
gateway is given no tokenizer of its own; clients are the official openai client, one to the
gateway and one to a replica's own HTTP API for the answer to compare with.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import pytest
from openai import OpenAI

from loom.bench.serving import launched_process
from loom.client.calls import server_stats
from tests.support.grpc_client import HOST, run_client
from tests.support.http_client import openai_client
from tests.support.smg_front import Gateway, smg_front

MODEL = "sim"
SIM = [
    *("--model", "sim:step_ms=2,tokenizer=default", "--served-model-name", MODEL),
    *("--http-port", "0"),
]
CHAT = [{"role": "user", "content": "Say something about the sea."}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "maximum": 9}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[tuple[int, int]]]:
    """Two replicas: (gRPC port, HTTP port) each."""
    with ExitStack() as stack:
        found = []
        for _ in range(2):
            ports: dict[str, int] = {}
            grpc_port = stack.enter_context(launched_process(SIM, ports=ports))[0]
            found.append((grpc_port, ports["http"]))
        yield found


@pytest.fixture(scope="module")
def gateway(replicas: list[tuple[int, int]]) -> Iterator[Gateway]:
    urls = [f"grpc://127.0.0.1:{grpc_port}" for grpc_port, _ in replicas]
    with smg_front(urls, "--policy", "round_robin") as front:
        yield front


def through(gateway: Gateway) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=30)


def direct(replicas: list[tuple[int, int]]) -> OpenAI:
    return openai_client(replicas[0][1])


def test_smg_registers_each_replica_as_a_vllm_worker_with_its_tokenizer(
    gateway: Gateway,
) -> None:
    workers = gateway.workers()
    assert len(workers) == 2
    for worker in workers:
        assert (worker["runtime_type"], worker["connection_mode"]) == ("vllm", "grpc")
        assert worker["labels"]["vocab_size"] == "49152"
        assert worker["labels"]["eos_token_ids"] == "[2]"
    assert "Fetching tokenizer from worker" in gateway.log()


def chat_text(client: OpenAI, stream: bool, **fields: Any) -> list[tuple[str, str | None]]:
    """Each choice's (text, finish reason), by index, streamed or whole."""
    ask = {"model": MODEL, "messages": CHAT, "max_tokens": 24, "temperature": 0, **fields}
    if not stream:
        reply = client.chat.completions.create(**ask)
        return [(c.message.content or "", c.finish_reason) for c in reply.choices]
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str | None] = {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            texts.setdefault(choice.index, []).append(choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    return [("".join(texts[i]), reasons[i]) for i in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"n": 2},
        {"stop": ["ea"]},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA},
            }
        },
    ],
    ids=["plain", "n2", "stop", "json_schema"],
)
def test_smg_chat_answers_as_loom_does(
    gateway: Gateway, replicas: list[tuple[int, int]], stream: bool, fields: dict[str, Any]
) -> None:
    with through(gateway) as client, direct(replicas) as loom:
        through_smg = chat_text(client, stream, **fields)
        own = chat_text(loom, stream, **fields)
    assert through_smg == own
    assert all(text for text, _ in own)


@pytest.mark.parametrize("stream", [False, True])
def test_smg_completions_answer_as_loom_does(
    gateway: Gateway, replicas: list[tuple[int, int]], stream: bool
) -> None:
    def complete(client: OpenAI) -> str:
        ask = {"model": MODEL, "prompt": "The sea is", "max_tokens": 16, "temperature": 0}
        if not stream:
            return client.completions.create(**ask).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(**ask, stream=True))

    with through(gateway) as client, direct(replicas) as loom:
        assert complete(client) == complete(loom) != ""


def test_smg_seeded_samples_repeat_and_differ_by_seed(gateway: Gateway) -> None:
    with through(gateway) as client:
        first, again, other = (
            chat_text(client, False, temperature=0.8, seed=seed, n=2) for seed in (7, 7, 8)
        )
    assert again == first
    assert other != first
    assert first[0] != first[1]  # choice i samples with seed + i


def test_smg_parses_a_tool_call_from_loom_output(gateway: Gateway) -> None:
    with through(gateway) as client:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "The weather in Paris?"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=32,
            temperature=0,
        )
    call = reply.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city":"Paris"}')


def num_running(replicas: list[tuple[int, int]]) -> int:
    return sum(run_client(server_stats, HOST, port).num_running for port, _ in replicas)


def until_idle(replicas: list[tuple[int, int]], seconds: float) -> float:
    """Seconds until no replica runs a request (at most `seconds`), polled every 10 ms."""
    start = time.monotonic()
    while num_running(replicas) and time.monotonic() - start < seconds:
        time.sleep(0.01)
    return time.monotonic() - start


def read_then_drop(gateway: Gateway, num_chunks: int) -> None:
    """A streamed chat of 4,000 tokens (8 s at 2 ms a step) given up after `num_chunks`: its
    connection closed, as a client that went away."""
    with through(gateway) as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4000, temperature=0, stream=True
        )
        for _, _chunk in zip(range(num_chunks), stream, strict=False):
            pass
        stream.close()


def test_smg_client_that_goes_away_aborts_its_request_in_loom(
    gateway: Gateway, replicas: list[tuple[int, int]]
) -> None:
    read_then_drop(gateway, 3)
    assert until_idle(replicas, 5) < 1.0


def test_smg_fifty_clients_that_go_away_leave_nothing_running(
    gateway: Gateway, replicas: list[tuple[int, int]]
) -> None:
    with ThreadPoolExecutor(10) as pool:
        list(pool.map(lambda i: read_then_drop(gateway, 1 + i % 4), range(50)))
    assert until_idle(replicas, 5) < 5
    for port, _ in replicas:
        stats = run_client(server_stats, HOST, port)
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.finished["aborted"] > 0


@pytest.fixture(scope="module")
def http_gateway(replicas: list[tuple[int, int]]) -> Iterator[Gateway]:
    """SMG in its HTTP mode: OpenAI's API passed through to each replica's HTTP port, its
    loads polled every second."""
    urls = [f"http://127.0.0.1:{http_port}" for _, http_port in replicas]
    with smg_front(urls, "--policy", "least_load", "--load-monitor-interval", "1") as front:
        yield front


@pytest.mark.parametrize("stream", [False, True])
def test_smg_http_mode_answers_as_loom_does(
    http_gateway: Gateway, replicas: list[tuple[int, int]], stream: bool
) -> None:
    with through(http_gateway) as client, direct(replicas) as loom:
        assert chat_text(client, stream) == chat_text(loom, stream)


def test_smg_http_mode_reads_loom_loads(http_gateway: Gateway) -> None:
    time.sleep(2.5)  # two polls at least
    for worker in http_gateway.workers():
        (load,) = worker["engine_load"]["loads"]
        assert load["max_running_requests"] == 64  # only Loom's /v1/loads says so
    log = http_gateway.log()
    assert " 404" not in log
    assert "status=404" not in log
