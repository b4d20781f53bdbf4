"""`loom health`, run as a process against a real server: the exit status a probe relies on."""

from __future__ import annotations

import sys

import pytest
import trio

from loom.core.sampling_params import SamplingParams
from loom.model.loader import LoadedModel
from tests.conftest import tiny_model
from tests.support.server_harness import loading, serving


@pytest.fixture
def tiny() -> LoadedModel:
    return tiny_model("llama")


async def loom_health(port: int, *extra: str) -> tuple[int, str]:
    command = [sys.executable, "-m", "loom", "health", "--address", f"127.0.0.1:{port}", *extra]
    result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    return result.returncode, (result.stdout + result.stderr).decode()


async def test_loom_health_exits_zero_when_serving(tiny: LoadedModel) -> None:
    async with serving(tiny) as (_, port):
        with trio.fail_after(60):
            assert await loom_health(port) == (0, f"127.0.0.1:{port}: SERVING\n")
            code, output = await loom_health(port, "--service", "loom.v1.Loom")
            assert (code, output.split()[-1]) == (0, "SERVING")


async def test_loom_health_fails_while_the_model_loads(tiny: LoadedModel) -> None:
    with trio.fail_after(60):
        async with loading(tiny) as (_, port, release):
            assert await loom_health(port) == (1, f"127.0.0.1:{port}: NOT_SERVING\n")
            release.set()
            while (await loom_health(port))[0] != 0:  # noqa: ASYNC110 (a probe, like docker's)
                await trio.sleep(0.1)


async def test_loom_health_fails_during_a_drain(tiny: LoadedModel) -> None:
    async with serving(tiny, output_buffer_size=2) as (server, port):
        with trio.fail_after(60):
            # An in-flight request whose consumer reads nothing keeps the drain going.
            stream = server.engine.submit([1, 2], SamplingParams(temperature=0, max_tokens=400))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.drain)
                await trio.sleep(0.2)
                # The port stops listening as the drain starts: the probe's connection is
                # refused (the connections already open hear NOT_SERVING).
                code, output = await loom_health(port, "--timeout", "2")
                assert code == 2
                assert "no answer" in output
                server.engine.abort(stream.request_id)


async def test_loom_health_fails_when_nothing_listens() -> None:
    with trio.fail_after(60):
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.close()  # a port that was free a moment ago, and nothing listens on it
        code, output = await loom_health(port, "--timeout", "2")
    assert code == 2
    assert "no answer" in output


async def test_loom_health_imports_neither_torch_nor_transformers() -> None:
    """Docker gives each probe 5 s: `loom health` makes its one call with grpclib alone, not
    after 3 s of importing the engine (loom/entry_point.py)."""
    command = [sys.executable, "-X", "importtime", "-m", "loom", "health", "--address",
               "127.0.0.1:1", "--timeout", "1"]  # fmt: skip
    with trio.fail_after(60):
        result = await trio.run_process(command, capture_stderr=True, check=False)
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.decode().splitlines()}
    assert result.returncode == 2
    assert "grpclib.client" in imported
    assert not {"torch", "transformers", "loom.cli"} & imported
