"""Loom's image, built from the working tree and run as a deployer runs it (docker run, docker
stop), with the figures printed at the end of the run: build time, size, the seconds from
`docker run` to health SERVING and to the first answer, the drain's exit code."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request

from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError

from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub
from tests.image import harness
from tests.image.conftest import FIGURES
from tests.support.grpc_client import HOST, SERVING, generate, greedy, health, run_client, token_ids
from tests.support.http_client import openai_client

QUESTION = "What is the capital of France?"
# The image's target is 1.3 GB on python:3.11-slim-bookworm (about 0.15 GB); the stand-in bases
# made here measure 0.16 to 0.24 GB by machine. So what Loom adds to its base is held to the
# target less the largest base it is built on: a figure no build host moves.
IMAGE_TARGET, BASE_ALLOWANCE = 1.3e9, 0.3e9  # bytes


def serving(port: int) -> bool:
    """Whether health is SERVING; docker's proxy takes connections before Loom listens, and
    closes them."""
    try:
        return run_client(health, port) == SERVING
    except (TimeoutError, OSError, StreamTerminatedError):
        return False


def answer(port: int) -> str:
    """The default model's greedy answer to QUESTION, over gRPC."""
    request = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=QUESTION)]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=16),
    )
    responses = run_client(generate, port, request, 60)
    return "".join(r.delta.text if r.HasField("delta") else r.final.delta.text for r in responses)


def test_image_is_small_has_no_compiler_and_bakes_both_kernel_libraries(image: str) -> None:
    added = harness.size_bytes(image) - harness.size_bytes(harness.BASE)
    FIGURES["added to the base"] = (
        f"{added / 1e6:.0f} MB (at most {(IMAGE_TARGET - BASE_ALLOWANCE) / 1e6:.0f} MB)"
    )
    assert added <= IMAGE_TARGET - BASE_ALLOWANCE
    script = "command -v cc c++ gcc g++ clang; find /var/cache/loom/torch_extensions -type f"
    found = harness.docker("run", "--rm", "--entrypoint", "sh", image, "-c", script, check=False)
    files = found.split()
    assert all(f.startswith("/var/cache/loom/torch_extensions/") for f in files), files
    assert sorted(f.rsplit("/", 1)[1] for f in files) == [
        "loom_kernels_avx2.so",
        "loom_kernels_vnni.so",
    ]
    assert all(f.endswith(".so") for f in files)  # no object files, no build files


def test_image_serves_with_its_defaults_as_non_root_and_turns_healthy(image: str) -> None:
    started = time.monotonic()
    with harness.container(image) as container:
        port = harness.host_port(container, 50051)
        harness.until(lambda: serving(port), container, 120, "health SERVING")
        to_serving = time.monotonic() - started
        assert "Paris" in answer(port)
        FIGURES["docker run -> health SERVING"] = f"{to_serving:.1f} s"
        FIGURES["docker run -> first answer"] = f"{time.monotonic() - started:.1f} s"
        log = harness.logs(container)
        assert "loading converted model" in log
        assert "converting" not in log
        # The baked library, loaded as it is: a rebuild would leave object files beside it.
        (library,) = harness.mapped_kernels(container)
        assert library.startswith(harness.EXTENSIONS + "/")
        assert all(f.endswith(".so") for f in harness.cache_files(container))
        assert harness.docker("exec", container, "id", "-u").strip() == "10001"

        completion = openai_client(harness.host_port(container, 8000)).chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=16,
        )
        assert "Paris" in (completion.choices[0].message.content or "")
        metrics_url = f"http://{HOST}:{harness.host_port(container, 9464)}/metrics"
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            scraped = response.read().decode()
        served = re.search(r"^loom:time_to_first_token_seconds_count\{.*\} (\S+)$", scraped, re.M)
        assert served is not None
        assert float(served.group(1)) == 2

        # The HEALTHCHECK probes every 10 s: healthy after its first probe of a serving server.
        harness.until(
            lambda: harness.state(container, "Health.Status") == "healthy",
            container, 60, "HEALTHCHECK healthy",
        )  # fmt: skip
        FIGURES["docker run -> HEALTHCHECK healthy"] = f"{time.monotonic() - started:.1f} s"


STREAMS, STREAM_TOKENS = 3, 200


async def streams_through_a_stop(port: int, stop: threading.Thread) -> list[list[int]]:
    """STREAMS greedy streams; `stop` starts once each has its first tokens: their tokens."""
    first = [asyncio.Event() for _ in range(STREAMS)]

    async def stream(index: int) -> list[int]:
        responses = []
        async with (
            Channel(HOST, port) as channel,
            LoomStub(channel).Generate.open(timeout=120) as call,
        ):
            await call.send_message(greedy([1, 2, 3 + index], STREAM_TOKENS), end=True)
            async for response in call:
                responses.append(response)
                first[index].set()
        assert responses[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
        return token_ids(responses)

    async def stop_when_all_stream() -> None:
        await asyncio.gather(*(event.wait() for event in first))
        stop.start()

    results = await asyncio.gather(*(stream(i) for i in range(STREAMS)), stop_when_all_stream())
    return list(results[:STREAMS])


def test_image_under_any_uid_with_a_read_only_root_drains_streams_on_docker_stop(
    image: str, volume: str
) -> None:
    """An arbitrary UID (docker --user, OpenShift), nothing writable but the cache volume, and
    the AVX2 kernels (what a host without AVX-512 loads): `docker stop` lets the in-flight
    streams finish, and Loom exits 0."""
    args = ("--user", "12345", "--read-only", f"--volume={volume}:/var/cache/loom")
    with harness.container(image, *args, "--env", "LOOM_KERNELS=avx2") as container:
        port = harness.host_port(container, 50051)
        harness.until(lambda: serving(port), container, 120, "health SERVING")
        assert harness.docker("exec", container, "id", "-u").strip() == "12345"
        (library,) = harness.mapped_kernels(container)
        assert library.endswith("/loom_kernels_avx2.so")
        assert all(f.endswith(".so") for f in harness.cache_files(container))

        stopped: list[float] = []

        def docker_stop() -> None:
            began = time.monotonic()
            harness.docker("stop", "--time", "60", container, timeout=90)
            stopped.append(time.monotonic() - began)

        stop = threading.Thread(target=docker_stop)
        tokens = run_client(streams_through_a_stop, port, stop)
        stop.join()
        assert [len(t) for t in tokens] == [STREAM_TOKENS] * STREAMS
        exit_code = harness.state(container, "ExitCode")
        FIGURES["docker stop with 3 streams in flight"] = (
            f"drained in {stopped[0]:.1f} s, exit code {exit_code}"
        )
        assert exit_code == "0", harness.logs(container)[-4000:]
        assert "draining" in harness.logs(container)
