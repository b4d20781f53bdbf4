"""The image, built once for these tests, and the figures they print at the end of the run.

They need a docker engine (and, where `python:3.11-slim-bookworm` is not there, debootstrap to
make its stand-in): without one they are skipped, saying why, unless LOOM_REQUIRE_DOCKER is set
(CI sets it: `.ci/run` installs and starts the engine), when they fail instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.image import harness

TAG = "loom:cpu"
FIGURES: dict[str, str] = {}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("the image, as built and run")
        for name, value in FIGURES.items():
            terminalreporter.write_line(f"{name}: {value}")


def unavailable(reason: str) -> None:
    if os.environ.get("LOOM_REQUIRE_DOCKER"):
        pytest.fail(f"LOOM_REQUIRE_DOCKER is set, but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def image() -> str:
    """The project's image, built from the working tree as TAG: the tag."""
    if (reason := harness.engine_error()) is not None:
        unavailable(reason)
    if not harness.has_image(harness.BASE):
        if shutil.which("debootstrap") is None:
            unavailable(f"no {harness.BASE}, and no debootstrap to make its stand-in")
        harness.make_stand_in_base()
        FIGURES["base"] = f"a stand-in {harness.BASE} made with debootstrap"
    FIGURES["base size"] = f"{harness.size_bytes(harness.BASE) / 1e6:.0f} MB"
    with harness.torch_index() as url:
        FIGURES["build"] = f"{harness.build(TAG, url):.0f} s"
    FIGURES["image size"] = f"{harness.size_bytes(TAG) / 1e9:.2f} GB"
    return TAG


@pytest.fixture
def volume(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh named volume: docker fills it from the image's /var/cache/loom on first use."""
    name = f"loom-test-{request.node.name[-40:].strip('_')}"
    harness.docker("volume", "rm", "-f", name)
    yield name
    harness.docker("volume", "rm", "-f", name, check=False)
