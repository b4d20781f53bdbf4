"""docker-compose.yml brought up for real: the CPU service, from the image the tests built, on
the ports it publishes (50051, 8000, 9464 on the host), healthy by its own healthcheck, then
stopped (draining, exit 0) and taken down with its volume.

Compose is Debian's `docker-compose` package here (1.29, the one packaged for bookworm), or the
`docker compose` plugin where one is installed.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.image import harness
from tests.image.conftest import FIGURES, unavailable
from tests.image.test_image import answer, serving

PROJECT = "loom-test-compose"


def compose_command() -> list[str] | None:
    plugin = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if plugin.returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.fixture
def compose(image: str) -> Iterator[list[str]]:
    command = compose_command()
    if command is None:
        unavailable("no compose implementation (Debian's docker-compose, or the plugin)")
    assert command is not None
    base = [*command, "--project-directory", str(harness.ROOT), "--project-name", PROJECT]
    base += ["--file", str(harness.ROOT / "docker-compose.yml")]
    try:
        yield base
    finally:
        subprocess.run([*base, "down", "--volumes"], capture_output=True, timeout=120)


def run(command: list[str], *args: str) -> str:
    result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_compose_brings_the_cpu_service_up_healthy_and_stops_it_draining(
    compose: list[str],
) -> None:
    started = time.monotonic()
    run(compose, "up", "--detach", "--no-build", "loom")
    (container,) = run(compose, "ps", "--quiet", "loom").split()
    harness.until(lambda: serving(50051), container, 120, "health SERVING")
    assert "Paris" in answer(50051)
    harness.until(
        lambda: harness.state(container, "Health.Status") == "healthy",
        container, 60, "the compose healthcheck healthy",
    )  # fmt: skip
    FIGURES["compose up -> healthy"] = f"{time.monotonic() - started:.1f} s"
    run(compose, "stop", "loom")
    assert harness.state(container, "ExitCode") == "0"
    assert "draining" in harness.logs(container)
