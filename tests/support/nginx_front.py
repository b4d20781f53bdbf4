"""nginx in front of Loom replicas, for the tests: deploy/nginx/nginx.conf as shipped, but for
its listening port (a free one on loopback) and its upstreams (the replicas given)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CONF = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "nginx.conf"
LISTEN = "listen 8080 http2;"


def nginx_path() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 up, ip_local_port_range), so no
    connection made meanwhile can be given it before nginx binds it (one from `bind(0)` could)."""
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def write_upstreams(folder: Path, ports: list[int]) -> None:
    lines = "".join(f"server 127.0.0.1:{port} max_fails=1 fail_timeout=10s;\n" for port in ports)
    (folder / "upstreams.conf").write_text(lines)


@contextmanager
def nginx_front(ports: list[int], errors: list[str] | None = None) -> Iterator[int]:
    """nginx, in the foreground, balancing over the replicas on `ports`: its port. Its error
    log's lines go into `errors` when it stops."""
    nginx = nginx_path()
    assert nginx is not None, "nginx is not installed (apt-get install nginx)"
    folder = Path(tempfile.mkdtemp(prefix="loom-nginx-"))
    os.chmod(folder, 0o755)  # its workers run as nobody
    port = free_port()
    config = CONF.read_text()
    assert LISTEN in config
    (folder / "nginx.conf").write_text(config.replace(LISTEN, f"listen 127.0.0.1:{port} http2;"))
    write_upstreams(folder, ports)
    command = [nginx, "-p", str(folder), "-c", str(folder / "nginx.conf")]
    log = folder / "error.log"
    directives = f"daemon off; pid {folder}/nginx.pid; error_log {log} warn;"
    process = subprocess.Popen([*command, "-g", directives])
    try:
        wait_listening(port, process)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)
        if errors is not None and log.exists():
            errors.extend(log.read_text().splitlines())
        shutil.rmtree(folder, ignore_errors=True)


def wait_listening(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nginx exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("nginx did not listen within 30 s")
