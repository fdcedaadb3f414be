"""The Tinker-compatible API's manifests (infra/k8s/api): schema-valid, every role of `rlpipe serve` deployed,
the roles wired alike, and their topics and consumer groups allowed by the Kafka cluster next to them."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from pipeline.topics import API_TOPIC_KINDS, topic_name
from tests.infra.kustomize_render import is_builtin, one, pod_specs, render

K8S = Path(__file__).resolve().parents[2] / "infra" / "k8s"
API = K8S / "api"
ROLES = {"gateway": ("Deployment", "rlpipe-gateway"), "trainer": ("StatefulSet", "rlpipe-trainer"),
         "sampler": ("Deployment", "rlpipe-sampler")}


@pytest.fixture(scope="module")
def resources() -> list[dict]:
    return render(API)


def _named(resources: list[dict], kind: str, name: str) -> dict:
    (found,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def test_renders_and_matches_the_kubernetes_schemas(resources):
    version = kubernetes_validate.latest_version()
    assert {r["kind"] for r in filter(is_builtin, resources)} == {"Deployment", "Service", "StatefulSet"}
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


def _container(resources: list[dict], role: str) -> tuple[dict, dict]:
    """(pod spec, its one container) of ``role``'s workload."""
    (spec,) = pod_specs(_named(resources, *ROLES[role]))
    (container,) = spec["containers"]
    return spec, container


def _option(container: dict, name: str) -> str:
    return container["args"][container["args"].index(name) + 1]


def test_every_role_of_serve_runs_on_the_same_base_model(resources):
    # Without a sampler, sample calls wait on <ns>.requests for ever.
    base_models = set()
    for role in ROLES:
        _, container = _container(resources, role)
        assert container["command"] == ["rlpipe"] and container["args"][:3] == ["serve", "--role", role]
        base_models.add(_option(container, "--base-model"))
    assert len(base_models) == 1


@pytest.mark.parametrize("role", ["trainer", "sampler"])
def test_the_engines_find_their_base_model_filled_before_they_start(resources, role):
    """Served by its hub id (what clients name, and load its tokenizer by), from the hub cache the init container
    filled on the same volume; offline, so a start makes no hub calls."""
    spec, container = _container(resources, role)
    hub_id = _option(container, "--base-model")
    assert not hub_id.startswith("/") and hub_id.count("/") == 1  # a hub id, not a folder only the pods have
    (init,) = spec["initContainers"]
    assert f'snapshot_download("{hub_id}")' in init["args"][-1]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]}["cache"] == mounts["cache"] == "/cache"
    dockerfile = K8S.parent / "docker" / f"{'producer' if role == 'sampler' else 'learner'}.Dockerfile"
    assert "HF_HOME=/cache/hf" in dockerfile.read_text()  # the cache both containers read, on that volume


def test_the_trainer_statefulset_names_a_headless_service_that_selects_it(resources):
    trainer = _named(resources, "StatefulSet", "rlpipe-trainer")
    service = _named(resources, "Service", trainer["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= trainer["spec"]["template"]["metadata"]["labels"].items()


def test_api_topics_are_declared_with_replicas_the_cluster_can_meet(resources):
    strimzi = render(K8S / "kafka")
    cluster = one(strimzi, "Kafka")["metadata"]["name"]
    brokers = one(strimzi, "KafkaNodePool")["spec"]["replicas"]
    topics = {t["spec"]["topicName"]: t for t in resources if t["kind"] == "KafkaTopic"}
    assert sorted(topics) == sorted(topic_name("rlpipe", kind) for kind in API_TOPIC_KINDS)
    for topic in topics.values():
        spec = topic["spec"]
        assert topic["metadata"]["labels"]["strimzi.io/cluster"] == cluster
        assert 2 <= spec["config"]["min.insync.replicas"] < spec["replicas"] <= brokers  # one replica to lose
        assert spec["config"]["max.message.bytes"] == 1024 * 1024 and spec["config"]["cleanup.policy"] == "delete"
    # `rlpipe serve` creates a missing topic itself (before the Topic Operator has): with the same shape.
    for role in ROLES:
        env = {e["name"]: e.get("value") for e in _container(resources, role)[1]["env"]}
        for topic in topics.values():
            assert int(env["RLPIPE_BUS__REPLICATION_FACTOR"]) == topic["spec"]["replicas"], role
            assert int(env["RLPIPE_BUS__TOPIC_PARTITIONS"]) == topic["spec"]["partitions"], role


@pytest.mark.parametrize("role", ["trainer", "sampler"])
def test_the_engines_are_probed_where_they_serve_their_health(resources, role):
    """The engines take no HTTP traffic: `rlpipe serve --health-port` gives each /healthz (the process answers,
    even while its model loads) and /readyz (the engine loaded and reading calls), which the probes ask."""
    _, container = _container(resources, role)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(_option(container, "--health-port")) == ports["health"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    # a restart reloads the model: liveness gives a stuck engine a minute before it is killed
    assert container["livenessProbe"]["periodSeconds"] * container["livenessProbe"]["failureThreshold"] >= 60
    # the health server starts after torch (and vLLM) are imported, which on a cold node can take past that
    # minute: liveness is asked only once a startup probe of the same endpoint answered, within minutes
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/healthz", "port": "health"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
