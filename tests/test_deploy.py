"""The deployment files, checked statically (tests/image/ builds and runs the image).

The compose file is validated against the Compose Specification's JSON schema (kept as test
data, with its origin and licence: tests/data/README.md), and every command line in
the Dockerfile and the compose file must parse with Loom's real argument parser.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from loom.cli import parser
from loom.model.loader import TENSORS_FILE

ROOT = Path(__file__).resolve().parent.parent


def compose_schema() -> dict[str, Any]:
    """The Compose Specification's schema, kept as test data (tests/data/README.md)."""
    return dict(json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text()))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def validate(document: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(compose_schema()).validate(document)


def test_deploy_compose_file_follows_the_compose_specification(compose: dict[str, Any]) -> None:
    validate(compose)


def test_deploy_compose_validation_fails_on_a_wrong_key(compose: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(compose))
    broken["services"]["loom"]["helthcheck"] = broken["services"]["loom"].pop("healthcheck")
    with pytest.raises(jsonschema.ValidationError, match="helthcheck"):
        validate(broken)
    broken = json.loads(json.dumps(compose))
    broken["services"]["loom-gpu"]["deploy"]["resources"]["reservation"] = {}
    with pytest.raises(jsonschema.ValidationError, match="reservation"):
        validate(broken)


def test_deploy_compose_services_probe_drain_and_reserve_the_gpu(compose: dict[str, Any]) -> None:
    cpu, gpu = compose["services"]["loom"], compose["services"]["loom-gpu"]
    for service in (cpu, gpu):
        health = service["healthcheck"]
        assert health["test"][:3] == ["CMD", "loom", "health"]
        assert seconds(health["start_period"]) >= 60  # a model load fits
        drain = float(service["command"][service["command"].index("--drain-timeout") + 1])
        assert seconds(service["stop_grace_period"]) > drain
        assert "model-cache:/var/cache/loom" in service["volumes"]
    assert "profiles" not in cpu
    assert gpu["profiles"] == ["gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["capabilities"] == ["gpu"]
    assert "model-cache" in compose["volumes"]


def test_deploy_compose_replicas_sit_behind_nginx(compose: dict[str, Any]) -> None:
    services = compose["services"]
    replicas = {
        name: s for name, s in services.items() if name.startswith("loom-") and name[5:].isdigit()
    }
    front = services["front"]
    assert len(replicas) >= 2
    for replica in replicas.values():
        assert replica["profiles"] == ["replicas", "gateway"]
        assert "ports" not in replica  # reached through nginx
        drain = float(replica["command"][replica["command"].index("--drain-timeout") + 1])
        assert seconds(replica["stop_grace_period"]) > drain
    assert front["profiles"] == ["replicas"]
    assert {name: d["condition"] for name, d in front["depends_on"].items()} == dict.fromkeys(
        replicas, "service_healthy"
    )
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in front["volumes"]}
    assert mounts["/etc/nginx/nginx.conf"] == "./deploy/nginx/nginx.conf"
    upstreams = (ROOT / mounts["/etc/nginx/upstreams.conf"]).read_text()
    servers = re.findall(r"^server (\S+):50051\b", upstreams, re.MULTILINE)
    assert servers == sorted(replicas)  # one line each: consistent hashing needs them apart
    assert front["ports"] == ["50051:8080"]
    assert "listen 8080 http2;" in (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()


def test_deploy_compose_gateway_takes_every_replica_as_a_grpc_worker(
    compose: dict[str, Any],
) -> None:
    from smg.launch_router import parse_router_args  # SMG's own parser: its flags as it reads them

    services = compose["services"]
    gateway = services["gateway"]
    replicas = sorted(n for n, s in services.items() if "gateway" in s.get("profiles", ()))
    replicas.remove("gateway")
    args = parse_router_args(gateway["command"])
    args._validate_router_args()
    assert args.worker_urls == [f"grpc://{name}:50051" for name in replicas]
    assert len(replicas) >= 2
    assert {name: d["condition"] for name, d in gateway["depends_on"].items()} == dict.fromkeys(
        replicas, "service_healthy"
    )
    assert gateway["ports"] == [f"8000:{args.port}"]
    assert gateway["build"] == "deploy/smg"


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    assert match, duration
    return float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]


def test_deploy_every_command_line_parses_with_loom_s_parser(
    compose: dict[str, Any], dockerfile: str
) -> None:
    looms = [s for s in compose["services"].values() if s["image"].startswith("loom:")]
    assert len(looms) == 4
    commands = [service["command"] for service in looms]
    commands += [service["healthcheck"]["test"][2:] for service in looms]
    commands.append(json.loads(instruction(dockerfile, "CMD")))
    commands.append(json.loads(instruction(dockerfile, "HEALTHCHECK").split("CMD", 1)[1])[1:])
    for command in commands:
        args = parser().parse_args(command)  # SystemExit (a test error) on an unknown flag
        if args.command == "serve":
            assert args.host == "0.0.0.0"  # reachable from outside the container
            assert args.port == 50051
            assert args.metrics_host == "0.0.0.0"  # scraped from outside it too
    for command in (
        compose["services"]["loom"]["command"],
        json.loads(instruction(dockerfile, "CMD")),
    ):
        args = parser().parse_args(command)
        assert (args.http_port, args.http_host) == (8000, "0.0.0.0")  # OpenAI's HTTP API
    assert "8000:8000" in compose["services"]["loom"]["ports"]


def instruction(dockerfile: str, name: str) -> str:
    """The last instruction `name` of the final stage, continuation lines joined."""
    joined = dockerfile.replace("\\\n", " ")
    found = re.findall(rf"^{name}\s+(.*)$", joined, flags=re.MULTILINE)
    assert found, name
    return str(found[-1]).strip()


def test_deploy_dockerfile_runs_loom_as_pid_1_as_a_fixed_non_root_user(dockerfile: str) -> None:
    assert dockerfile.count("\nFROM ") + dockerfile.startswith("FROM ") >= 2  # multi-stage
    assert json.loads(instruction(dockerfile, "ENTRYPOINT")) == ["loom"]  # exec form
    assert instruction(dockerfile, "USER") == "${LOOM_UID}"
    assert re.search(r"^ARG LOOM_UID=(\d+)$", dockerfile, re.MULTILINE).group(1) != "0"  # type: ignore[union-attr]
    assert instruction(dockerfile, "EXPOSE") == "50051 8000 9464"  # gRPC, HTTP API, /metrics
    for variable in ("HOME=", "HF_HOME=", "XDG_CACHE_HOME=", "LOOM_CACHE_DIR="):
        assert variable in dockerfile
    assert "chmod -R a+rwX /var/cache/loom" in dockerfile  # any UID can write
    assert 'install -d -m 0777 -o "${LOOM_UID}" -g 0 /var/cache/loom' in dockerfile


def test_deploy_dockerfile_installs_dependencies_before_copying_the_source(dockerfile: str) -> None:
    """The locked dependencies in a layer of their own, before the code."""
    dependencies = dockerfile.index("pip install --no-cache-dir --no-compile -r requirements.lock")
    source = dockerfile.index("COPY loom ./loom")
    assert dockerfile.index("COPY pyproject.toml README.md requirements.lock") < dependencies
    assert dependencies < source


def test_deploy_dockerignore_sends_only_the_build_inputs() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in lines
    assert {"!pyproject.toml", "!README.md", "!requirements.lock", "!loom/"} <= set(lines)


@pytest.mark.parametrize("dockerfile_path", ["Dockerfile", "deploy/smg/Dockerfile"])
def test_deploy_dockerfile_is_clean_for_hadolint(dockerfile_path: str) -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run(
        [str(hadolint), str(ROOT / dockerfile_path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.smollm2
def test_deploy_the_image_s_bake_commands_work(dockerfile: str) -> None:
    """The Dockerfile's `python -m MODULE` commands: the default model's conversion (config,
    tokenizer and tensor names: no weights) and both kernel libraries, neither loaded."""
    modules = re.findall(r"python -m (loom[\w.]*)", dockerfile)
    assert modules == ["loom.model.loader", "loom.model.kernels"]
    printed = []
    for module in modules:
        result = subprocess.run(
            [sys.executable, "-m", module], capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-2000:]
        printed.append(result.stdout.split())
    (folder,), libraries = printed
    assert (Path(folder) / TENSORS_FILE).is_file()
    assert not list(Path(folder).glob("*.safetensors"))
    assert sorted(Path(library).name for library in libraries) == [
        "loom_kernels_avx2.so", "loom_kernels_vnni.so",
    ]  # fmt: skip
    assert all(Path(library).is_file() for library in libraries)
