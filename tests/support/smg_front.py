"""The SMG gateway (`smg` from PyPI, a Rust binary in a wheel) in front of Loom replicas, for
the tests: `smg launch` on free loopback ports, waited for until every worker is ready; stopped
with SIGTERM, then SIGKILL. Its log is a file, read by `Gateway.log()`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from tests.support.nginx_front import free_port

HOST = "127.0.0.1"
READY_SECONDS = 60


@attrs.frozen
class Gateway:
    port: int
    log_path: Path
    api_key: str | None = None  # its own, which its control plane asks for too

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log(self) -> str:
        """Its log so far, without its colours."""
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))

    def get(self, path: str) -> Any:
        request = urllib.request.Request(self.url + path)
        if self.api_key is not None:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def workers(self) -> list[Any]:
        return list(self.get("/workers")["workers"])


@contextmanager
def smg_front(worker_urls: list[str], *args: str, api_key: str | None = None) -> Iterator[Gateway]:
    """`smg launch` routing to `worker_urls` (grpc://HOST:PORT or http://HOST:PORT), with
    `args` (its policy, say) and its own `api_key`: the gateway, once it has registered them
    all."""
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="loom-smg-")) / "smg.log"
    command = [
        *(sys.executable, "-m", "smg", "launch", "--host", HOST, "--port", str(port)),
        *("--prometheus-host", HOST, "--prometheus-port", str(free_port())),
        *("--shutdown-grace-period-secs", "1", "--log-level", "debug"),
        *("--worker-urls", *worker_urls),
        *(("--api-key", api_key) if api_key else ()),
        *args,
    ]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    gateway = Gateway(port, log_path, api_key)
    try:
        grpc = worker_urls[0].startswith("grpc://")
        wait_ready(gateway, process, len(worker_urls), grpc)
        yield gateway
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tokenizers(gateway: Gateway) -> bool:
    """Whether the gateway has the workers' tokenizer (a gRPC worker's comes after it is
    ready, from its GetTokenizer)."""
    return bool(gateway.get("/v1/tokenizers")["tokenizers"])


def wait_ready(
    gateway: Gateway, process: subprocess.Popen[bytes], num_workers: int, grpc: bool
) -> None:
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"smg exited with {process.returncode}:\n{gateway.log()[-3000:]}")
        try:
            ready = [w for w in gateway.workers() if w.get("status") == "ready"]
        except OSError:
            ready = []
        if len(ready) == num_workers and (not grpc or tokenizers(gateway)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"smg: {num_workers} workers not ready:\n{gateway.log()[-3000:]}")
