"""OpenAI's HTTP API on the engine (loom/server/openai/): the official `openai` client, raw HTTP
for what it hides (the SSE framing byte for byte, error bodies), the greedy oracle through
HTTP, and the same guarantees as the gRPC stream: a client gone aborts at once, a stopped
reader is paused and then ends at the stall timeout, a drain finishes what runs.

Rules: loopback only, port 0, a timeout on every I/O test; real server, real clients (the
openai client in worker threads: the server runs in trio in this process).
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from loom.client.sse import events
from loom.core.config import SchedulerConfig
from loom.model.loader import LoadedModel
from loom.model.sim import SimRunner, load_sim
from loom.server.boundary import BoundaryConfig
from loom.server.openai.config import HttpConfig
from loom.server.tenants import TenantConfig
from loom.server.traffic import DrainPhase
from tests.server.test_disconnects import kill_rounds
from tests.server.test_tenants import abort
from tests.support.greedy import reference_tokens
from tests.support.grpc_client import in_asyncio
from tests.support.http_client import HOST, openai_client, post
from tests.support.server_harness import closed_mid_answer, idle, serving, until, waited

HTTP = HttpConfig(http_port=0)
CHAT = [{"role": "user", "content": "Name three colours."}]


async def test_http_the_openai_client_streams_and_gets_whole_chats_and_completions(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat, http=HTTP) as (server, _):
        client = openai_client(server.http_port or 0)

        def talk() -> dict[str, Any]:
            whole = client.chat.completions.create(
                model="tiny-llama", messages=CHAT, max_tokens=12, temperature=0
            )
            stream = client.chat.completions.create(
                model="tiny-llama",
                messages=CHAT,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            completion = client.completions.create(
                model="tiny-llama", prompt="Once upon", max_tokens=7, temperature=0
            )
            streamed = "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model="tiny-llama",
                    prompt="Once upon",
                    max_tokens=7,
                    temperature=0,
                    stream=True,
                )
            )
            return {
                "whole": whole,
                "chunks": chunks,
                "completion": completion,
                "streamed": streamed,
            }

        with trio.fail_after(120):
            got = await trio.to_thread.run_sync(talk)
    whole, chunks = got["whole"], got["chunks"]
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1
    assert got["completion"].choices[0].text == got["streamed"]
    assert got["completion"].usage.completion_tokens == 7


async def test_http_n_choices_share_one_prompt_and_a_seed_makes_each_reproducible(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat, http=HTTP) as (server, _):
        client = openai_client(server.http_port or 0)

        def sample(seed: int) -> Any:
            return client.chat.completions.create(
                model="tiny-llama",
                messages=CHAT,
                max_tokens=16,
                n=3,
                seed=seed,
                temperature=1.0,
                logprobs=True,
                top_logprobs=2,
            )

        with trio.fail_after(120):
            first, again, other = [await trio.to_thread.run_sync(sample, s) for s in (7, 7, 8)]
            single = await trio.to_thread.run_sync(
                lambda: client.chat.completions.create(
                    model="tiny-llama", messages=CHAT, max_tokens=1
                )
            )
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]  # the seed reproduces each
    assert texts != [c.message.content for c in other.choices]
    assert len(set(texts)) == 3  # seed + i: three different sequences
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert first.usage.completion_tokens == 48
    for choice in first.choices:
        assert len(choice.logprobs.content) == 16
        assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in choice.logprobs.content)


async def test_http_greedy_tokens_are_transformers_generate_s(tiny: LoadedModel) -> None:
    prompts = [[5, 9, 2, 77, 31], [400, 3], [8] * 40]
    async with serving(tiny, http=HTTP, scheduler=SchedulerConfig(max_num_batched_tokens=16)) as (
        server,
        _,
    ):
        body = {
            "prompt": prompts,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        with trio.fail_after(120):
            status, _, raw = await post(server.http_port or 0, "/v1/completions", body)
    assert status == 200, raw
    choices = json.loads(raw)["choices"]
    for prompt, choice in zip(prompts, choices, strict=True):
        tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        assert tokens == reference_tokens(tiny.model, prompt, 12)


async def test_http_sse_framing_is_openai_s_byte_for_byte(tiny_chat: LoadedModel) -> None:
    body = {
        "model": "tiny-llama",
        "messages": CHAT,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with serving(tiny_chat, http=HTTP) as (server, _):
        with trio.fail_after(60):
            status, headers, raw = await post(
                server.http_port or 0, "/v1/chat/completions", body, {"X-Request-Id": "job-7"}
            )
    assert status == 200
    assert headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert headers["X-Request-Id"] == "job-7"
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    parsed = events(raw)
    assert parsed[-1] == "[DONE]"
    *chunks, usage = parsed[:-1]
    assert {c["id"] for c in parsed[:-1]} == {"chatcmpl-job-7"}
    assert all(c["object"] == "chat.completion.chunk" for c in parsed[:-1])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks)
    # A chunk a token, or fewer when the server was behind on its sends and packed what had
    # piled up into one (CI once saw 3 chunks for the 5 tokens): only the last one finishes.
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes == [None] * (len(chunks) - 1) + ["length"]
    assert 2 <= len(chunks) <= 6
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    assert raw.count(b"data: ") == len(parsed)  # nothing but data events


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": CHAT, "temperature": "hot"}, "temperature"),
        ({"messages": CHAT, "temperature": 1e9}, "temperature"),
        ({"messages": CHAT, "top_p": 0}, "top_p"),
        ({"messages": CHAT, "n": 17}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": CHAT, "stop": [1, 2]}, "stop"),
        ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"messages": CHAT, "max_tokens": 100_000}, "prompt"),  # prompt + max_tokens > context
        ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"messages": CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
        ),
        ({"messages": CHAT, "structured_outputs": {"choice": [1]}}, "structured_outputs"),
        (
            {
                "messages": CHAT,
                "response_format": {"type": "json_object"},
                "structured_outputs": {"regex": "a"},
            },
            "structured_outputs",
        ),
        ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "logprobs"),
    ],
)
async def test_http_a_bad_value_is_a_400_naming_the_field(
    tiny_chat: LoadedModel, body: dict[str, Any], param: str | None
) -> None:
    async with serving(tiny_chat, http=HTTP) as (server, _):
        with trio.fail_after(60):
            status, headers, raw = await post(server.http_port or 0, "/v1/chat/completions", body)
    error = json.loads(raw)["error"]
    assert status == 400, raw
    assert headers["Content-Type"].startswith("application/json")
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}


async def test_http_routes_models_sizes_and_keys_are_refused_with_their_statuses(
    tiny_chat: LoadedModel, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("key-of-a a\n")
    tenants = TenantConfig(api_key_file=str(keys))
    auth = {"Authorization": "Bearer key-of-a"}
    async with serving(tiny_chat, http=HTTP, tenants=tenants) as (server, _):
        port = server.http_port or 0
        with trio.fail_after(60):
            no_key = await post(port, "/v1/chat/completions", {"messages": CHAT})
            bad_key = await post(port, "/v1/models", None, {"Authorization": "Bearer x"}, "GET")
            no_route = await post(port, "/v1/nothing", {}, auth)
            wrong_method = await post(port, "/v1/completions", None, auth, "GET")
            no_model = await post(port, "/v1/completions", {"model": "gpt-9", "prompt": "x"}, auth)
            too_big = await post(port, "/v1/completions", b"x" * (4 << 20 | 1), auth)
            not_json = await post(port, "/v1/completions", b"{", auth)
            suffix = await post(port, "/v1/completions", {"prompt": "x", "suffix": "y"}, auth)
            models = await post(port, "/v1/models", None, auth, "GET")
            health = await post(port, "/health", None, {}, "GET")
    assert [r[0] for r in (no_key, bad_key, no_route, wrong_method, no_model)] == [
        401,
        401,
        404,
        405,
        404,
    ]
    assert json.loads(no_key[2])["error"]["type"] == "authentication_error"
    assert json.loads(no_model[2])["error"]["code"] == "model_not_found"
    assert too_big[0] == 413
    assert b"max_request_bytes=4194304" in too_big[2]
    assert not_json[0] == 400
    assert suffix[0] == 400
    assert json.loads(suffix[2])["error"]["param"] == "suffix"
    assert json.loads(models[2])["data"][0]["id"] == "tiny-llama"
    assert health[0] == 200  # open to probes without a key


async def test_http_a_full_queue_is_429_with_retry_after_and_a_deadline_408() -> None:
    sim = load_sim("sim:step_ms=20,seq_ms=0,token_ms=0")
    long = {"prompt": [3, 4, 5], "max_tokens": 300, "ignore_eos": True}
    async with serving(
        sim,
        make_runner=SimRunner,
        http=HTTP,
        scheduler=SchedulerConfig(max_num_seqs=1),
        max_waiting_requests=1,
    ) as (server, _):
        port = server.http_port or 0
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, port, "/v1/completions", long)  # runs
                await waited(server.engine, lambda: server.engine.stats().num_running == 1)
                nursery.start_soon(post, port, "/v1/completions", long)  # waits
                await waited(server.engine, lambda: server.engine.stats().num_waiting == 1)
                full = await post(port, "/v1/completions", long)
                late = await post(port, "/v1/completions", long, {"X-Request-Timeout": "x"})
                nursery.cancel_scope.cancel()
            await waited(server.engine, lambda: idle(server.engine))
            timed = await post(
                port, "/v1/completions", {**long, "max_tokens": 1000}, {"X-Request-Timeout": "0.3"}
            )
    assert full[0] == 429
    assert full[1]["Retry-After"] == "1"
    assert json.loads(full[2])["error"]["type"] == "rate_limit_error"
    assert late[0] == 400
    assert json.loads(late[2])["error"]["param"] == "X-Request-Timeout"
    assert timed[0] == 408, timed
    assert json.loads(timed[2])["error"]["code"] == "deadline"


async def test_http_a_closed_connection_aborts_its_request_at_once() -> None:
    sim = load_sim("sim:step_ms=10,seq_ms=0,token_ms=0")
    async with serving(sim, make_runner=SimRunner, http=HTTP) as (server, _):
        with trio.fail_after(60):
            for stream in (True, False):
                body = {
                    "prompt": [3, 4, 5],
                    "max_tokens": 5000,
                    "ignore_eos": True,
                    "stream": stream,
                }
                seconds = await closed_mid_answer(server, "/v1/completions", body)
                assert seconds < 0.5, (stream, seconds)
            assert "length" not in server.engine.stats().finished


async def test_http_a_stopped_reader_is_paused_then_ended_at_the_stall_timeout() -> None:
    sim = load_sim("sim:step_ms=1,seq_ms=0,token_ms=0")
    body = json.dumps(
        {
            "prompt": [3, 4, 5],
            "max_tokens": 8000,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 20,
        }
    ).encode()
    async with serving(sim, make_runner=SimRunner, http=HTTP, stall_timeout=1.0) as (server, _):
        port = server.http_port or 0
        with trio.fail_after(60):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((HOST, port))
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d"
                b"\r\n\r\n%s" % (len(body), body)
            )
            paused = await waited(server.engine, lambda: server.engine.stats().num_paused == 1)
            assert server.engine.stats().num_paused == 1, paused
            ended = await waited(server.engine, lambda: idle(server.engine))
            sock.close()
            finished = server.engine.stats().finished
    assert finished.get("stalled") == 1, finished
    assert ended <= 3.0


async def test_http_killed_client_processes_leave_nothing_running_2_s_after_the_last_kill() -> None:
    sim = load_sim("sim:step_ms=10,seq_ms=0,token_ms=0")
    async with serving(sim, make_runner=SimRunner, http=HTTP, stall_timeout=60.0) as (server, port):
        with trio.fail_after(120):
            kill = partial(kill_rounds, kinds=("http",), http_port=server.http_port, rounds=4)
            last_kill = await trio.to_thread.run_sync(kill, port, random.Random(22))
            await waited(server.engine, lambda: idle(server.engine))
            seconds = time.monotonic() - last_kill
            stats = server.engine.stats()
    print(f"100 HTTP clients killed; idle {seconds:.2f} s after the last kill; {stats.finished}")
    assert seconds <= 2.0, (seconds, stats)
    assert "length" not in stats.finished
    assert stats.finished.get("aborted", 0) >= 50  # most reached the engine


def keep_alive_request(connection: http.client.HTTPConnection, body: bytes) -> None:
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    response.read()
    assert not response.will_close


async def test_http_a_drain_finishes_streams_in_flight_and_refuses_new_requests() -> None:
    sim = load_sim("sim:step_ms=5,seq_ms=0,token_ms=0")
    body = {"prompt": [3, 4, 5], "max_tokens": 200, "ignore_eos": True, "stream": True}
    quick = json.dumps({"prompt": [3], "max_tokens": 1}).encode()
    async with serving(sim, make_runner=SimRunner, http=HTTP) as (server, _):
        port = server.http_port or 0
        with trio.fail_after(60):
            kept = http.client.HTTPConnection(HOST, port, timeout=30)  # kept alive, then idle
            await trio.to_thread.run_sync(keep_alive_request, kept, quick)
            async with trio.open_nursery() as nursery:
                results: list[Any] = []

                async def stream() -> None:
                    results.append(await post(port, "/v1/completions", body))

                nursery.start_soon(stream)
                await waited(server.engine, lambda: server.engine.stats().num_running == 1)
                nursery.start_soon(server.drain)
                drain = server.drainer
                await until(lambda: drain is not None and drain.phase is DrainPhase.REFUSING, 10)
                with pytest.raises(ConnectionRefusedError):  # the port has closed
                    await post(port, "/v1/completions", body)
                assert kept.sock is not None
                closed = await trio.to_thread.run_sync(kept.sock.recv, 1)
                assert closed == b""  # closed by the drain
                kept.close()
    status, _, raw = results[0]
    assert status == 200
    assert events(raw)[-1] == "[DONE]"
    last = json.loads(raw.split(b"\n\n")[-3].removeprefix(b"data: "))
    assert last["choices"][0]["finish_reason"] == "length"


async def test_http_a_grpc_abort_by_label_ends_the_http_request_of_its_tenant() -> None:
    sim = load_sim("sim:step_ms=10,seq_ms=0,token_ms=0")
    body = {"prompt": [3, 4, 5], "max_tokens": 5000, "ignore_eos": True}
    async with serving(sim, make_runner=SimRunner, http=HTTP) as (server, port):
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                results: list[Any] = []

                async def whole() -> None:
                    results.append(
                        await post(
                            server.http_port or 0,
                            "/v1/completions",
                            body,
                            {"X-Request-Id": "job-1"},
                        )
                    )

                nursery.start_soon(whole)
                await waited(server.engine, lambda: server.engine.stats().num_running == 1)
                num_aborted = await in_asyncio(abort, port, ["job-1"])
    assert num_aborted == 1
    status, _, raw = results[0]
    assert status == 499
    assert json.loads(raw)["error"]["code"] == "aborted"


async def test_http_the_openai_client_in_a_load_loop_gets_every_answer_whole(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat, http=HTTP) as (server, _):
        client = openai_client(server.http_port or 0)

        def one(i: int) -> tuple[int, str]:
            stream = client.chat.completions.create(
                model="tiny-llama",
                messages=[{"role": "user", "content": f"Count to {i}."}],
                max_tokens=20,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return chunks[-1].usage.completion_tokens, text

        def load() -> list[tuple[int, str]]:
            with ThreadPoolExecutor(8) as pool:
                return list(pool.map(one, range(32)))

        with trio.fail_after(180):
            answers = await trio.to_thread.run_sync(load)
            alone = await trio.to_thread.run_sync(one, 5)
            assert idle(server.engine)
    assert [n for n, _ in answers] == [20] * 32
    assert answers[5] == alone  # batched with 7 others, the same greedy text


async def test_http_echo_with_logprobs_gives_the_prompt_s_own_logprobs_as_transformers(
    tiny: LoadedModel,
) -> None:
    prompt = [(7 * i + 3) % 500 for i in range(40)]  # in three chunks of 16
    body = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
        "logprobs": 3,
        "return_tokens_as_token_ids": True,
    }
    async with serving(tiny, http=HTTP, scheduler=SchedulerConfig(max_num_batched_tokens=16)) as (
        server,
        _,
    ):
        with trio.fail_after(120):
            first = await post(server.http_port or 0, "/v1/completions", body)
            again = await post(server.http_port or 0, "/v1/completions", body)  # cached prefix
            streamed = await post(
                server.http_port or 0, "/v1/completions", {**body, "stream": True}
            )
    with torch.inference_mode():
        logits = tiny.model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    for status, _, raw in (first, again):
        assert status == 200, raw
        logprobs = json.loads(raw)["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
        assert tokens[:40] == prompt
        assert logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None
        got = torch.tensor(logprobs["token_logprobs"][1:40])
        want = expected[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for position, top in enumerate(logprobs["top_logprobs"][1:40]):
            _values, ids = expected[position].topk(3)
            assert [int(t.removeprefix("token_id:")) for t in top] == ids.tolist()
    streamed_logprobs = events(streamed[2])[0]["choices"][0]["logprobs"]
    assert (
        streamed_logprobs["token_logprobs"][1:40]
        == json.loads(first[2])["choices"][0]["logprobs"]["token_logprobs"][1:40]
    )


async def test_http_a_head_that_never_ends_and_connections_over_the_cap_are_closed(
    tiny_chat: LoadedModel,
) -> None:
    boundary = BoundaryConfig(header_timeout=0.5, max_connections_per_peer=3)
    async with serving(tiny_chat, http=HTTP, boundary=boundary) as (server, _):
        port = server.http_port or 0
        with trio.fail_after(30):
            slow = socket.create_connection((HOST, port))
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")  # and no more
            start = time.monotonic()
            assert await trio.to_thread.run_sync(slow.recv, 1) == b""  # closed by the server
            took = time.monotonic() - start
            held = [socket.create_connection((HOST, port)) for _ in range(3)]
            over = socket.create_connection((HOST, port))  # the fourth from this address
            reply = await trio.to_thread.run_sync(over.recv, 4096)
            for sock in (slow, over, *held):
                sock.close()
    assert 0.3 <= took <= 5, took
    assert reply.startswith(b"HTTP/1.1 503")
    assert b"max_connections_per_peer=3" in reply


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "hi", "temperature": 1' + b"1" * 400 + b"}", "temperature"),
        (b"[" * 50_000 + b"]" * 50_000, None),
        (b'{"prompt": "\\ud800abc"}', None),  # a lone surrogate
        (b'{"prompt": "hi", "n": 0}', "n"),
        (b"", None),
        (b"null", None),
    ],
)
async def test_http_hostile_bodies_are_400s_not_500s(
    tiny_chat: LoadedModel, body: bytes, param: str | None
) -> None:
    async with serving(tiny_chat, http=HTTP) as (server, _):
        with trio.fail_after(60):
            status, _, raw = await post(server.http_port or 0, "/v1/completions", body)
            tokenize = await post(server.http_port or 0, "/tokenize", body)
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"] == param
    if param is None:  # (tokenize reads no sampling field)
        assert tokenize[0] == 400, tokenize


async def test_http_refused_headers_leave_the_drain_counts_at_zero(
    tiny_chat: LoadedModel, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("key-of-a a\n")
    tenants = TenantConfig(api_key_file=str(keys))
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    async with serving(tiny_chat, http=HTTP, tenants=tenants) as (server, _):
        port = server.http_port or 0
        with trio.fail_after(60):
            long_id = await post(port, "/v1/completions", body, {"X-Request-Id": "a" * 200})
            replies = []
            for header in (b"X-Request-Id: ab\xffcd", b"Authorization: Bearer key-of-a\xff"):
                sock = socket.create_connection((HOST, port))
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n%s\r\n"
                    b"Authorization: Bearer key-of-a\r\nContent-Length: %d\r\n\r\n%s"
                    % (header, len(body), body)
                    if b"Request" in header
                    else b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n%s\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (header, len(body), body)
                )
                replies.append(await trio.to_thread.run_sync(sock.recv, 4096))
                sock.close()
            assert server.io is not None
            counts = server.io.traffic
            with trio.fail_after(5):  # the I/O thread's counts, on their own events
                await server.io.until_zero(counts.in_flight)
                await server.io.until_zero(counts.arriving)
            in_flight = (counts.in_flight.value, counts.arriving.value)
    assert long_id[0] == 400
    assert replies[0].startswith(b"HTTP/1.1 400"), replies[0]
    assert replies[1].startswith(b"HTTP/1.1 401"), replies[1]
    assert in_flight == (0, 0)  # else every later drain waits out its timeout


async def test_http_a_whole_response_holds_at_most_so_many_logprobs(tiny_chat: LoadedModel) -> None:
    too_many = {"prompt": [3, 4], "max_tokens": 8000, "n": 16, "logprobs": 20}
    async with serving(tiny_chat, http=HTTP) as (server, _):
        with trio.fail_after(60):
            status, _, raw = await post(server.http_port or 0, "/v1/completions", too_many)
            streamed = await post(
                server.http_port or 0,
                "/v1/completions",
                {"prompt": [3, 4], "max_tokens": 6, "logprobs": 1, "stream": True},
            )
            chat = await post(
                server.http_port or 0,
                "/v1/chat/completions",
                {"messages": CHAT, "max_tokens": 3, "logprobs": True, "stream": True},
            )
    assert status == 400
    assert json.loads(raw)["error"]["param"] == "logprobs"
    # Streamed, each chunk's text_offset goes on from the last's.
    chunks = [e["choices"][0]["logprobs"] for e in events(streamed[2]) if e != "[DONE]"]
    offsets = [o for lp in chunks for o in lp["text_offset"]]
    lengths = [len(t) for lp in chunks for t in lp["tokens"]]
    assert offsets == [sum(lengths[:i]) for i in range(len(lengths))]
    role, *content = [e for e in events(chat[2]) if e != "[DONE]"]
    assert role["choices"][0]["logprobs"] is None  # as OpenAI's role chunk
    for chunk in content:
        for item in chunk["choices"][0]["logprobs"]["content"]:
            assert isinstance(item["bytes"], list)


async def test_http_n_choices_refused_in_part_end_every_choice_and_free_its_blocks() -> None:
    sim = load_sim("sim:step_ms=10,seq_ms=0,token_ms=0")
    body = {"prompt": [3, 4, 5], "max_tokens": 2000, "ignore_eos": True, "n": 8}
    async with serving(
        sim,
        make_runner=SimRunner,
        http=HTTP,
        scheduler=SchedulerConfig(max_num_seqs=1),
        max_waiting_requests=2,
    ) as (server, _):
        with trio.fail_after(60):
            status, headers, raw = await post(server.http_port or 0, "/v1/completions", body)
            seconds = await waited(server.engine, lambda: idle(server.engine))
            finished = server.engine.stats().finished
    assert status == 429, raw  # 8 choices for 1 slot and 2 places: some refused at once
    assert headers["Retry-After"] == "1"
    assert seconds < 0.5  # the choices already queued or running were aborted with the rest
    assert "length" not in finished


def raw_post(port: int, content_type: bytes | None, body: bytes) -> bytes:
    """A POST as a web page's script sends it to another origin (no preflight: a "simple"
    request), with `content_type` or none: the reply's status line and body."""
    typed = b"Content-Type: %s\r\n" % content_type if content_type is not None else b""
    with socket.create_connection((HOST, port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: https://evil.example\r\n"
            b"%sContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (typed, len(body), body)
        )
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


async def test_http_a_body_that_does_not_say_it_is_json_is_refused_unread(
    tiny_chat: LoadedModel,
) -> None:
    """A web page can have its visitor's browser POST text/plain, a form, or a body of no
    type to any origin without a preflight: a Loom on the visitor's machine ran the JSON in
    it (200). Each is refused with 415 naming what it must be, and the engine runs nothing;
    JSON with a charset is served."""
    body = json.dumps({"prompt": [3, 4], "max_tokens": 2, "temperature": 0}).encode()
    async with serving(tiny_chat, http=HTTP) as (server, _):
        port = server.http_port or 0
        with trio.fail_after(60):
            for content_type in (b"text/plain;charset=UTF-8", b"application/x-www-form-urlencoded",
                                 b"multipart/form-data; boundary=x", None):  # fmt: skip
                reply = await trio.to_thread.run_sync(raw_post, port, content_type, body)
                assert reply.startswith(b"HTTP/1.1 415"), (content_type, reply[:200])
                error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
                assert "it must be application/json" in error["message"]
                assert error["code"] == "unsupported_media_type"
            assert server.engine.core.scheduler.num_generated_tokens == 0  # type: ignore[union-attr]
            typed = b"application/json; charset=utf-8"
            reply = await trio.to_thread.run_sync(raw_post, port, typed, body)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
