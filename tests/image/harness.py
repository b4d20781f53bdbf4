"""What building Loom's image needs on these machines, none of it in the image or the project.

No registry of images is reachable here, so `python:3.11-slim-bookworm` is made as a stand-in:
the same Debian, bootstrapped (`debootstrap --variant=minbase`) and imported under that tag.
pip inside the build reaches PyPI only with the machine's CA bundle, which the stand-in carries;
torch's CPU wheel, which pip here takes from local disk, is served to the build from a local
PEP 503 index (torch and its dependencies, over `http.server`), passed as `TORCH_INDEX_URL`.
"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
BASE = "python:3.11-slim-bookworm"
TORCH = "torch==2.13.0"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
PATH = "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"
# minbase has no `passwd` (useradd, for the image's user); python3-venv makes /opt/loom.
PACKAGES = "python3,python3-venv,ca-certificates,passwd"
EXTENSIONS = "/var/cache/loom/torch_extensions"
PORTS = (50051, 8000, 9464)  # gRPC, OpenAI's HTTP API, /metrics


def docker(*args: str, timeout: float = 600, check: bool = True) -> str:
    """`docker ARGS`: its stdout, and its stderr in the failure when it fails."""
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {result.returncode}\n{result.stderr}")
    return result.stdout


def engine_error() -> str | None:
    """Why no docker engine answers here, or None when one does."""
    if shutil.which("docker") is None:
        return "no docker client"
    result = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    return None if result.returncode == 0 else f"no docker engine: {result.stderr.strip()[-300:]}"


def has_image(tag: str) -> bool:
    return not docker("image", "inspect", tag, check=False).startswith("[]")


def make_stand_in_base(tag: str = BASE) -> None:
    """Bootstrap Debian bookworm with Python 3.11 and import it as `tag` (about a minute)."""
    with tempfile.TemporaryDirectory(prefix="loom-base-") as scratch:
        root = Path(scratch) / "root"
        subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", "bookworm", str(root),
             "http://deb.debian.org/debian"],
            check=True, capture_output=True, timeout=900,
        )  # fmt: skip
        (root / "usr/local/bin/python").symlink_to("/usr/bin/python3")
        shutil.copyfile(CA_BUNDLE, root / CA_BUNDLE.lstrip("/"))
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc"):
            shutil.rmtree(root / junk, ignore_errors=True)
        with subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE) as tar:
            subprocess.run(
                ["docker", "import",
                 "--change", f"ENV PIP_CERT={CA_BUNDLE}",
                 "--change", f"ENV PATH={PATH}",
                 "-", tag],
                stdin=tar.stdout, check=True, capture_output=True, timeout=600,
            )  # fmt: skip
        assert tar.returncode == 0


@contextmanager
def torch_index(requirement: str = TORCH, cpu: bool = True) -> Iterator[str]:
    """A PEP 503 index on 127.0.0.1 of the torch wheel pip finds here for `requirement` (a CPU
    build, where `cpu`) and its dependencies: its URL."""
    with tempfile.TemporaryDirectory(prefix="loom-index-") as scratch:
        wheels, simple = Path(scratch) / "wheels", Path(scratch) / "simple"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", requirement, "-d", str(wheels)],
            check=True, capture_output=True, timeout=1800,
        )  # fmt: skip
        (torch,) = wheels.glob("torch-*.whl")
        assert not cpu or "+cpu" in torch.name, f"{torch.name} is not torch's CPU build"
        for wheel in wheels.iterdir():
            project = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
            (simple / project).mkdir(parents=True, exist_ok=True)
            wheel.rename(simple / project / wheel.name)
        handler = functools.partial(QuietHandler, directory=scratch)
        with index_server(handler) as server:
            threading.Thread(target=server.serve_forever, daemon=True).start()
            try:
                yield f"http://127.0.0.1:{server.server_address[1]}/simple"
            finally:
                server.shutdown()


INDEX_PORT = 38765  # the same URL each time, so that docker's build cache holds (a build
# argument's value is part of each later step's key); any free port where it is taken


def index_server(handler: Callable[..., QuietHandler]) -> http.server.ThreadingHTTPServer:
    try:
        return http.server.ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
    except OSError:
        return http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def build(tag: str, index_url: str) -> float:
    """`docker build` the project as `tag` with torch from `index_url`: the seconds it took."""
    started = time.monotonic()
    docker(
        "build", "--network", "host", "--build-arg", f"TORCH_INDEX_URL={index_url}",
        "-t", tag, str(ROOT),
        timeout=1800,
    )  # fmt: skip
    return time.monotonic() - started


def size_bytes(tag: str) -> int:
    return int(docker("image", "inspect", "--format", "{{.Size}}", tag).strip())


def state(container: str, field: str) -> str:
    """`docker inspect`'s `.State.FIELD`, e.g. Status, ExitCode, Health.Status."""
    return docker("inspect", "--format", f"{{{{.State.{field}}}}}", container).strip()


def host_port(container: str, port: int) -> int:
    """The 127.0.0.1 port that `port` of `container` is published on."""
    return int(docker("port", container, str(port)).split()[0].rsplit(":", 1)[1])


def logs(container: str) -> str:
    result = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
    return result.stdout + result.stderr


def until(condition: Callable[[], object], container: str, timeout: float, what: str) -> float:
    """Poll `condition` until it is true: the seconds it took; the container's log in the failure
    when it stops running or `timeout` passes first."""
    started = time.monotonic()
    while not condition():
        if state(container, "Status") != "running" or time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout} s\n{logs(container)[-4000:]}")
        time.sleep(0.2)
    return time.monotonic() - started


def mapped_kernels(container: str) -> set[str]:
    """The kernel libraries Loom's process (PID 1) has mapped."""
    maps = docker("exec", container, "cat", "/proc/1/maps")
    return set(re.findall(r"\S*loom_kernels\S*\.so", maps))


def cache_files(container: str) -> list[str]:
    """The files of torch's extension cache in `container`: a rebuild adds object files."""
    return sorted(docker("exec", container, "find", EXTENSIONS, "-type", "f").split())


NETWORK = "loom-test"


@contextmanager
def container(image: str, *run_args: str, command: tuple[str, ...] = ()) -> Iterator[str]:
    """`docker run -d` on a network of the tests' own, its ports published on 127.0.0.1: the
    container's name, removed after."""
    if not docker("network", "ls", "--quiet", "--filter", f"name=^{NETWORK}$").strip():
        docker("network", "create", NETWORK)
    name = f"loom-test-{uuid.uuid4().hex[:8]}"
    published = [f"--publish=127.0.0.1::{port}" for port in PORTS]
    docker("run", "--detach", "--name", name, f"--network={NETWORK}", *published, *run_args,
           image, *command)  # fmt: skip
    try:
        yield name
    finally:
        docker("rm", "--force", name, check=False)
