"""The Tinker-compatible API's manifests (infra/k8s/api): schema-valid, and gateway and trainer wired alike."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from tests.infra.kustomize_render import is_builtin, pod_specs, render

API = Path(__file__).resolve().parents[2] / "infra" / "k8s" / "api"


@pytest.fixture(scope="module")
def resources() -> list[dict]:
    return render(API)


def _named(resources: list[dict], kind: str, name: str) -> dict:
    (found,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def test_renders_and_matches_the_kubernetes_schemas(resources):
    version = kubernetes_validate.latest_version()
    assert {r["kind"] for r in resources} == {"Deployment", "Service", "StatefulSet"}
    for resource in filter(is_builtin, resources):
        kubernetes_validate.validate(resource, version, strict=True)
        assert resource["metadata"]["namespace"] == "rlpipe"


def test_gateway_scales_apart_from_the_trainer_and_the_service_reaches_it(resources):
    gateway = _named(resources, "Deployment", "rlpipe-gateway")
    trainer = _named(resources, "StatefulSet", "rlpipe-trainer")
    service = _named(resources, "Service", "rlpipe-api")
    assert gateway["spec"]["replicas"] >= 2 and trainer["spec"]["replicas"] == 1
    assert service["spec"]["selector"] == gateway["spec"]["template"]["metadata"]["labels"]
    (gateway_spec,), (trainer_spec,) = pod_specs(gateway), pod_specs(trainer)
    (gw,), (tr,) = gateway_spec["containers"], trainer_spec["containers"]
    assert gw["args"][:3] == ["serve", "--role", "gateway"] and tr["args"][:3] == ["serve", "--role", "trainer"]
    # both serve the same base model, so the gateway accepts exactly what a trainer trains
    assert gw["args"][gw["args"].index("--base-model") + 1] == tr["args"][tr["args"].index("--base-model") + 1]
    assert gw["livenessProbe"]["httpGet"]["path"] == "/api/v1/healthz"
    env = {e["name"]: e for e in gw["env"]}
    assert env["RLPIPE_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "rlpipe-api-keys"
    for spec, container in ((gateway_spec, gw), (trainer_spec, tr)):
        ctx = {**spec["securityContext"], **container["securityContext"]}
        assert ctx["runAsNonRoot"] and ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"]
