"""The two ways `loom bench` reaches a server (`--api grpc|openai|both`): one streamed request
on a connection of its own per concurrent client, the same workload either way.

- gRPC: a grpclib channel per client; each Delta's token ids, timed as they arrive.
- With `--constrained-fraction`, that share of the requests is constrained by a JSON schema
  (`records_schema`) that no output can complete before `--output-len` tokens.
- openai: an aiohttp session holding one connection per client; POST /v1/completions with
  the prompt's token ids, `stream`, `ignore_eos` and vLLM's `return_token_ids` (so that each
  chunk's tokens are counted, not guessed from its text), each SSE chunk timed as it arrives.
  With `--text-prompts` (a gateway that takes text alone: SMG), the prompt's text, and a token
  for each chunk, the few more that the usage counts (a gateway streams the tokens of a
  character split over tokens together) timed with the last.

`ProcessCpu` reads a launched server's CPU time from /proc: all of it, and its asyncio thread's
alone (the one at nice 19: both fronts' HTTP/2 and HTTP work), so that each front's cost per
token compares in one run.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import attrs
from grpclib.client import Channel

from loom.bench.metrics import RequestTiming
from loom.client.channel import Client
from loom.client.sse import DONE, SseReader
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub

FRONT_THREAD_NICE = 19  # loom/server/io_thread.py: LOWEST_PRIORITY


class Front(Protocol):
    @property
    def name(self) -> str: ...

    def open(self) -> Any: ...  # a client's connection
    async def close(self, connection: Any) -> None: ...
    async def request(
        self, connection: Any, prompt: tuple[int, ...], output_len: int, received: list[int] | None
    ) -> RequestTiming: ...


def request_for(
    prompt: tuple[int, ...], output_len: int, schema: str | None = None
) -> pb.GenerateRequest:
    """Greedy, exactly `output_len` tokens: past EOS (`ignore_eos`), or, constrained by
    `schema`, a grammar that cannot end sooner."""
    sampling = (
        pb.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        if schema is None
        else pb.SamplingParams(temperature=0, max_tokens=output_len, json_schema=schema)
    )
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


def records_schema(output_len: int) -> str:
    """The JSON schema of `--constrained-fraction`'s requests: an array of records, at least
    `output_len` of them (each takes several tokens, so none ends before `output_len`)."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "maxLength": 24},
            "kind": {"enum": ["person", "place", "thing"]},
            "score": {"type": "integer", "minimum": -100, "maximum": 100},
        },
        "required": ["id", "name", "kind"],
        "additionalProperties": False,
    }
    return json.dumps({"type": "array", "items": record, "minItems": output_len})


@attrs.frozen(kw_only=True)
class Constraining:
    """Which requests a front constrains: `fraction` of them, spread evenly in issue order."""

    fraction: float = 0.0
    issued: Iterator[int] = attrs.field(factory=itertools.count, eq=False)

    def schema_for(self, output_len: int) -> str | None:
        i = next(self.issued)
        chosen = int((i + 1) * self.fraction) > int(i * self.fraction)
        return records_schema(output_len) if chosen else None


async def one_request(
    channel: Channel,
    prompt: tuple[int, ...],
    output_len: int,
    received: list[int] | None = None,
    schema: str | None = None,
) -> RequestTiming:
    """One streamed request; its token ids go into `received`, if given."""
    start = time.perf_counter()
    times: list[float] = []
    try:
        async with LoomStub(channel).Generate.open() as stream:
            await stream.send_message(request_for(prompt, output_len, schema), end=True)
            async for response in stream:
                now = time.perf_counter() - start
                delta = response.delta if response.HasField("delta") else response.final.delta
                times.extend([now] * len(delta.token_ids))
                if received is not None:
                    received.extend(delta.token_ids)
    except Exception as exc:  # a failed request is counted, not fatal to the run
        return RequestTiming.failed(prompt, exc)
    return RequestTiming(ok=True, num_prompt_tokens=len(prompt), token_times=tuple(times))


@attrs.frozen(kw_only=True)
class GrpcFront:
    host: str
    port: int
    client: Client
    constraining: Constraining = attrs.field(factory=Constraining)
    name: str = "grpc"

    def open(self) -> Channel:
        return self.client.channel(self.host, self.port)

    async def close(self, connection: Channel) -> None:
        connection.close()

    async def request(
        self,
        connection: Channel,
        prompt: tuple[int, ...],
        output_len: int,
        received: list[int] | None,
    ) -> RequestTiming:
        schema = self.constraining.schema_for(output_len)
        return await one_request(connection, prompt, output_len, received, schema)


@attrs.frozen(kw_only=True)
class OpenAIFront:
    host: str
    port: int
    api_key: str | None = None
    constraining: Constraining = attrs.field(factory=Constraining)
    decode: Callable[[tuple[int, ...]], str] | None = None  # --text-prompts: the prompt's text
    model: str | None = None  # the served name (a gateway routes by it)
    name: str = "openai"

    def open(self) -> aiohttp.ClientSession:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        connector = aiohttp.TCPConnector(limit=1)  # one connection, as a channel is
        timeout = aiohttp.ClientTimeout(total=3600)
        return aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout)

    async def close(self, connection: aiohttp.ClientSession) -> None:
        await connection.close()

    def body(self, prompt: tuple[int, ...], output_len: int) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": output_len, "temperature": 0, "stream": True}
        if self.model is not None:
            body["model"] = self.model
        if self.decode is None:
            body.update(prompt=list(prompt), return_token_ids=True)
        else:
            body.update(prompt=self.decode(prompt), stream_options={"include_usage": True})
        schema = self.constraining.schema_for(output_len)
        if schema is None:
            body["ignore_eos"] = True
        else:
            body["structured_outputs"] = {"json": json.loads(schema)}
        return body

    async def request(
        self,
        connection: aiohttp.ClientSession,
        prompt: tuple[int, ...],
        output_len: int,
        received: list[int] | None,
    ) -> RequestTiming:
        url = f"http://{self.host}:{self.port}/v1/completions"
        start = time.perf_counter()
        times: list[float] = []
        usage: list[int] = []  # the tokens the last chunk's usage counts (--text-prompts)
        try:
            async with connection.post(url, json=self.body(prompt, output_len)) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
                events = SseReader()
                async for data in response.content.iter_any():
                    now = time.perf_counter() - start
                    for chunk in events.feed(data):
                        if chunk == DONE:
                            continue
                        if "error" in chunk:
                            raise RuntimeError(f"error event: {chunk['error']}")
                        self.take(chunk, now, times, received, usage)
            if self.decode is not None:  # the last chunk's time: the usage's
                times.extend([time.perf_counter() - start] * (count_of(usage) - len(times)))
        except Exception as exc:  # a failed request is counted, not fatal to the run
            return RequestTiming.failed(prompt, exc)
        return RequestTiming(ok=True, num_prompt_tokens=len(prompt), token_times=tuple(times))

    def take(
        self,
        chunk: Any,
        now: float,
        times: list[float],
        received: list[int] | None,
        usage: list[int],
    ) -> None:
        """Time a chunk's tokens: its token ids; with --text-prompts, a chunk that does not
        finish the choice is one token (the few a gateway streams together, a character split
        over tokens, are timed with the last: the usage counts them)."""
        if chunk.get("usage"):
            usage.append(chunk["usage"]["completion_tokens"])
        choices = chunk.get("choices") or []
        if self.decode is not None:
            if choices and choices[0].get("finish_reason") is None:
                times.append(now)
            return
        token_ids = choices[0]["token_ids"] if choices else []
        times.extend([now] * len(token_ids))
        if received is not None:
            received.extend(token_ids)


def count_of(usage: list[int]) -> int:
    """The completion tokens the last chunk's usage counts (--text-prompts)."""
    if len(usage) != 1:
        raise RuntimeError(f"no usage in the stream's last chunk: {usage}")
    return usage[0]


@attrs.frozen(kw_only=True)
class ProcessCpu:
    """CPU seconds of a process (user + system), all threads and its front thread's."""

    pid: int

    def sample(self) -> tuple[float, float]:
        total = front = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # a thread that ended meanwhile
                continue
            seconds = (int(fields[11]) + int(fields[12])) / tick
            total += seconds
            if int(fields[16]) == FRONT_THREAD_NICE:
                front += seconds
        return total, front
