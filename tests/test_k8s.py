"""The Kubernetes manifests under deploy/k8s, checked offline (no cluster on these machines).

Every document is validated against the Kubernetes API's JSON schemas in their strict form (an
unknown field is an error). The schemas, generated from the Kubernetes OpenAPI specification,
come bundled in the `kubernetes-validate` package (Apache-2.0), so nothing is fetched. Then what
Loom needs from the manifests: the args parse with Loom's real argument parser, the grace period
outlasts the drain, the probes ask grpc.health.v1 on the gRPC port, the GPU variant asks for a
GPU, the nginx ConfigMap holds deploy/nginx/nginx.conf unchanged, and the SMG gateway finds every
Loom pod (its args parsed by SMG's own parser) with no more rights than watching pods.
"""

from __future__ import annotations

import argparse
import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from loom.cli import parser, settings_from
from loom.engine.config import EngineConfig
from loom.server.config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
# 1.27: the first release with gRPC probes on by default (GA); "latest": the newest bundled.
KUBERNETES_VERSIONS = ("1.27", "latest")

Manifests = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def manifests() -> Manifests:
    """Every document of every file under deploy/k8s, by file name."""
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        for path in sorted(K8S.glob("*.yaml"))
    }


def find(manifests: Manifests, file: str, kind: str, name: str) -> dict[str, Any]:
    (document,) = [d for d in manifests[file] if (d["kind"], d["metadata"]["name"]) == (kind, name)]
    return document


def loom_deployments(manifests: Manifests) -> list[dict[str, Any]]:
    return [
        find(manifests, "loom-cpu.yaml", "StatefulSet", "loom"),
        find(manifests, "loom-gpu.yaml", "StatefulSet", "loom"),
    ]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    ]
    return found


def port(container: dict[str, Any], name: str) -> int:
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(number)


def serve_command(args: list[str]) -> tuple[argparse.Namespace, ServerConfig]:
    """`args` parsed by Loom's parser, and the server settings they make (defaults filled in)."""
    parsed = parser().parse_args(args)  # SystemExit (a test error) on a bad flag
    assert parsed.command == "serve"
    settings_from(parsed, EngineConfig)  # a bad engine or cache value fails here
    return parsed, settings_from(parsed, ServerConfig)


def validate(document: dict[str, Any], version: str) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("the Kubernetes schemas come from: pip install kubernetes-validate==1.37.0")
    if version == "latest":
        version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_k8s_every_document_follows_the_kubernetes_schema(
    manifests: Manifests, version: str
) -> None:
    assert set(manifests) == {"loom-cpu.yaml", "loom-gpu.yaml", "nginx.yaml", "smg.yaml"}
    for documents in manifests.values():
        for document in documents:
            validate(document, version)


def test_k8s_validation_fails_on_a_wrong_field(manifests: Manifests) -> None:
    broken = copy.deepcopy(find(manifests, "loom-cpu.yaml", "StatefulSet", "loom"))
    pod = broken["spec"]["template"]["spec"]
    pod["terminationGracePeriod"] = pod.pop("terminationGracePeriodSeconds")
    with pytest.raises(jsonschema.ValidationError, match="terminationGracePeriod"):
        validate(broken, "latest")
    broken = copy.deepcopy(find(manifests, "loom-gpu.yaml", "StatefulSet", "loom"))
    container(broken, "loom")["readinessProbe"]["grpc"]["port"] = "grpc"  # a number only
    with pytest.raises(jsonschema.ValidationError, match="'grpc' is not of type"):
        validate(broken, "latest")


def test_k8s_every_loom_command_line_parses_with_loom_s_parser(manifests: Manifests) -> None:
    for deployment in loom_deployments(manifests):
        pod = deployment["spec"]["template"]["spec"]
        for each in pod["initContainers"] + pod["containers"]:
            if "args" not in each:
                continue
            _, settings = serve_command(each["args"])
            assert settings.host == "0.0.0.0"  # reachable from outside the pod
            assert settings.port == port(each, "grpc")
            assert settings.metrics_port == port(each, "metrics")
            assert settings.metrics_host == "0.0.0.0"  # scraped from outside the pod
            assert settings.http.http_port == port(each, "http")  # OpenAI's HTTP API
            assert settings.http.http_host == "0.0.0.0"
            # nginx (deploy/k8s/nginx.yaml) opens a connection per call: one peer, many
            assert settings.boundary.max_connections_per_peer == settings.boundary.max_connections


def test_k8s_loom_pods_drain_within_the_grace_period(manifests: Manifests) -> None:
    for deployment in loom_deployments(manifests):
        _, settings = serve_command(container(deployment, "loom")["args"])
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > settings.drain_timeout


def test_k8s_loom_probes_ask_grpc_health_on_the_grpc_port(manifests: Manifests) -> None:
    for deployment in loom_deployments(manifests):
        loom = container(deployment, "loom")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # No `service`: the server's overall health, NOT_SERVING while loading or draining.
            assert loom[probe]["grpc"] == {"port": port(loom, "grpc")}, probe
        startup = loom["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # a model load fits
        assert loom["readinessProbe"]["periodSeconds"] <= 10


def test_k8s_loom_pods_run_as_the_image_s_user_and_seed_the_cache(manifests: Manifests) -> None:
    uid = re.search(r"^ARG LOOM_UID=(\d+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert uid is not None
    for deployment in loom_deployments(manifests):
        template = deployment["spec"]["template"]
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == int(uid.group(1))
        (seed,) = pod["initContainers"]
        loom = container(deployment, "loom")
        assert seed["image"] == loom["image"]
        assert seed["command"] == ["cp", "-a", "/var/cache/loom", "/seed/"]
        assert {"name": "model-cache", "mountPath": "/seed"} in seed["volumeMounts"]
        cache = {"name": "model-cache", "mountPath": "/var/cache/loom", "subPath": "loom"}
        assert cache in loom["volumeMounts"]
        for each in (seed, loom):
            assert each["securityContext"]["allowPrivilegeEscalation"] is False
            assert each["securityContext"]["readOnlyRootFilesystem"] is True
            assert each["resources"]["requests"] == each["resources"]["limits"]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port(loom, "metrics"))


def test_k8s_gpu_deployment_requests_a_gpu_and_the_cpu_one_does_not(manifests: Manifests) -> None:
    cpu, gpu = (container(d, "loom") for d in loom_deployments(manifests))
    assert cpu["image"] == "loom:cpu"
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert getattr(serve_command(cpu["args"])[0], "device", "auto") == "auto"
    assert gpu["image"] == "loom:cuda"
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert serve_command(gpu["args"])[0].device == "cuda"


def test_k8s_loom_service_is_headless_and_selects_every_loom_pod(manifests: Manifests) -> None:
    service = find(manifests, "loom-cpu.yaml", "Service", "loom")
    assert find(manifests, "loom-gpu.yaml", "Service", "loom") == service
    assert service["spec"]["clusterIP"] == "None"  # the name resolves to every pod's IP
    for deployment in loom_deployments(manifests):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        loom = container(deployment, "loom")
        for each in service["spec"]["ports"]:
            assert each["port"] == port(loom, each["targetPort"])


def test_k8s_nginx_config_map_holds_deploy_nginx_conf_unchanged(manifests: Manifests) -> None:
    data = find(manifests, "nginx.yaml", "ConfigMap", "loom-nginx")["data"]
    nginx_conf = ROOT / "deploy" / "nginx" / "nginx.conf"
    # On a difference, copy nginx.conf into the ConfigMap again, indented by four spaces.
    assert data["nginx.conf"].encode() == nginx_conf.read_bytes()
    service = find(manifests, "loom-cpu.yaml", "Service", "loom")
    (grpc,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
    # One line per replica (consistent hashing needs them apart): the StatefulSet's pods.
    servers = re.findall(r"^\s*server\s+([^:\s]+):(\d+)\b", data["upstreams.conf"], re.MULTILINE)
    replicas = find(manifests, "loom-cpu.yaml", "StatefulSet", "loom")["spec"]["replicas"]
    assert servers == [(f"loom-{i}.loom", str(grpc)) for i in range(replicas)]


def test_k8s_nginx_serves_the_config_map_behind_the_front_service(manifests: Manifests) -> None:
    deployment = find(manifests, "nginx.yaml", "Deployment", "loom-front")
    nginx = container(deployment, "nginx")
    nginx_conf = (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    (listen,) = re.findall(r"^\s*listen\s+(\d+)", nginx_conf, re.MULTILINE)
    assert port(nginx, "grpc") == int(listen)
    assert {"name": "config", "mountPath": "/etc/nginx", "readOnly": True} in nginx["volumeMounts"]
    pod = deployment["spec"]["template"]
    assert {"name": "config", "configMap": {"name": "loom-nginx"}} in pod["spec"]["volumes"]
    front = find(manifests, "nginx.yaml", "Service", "loom-front")
    assert front["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (service_port,) = front["spec"]["ports"]
    assert service_port["targetPort"] == "grpc"
    assert service_port["port"] == 50051  # clients keep the port they use for one replica


def test_k8s_gateway_discovers_every_loom_pod_as_a_grpc_worker(manifests: Manifests) -> None:
    from smg.launch_router import parse_router_args  # SMG's own parser: its flags as it reads them

    deployment = find(manifests, "smg.yaml", "Deployment", "loom-gateway")
    smg = container(deployment, "smg")
    args = parse_router_args(smg["args"])
    args._validate_router_args()
    assert args.service_discovery
    for loom in loom_deployments(manifests):
        assert args.selector.items() <= loom["spec"]["template"]["metadata"]["labels"].items()
        assert args.service_discovery_port == port(container(loom, "loom"), "grpc")
    pod = deployment["spec"]["template"]
    assert args.selector.items() - pod["metadata"]["labels"].items()  # not itself
    assert port(smg, "http") == args.port
    service = find(manifests, "smg.yaml", "Service", "loom-gateway")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_k8s_gateway_may_watch_the_pods_and_nothing_more(manifests: Manifests) -> None:
    deployment = find(manifests, "smg.yaml", "Deployment", "loom-gateway")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    binding = find(manifests, "smg.yaml", "RoleBinding", "loom-gateway")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = find(manifests, "smg.yaml", "Role", binding["roleRef"]["name"])
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
