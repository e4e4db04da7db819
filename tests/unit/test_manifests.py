"""The Kubernetes manifests (docker/kubernetes/), validated against Kubernetes' own
schemas and against the server's command line, so they cannot rot unrun."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gpufeed.server.__main__ import _parser

_MANIFESTS = sorted((Path(__file__).resolve().parents[2] / "docker" / "kubernetes").glob("*.yaml"))
# The Kubernetes release the manifests are checked against (kubernetes-validate ships
# every release's schemas; autoscaling/v2 and gRPC probes need 1.24 or later).
_KUBERNETES = "1.33"


def _documents() -> list[tuple[str, dict]]:
    return [(f"{path.name}:{doc['kind']}", doc) for path in _MANIFESTS
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def _by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in _documents() if doc["kind"] == kind]


@pytest.mark.parametrize("name, document", _documents(), ids=[n for n, _ in _documents()])
def test_every_manifest_is_valid_kubernetes(name, document):
    kubernetes_validate.validate(document, _KUBERNETES, strict=True)


def test_the_validation_refuses_a_misspelt_field():
    """Strict validation is what catches a typo: an unknown field is an error, not ignored."""
    deployment = _by_kind("Deployment")[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    broken = {**deployment, "spec": {**deployment["spec"], "template": {
        **deployment["spec"]["template"], "spec": {
            **deployment["spec"]["template"]["spec"],
            "containers": [{**container, "argz": container["args"]}]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, _KUBERNETES, strict=True)


@pytest.mark.parametrize("workload", _by_kind("DaemonSet") + _by_kind("Deployment"),
                         ids=lambda w: w["metadata"]["name"])
def test_each_server_runs_a_command_line_the_server_accepts(workload, tmp_path):
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    args = list(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args[args.index("--listen") + 1].endswith(f":{ports['grpc']}")
    assert args[args.index("--metrics-port") + 1] == str(ports["metrics"])
    root = args.index("--data-root") + 1
    if not args[root].startswith("s3://"):  # a local root must exist for the parser's check
        args[root] = str(tmp_path)
    _parser().parse_args(args)
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"])


def test_the_preprocessing_servers_are_found_and_scaled_by_name():
    (deployment,) = _by_kind("Deployment")
    (service,) = _by_kind("Service")
    (autoscaler,) = _by_kind("HorizontalPodAutoscaler")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one address per pod
    assert service["spec"]["selector"].items() <= labels.items()
    assert autoscaler["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = autoscaler["spec"]["metrics"]
    assert metric["external"]["metric"]["name"].startswith("gpufeed_trainer_wait_seconds")
