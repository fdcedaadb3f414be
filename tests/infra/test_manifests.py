"""Kubernetes manifests: render every kustomization, validate against the Kubernetes schemas,
and check what the pods, Strimzi and rlpipe's configuration must agree on."""

from __future__ import annotations

import copy
import re
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pipeline.config import env_layer, resolve_config
from pipeline.topics import all_topics
from schemas.config import BusConfig, RunConfig
from tests.infra.kustomize_render import is_builtin, of_kind, one, pod_specs, render

K8S = Path(__file__).resolve().parents[2] / "infra" / "k8s"
README = K8S.parent / "README.md"
KUSTOMIZATIONS = ["base", "kafka", "overlays/dev", "overlays/gke", "overlays/gke-distributed", "api"]
OVERLAYS = ["overlays/dev", "overlays/gke"]
WITH_PODS = ["base", "overlays/dev", "overlays/gke", "overlays/gke-distributed", "api"]
ON_GKE = ["overlays/gke", "overlays/gke-distributed", "api"]
REGISTRY = "us-central1-docker.pkg.dev/my-gcp-project/rlpipe/"
# The bus fields that say which cluster, which topics and who connects (the rest only shape topics rlpipe creates).
BUS_CONNECTION = {"bootstrap_servers", "namespace", "security_protocol", "sasl_mechanism", "sasl_username",
                  "sasl_password", "sasl_password_file", "ssl_cafile"}
WORKLOADS = {"rlpipe-producer": "producer", "rlpipe-learner": "learner"}  # StatefulSet name -> rlpipe component
STRIMZI_API = "kafka.strimzi.io/v1beta2"
ONE_MIB = 1024 * 1024
DAY_MS = 24 * 3600 * 1000


@cache
def _rendered(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(K8S / name))


def rendered(name: str) -> list[dict[str, Any]]:
    """A fresh copy of a rendering (cached, so each kustomization is rendered once per session)."""
    return copy.deepcopy(list(_rendered(name)))


def workloads(resources: list[dict]) -> list[tuple[str, dict, dict]]:
    """(component, workload, its one rlpipe container) for the producer and the learner StatefulSets."""
    result = []
    for name, component in WORKLOADS.items():
        workload = one(resources, "StatefulSet", name)
        (spec,) = pod_specs(workload)
        (container,) = [c for c in spec["containers"] if c["name"] == component]
        result.append((component, workload, container))
    return result


def pods(resources: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, pod spec) of every workload."""
    return [(resource, spec) for resource in resources for spec in pod_specs(resource)]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def health_port(container: dict) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "health"]
    return port


# rendering and schemas ----------------------------------------------------------


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_renders_and_builtin_kinds_match_the_kubernetes_schemas(name):
    resources = rendered(name)
    assert resources
    version = kubernetes_validate.latest_version()
    validated = 0
    for resource in filter(is_builtin, resources):
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            where = "/".join(str(p) for p in err.path)
            pytest.fail(f"{name}: {resource['kind']}/{resource['metadata']['name']} at {where}: {err.message}")
        validated += 1
    assert validated == sum(1 for r in resources if not r["apiVersion"].startswith("kafka.strimzi.io"))


def test_validation_would_catch_a_typo():
    # Guard against a validator that silently accepts everything (e.g. a schema that is not found).
    producer = one(rendered("overlays/gke"), "StatefulSet", "rlpipe-producer")
    producer["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/healthz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(producer, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_everything_lands_in_the_rlpipe_namespace(name):
    for resource in rendered(name):
        if resource["kind"] != "Namespace":
            assert resource["metadata"].get("namespace") == "rlpipe", resource["metadata"]["name"]
        assert resource["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rlpipe"


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_every_config_map_reference_resolves(name):
    resources = rendered(name)
    config_maps = {r["metadata"]["name"] for r in of_kind(resources, "ConfigMap")}
    for _, workload, _ in workloads(resources):
        (spec,) = pod_specs(workload)
        for volume in spec["volumes"]:
            for source in volume.get("projected", {}).get("sources", []):
                if "configMap" in source:
                    assert source["configMap"]["name"] in config_maps
    # The generated name carries a content hash, so a changed run.yaml rolls the pods.
    assert all(re.fullmatch(r"rlpipe-run-[0-9a-f]{10}", n) for n in config_maps)


def test_dev_and_gke_run_configs_differ_so_their_config_map_names_do():
    dev = one(rendered("overlays/dev"), "ConfigMap")["metadata"]["name"]
    gke = one(rendered("overlays/gke"), "ConfigMap")["metadata"]["name"]
    assert dev != gke


# pods: security, probes, metrics, lifecycle ----------------------------------------


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_every_container_runs_non_root_with_nothing_to_escalate(name):
    for _, workload, _ in workloads(rendered(name)):
        (spec,) = pod_specs(workload)
        pod_ctx = spec.get("securityContext", {})
        mounts_by_container = {}
        for container in spec["containers"] + spec.get("initContainers", []):
            ctx = {**pod_ctx, **container.get("securityContext", {})}
            assert ctx.get("runAsNonRoot") is True, container["name"]
            assert ctx.get("runAsUser") == 10001, container["name"]
            assert ctx.get("allowPrivilegeEscalation") is False, container["name"]
            assert ctx.get("readOnlyRootFilesystem") is True, container["name"]
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
            mounts_by_container[container["name"]] = {m["mountPath"] for m in container["volumeMounts"]}
        assert pod_ctx["seccompProfile"]["type"] == "RuntimeDefault"
        # A read-only root needs writable scratch: /tmp, the home folder and the model caches.
        for mounts in mounts_by_container.values():
            assert {"/tmp", "/home/rlpipe", "/cache"} <= mounts


@pytest.mark.parametrize("name", WITH_PODS)
def test_every_container_of_every_pod_meets_the_restricted_level(name):
    for workload, spec in pods(rendered(name)):
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for container in spec["containers"] + spec.get("initContainers", []):
            where = f"{workload['metadata']['name']}/{container['name']}"
            ctx = {**spec["securityContext"], **container.get("securityContext", {})}
            assert ctx.get("runAsNonRoot") is True and ctx.get("runAsUser") == 10001, where
            assert ctx.get("allowPrivilegeEscalation") is False, where
            assert ctx.get("readOnlyRootFilesystem") is True, where
            assert container.get("securityContext", {}).get("capabilities", {}).get("drop") == ["ALL"], where
            assert {"/tmp", "/home/rlpipe"} <= {m["mountPath"] for m in container.get("volumeMounts", [])}, where


@pytest.mark.parametrize("name", WITH_PODS)
def test_no_pod_gets_service_link_variables(name):
    # Kubernetes would give every pod <SERVICE>_SERVICE_HOST, <SERVICE>_PORT_<n>_TCP_ADDR, ... for each Service
    # of the namespace: Services rlpipe-kafka-bootstrap and rlpipe-api make RLPIPE_KAFKA_BOOTSTRAP_SERVICE_HOST and
    # RLPIPE_API_PORT, which look like run configuration.  rlpipe finds its peers by DNS name, never by these.
    found = pods(rendered(name))
    assert found
    for workload, spec in found:
        assert spec.get("enableServiceLinks") is False, workload["metadata"]["name"]


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_probes_metrics_and_config_agree_on_the_health_port(name):
    for component, workload, container in workloads(rendered(name)):
        port = health_port(container)
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["port"] in ("health", port)
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port)
        assert annotations["prometheus.io/path"] == "/metrics"
        # The process must serve where the probes look: the port reaches it through RLPIPE_ env.
        assert env_of(container)[f"RLPIPE_{component.upper()}__HEALTH_PORT"]["value"] == str(port)


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_commands_resources_and_grace_period(name):
    for component, workload, container in workloads(rendered(name)):
        assert container["command"] == ["rlpipe"]
        assert container["args"] == [component, "start", "--config", "/etc/rlpipe/run.yaml"]
        assert {"cpu", "memory"} <= set(container["resources"]["requests"])
        assert "memory" in container["resources"]["limits"]
        (spec,) = pod_specs(workload)
        # Long enough to flush a partial batch / write a checkpoint after SIGTERM.
        assert spec["terminationGracePeriodSeconds"] >= 60
        assert spec["serviceAccountName"] == "rlpipe"


def test_learner_is_a_single_replica_statefulset_with_a_cache_claim():
    for name in ["base", *OVERLAYS]:
        learner = one(rendered(name), "StatefulSet", "rlpipe-learner")
        assert learner["spec"]["replicas"] == 1
        assert learner["spec"]["serviceName"] == one(rendered(name), "Service", "rlpipe-learner")["metadata"]["name"]
        (claim,) = learner["spec"]["volumeClaimTemplates"]
        mounts = {m["name"]: m["mountPath"] for m in learner["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert mounts[claim["metadata"]["name"]] == "/cache"


def test_service_account_is_bound_to_a_google_service_account():
    account = one(rendered("overlays/gke"), "ServiceAccount", "rlpipe")
    assert account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"].endswith(".iam.gserviceaccount.com")


# GPU placement -------------------------------------------------------------------


def test_gke_requests_one_gpu_per_pod_on_l4_nodes():
    for _, workload, container in workloads(rendered("overlays/gke")):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
        (spec,) = pod_specs(workload)
        assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
        assert container["image"].startswith("us-central1-docker.pkg.dev/")


@pytest.mark.parametrize("name", ON_GKE)
def test_gke_pulls_every_image_from_the_registry(name):
    # An overlay's `images:` rewrites only the resources it renders, a base's included: each GKE kustomization
    # that adds workloads of its own needs the entries too.
    for workload, spec in pods(rendered(name)):
        for container in spec["containers"] + spec.get("initContainers", []):
            assert container["image"].startswith(REGISTRY), f"{workload['metadata']['name']}: {container['image']}"


def test_every_gpu_node_selector_names_a_node_pool_the_readme_creates():
    created = set(re.findall(r"--accelerator=type=([\w-]+)", README.read_text()))
    for name in ON_GKE:
        for workload, spec in pods(rendered(name)):
            accelerator = spec.get("nodeSelector", {}).get("cloud.google.com/gke-accelerator")
            assert accelerator is None or accelerator in created, f"{name}: {workload['metadata']['name']}"


def test_dev_asks_for_no_gpu_anywhere():
    text = yaml.safe_dump_all(rendered("overlays/dev"))
    assert "nvidia.com/gpu:" not in text
    assert "gke-accelerator" not in text
    for _, workload, _ in workloads(rendered("overlays/dev")):
        assert "nodeSelector" not in pod_specs(workload)[0]


# secrets --------------------------------------------------------------------------

SECRET_ENV = re.compile(r"PASSWORD|SECRET|TOKEN|CREDENTIAL|API_KEY|PRIVATE", re.IGNORECASE)
PASSWORD_LITERAL = re.compile(r"(?i)password\s*[:=][ \t]*[^\s{]")  # `password: x`, not `key: password`


def secret_problems(resources: list[dict]) -> list[str]:
    """Every place a secret value could be written literally into the manifests."""
    problems = [f"Secret {r['metadata']['name']} is committed" for r in of_kind(resources, "Secret")]
    text = yaml.safe_dump_all(resources)
    if "-----BEGIN" in text:
        problems.append("key or certificate material")
    if "sasl.jaas.config" in text:
        problems.append("a JAAS config (it embeds the password)")
    problems.extend(f"password literal: {m.group(0)!r}" for m in PASSWORD_LITERAL.finditer(text))
    for resource in resources:
        for spec in pod_specs(resource):
            for container in spec["containers"] + spec.get("initContainers", []):
                for env in container.get("env", []):
                    if SECRET_ENV.search(env["name"]) and "secretKeyRef" not in env.get("valueFrom", {}):
                        problems.append(f"{container['name']}: {env['name']} is not read from a Secret")
        for key, value in resource.get("data", {}).items():
            if key.endswith((".yaml", ".yml")) and "sasl_password" in (yaml.safe_load(value).get("bus") or {}):
                problems.append(f"{resource['metadata']['name']}/{key} holds bus.sasl_password")
    return problems


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_no_literal_secret_in_any_manifest(name):
    assert secret_problems(rendered(name)) == []


def test_the_secret_check_catches_literal_passwords():
    resources = rendered("overlays/gke")
    (_, _, container), _ = workloads(resources)
    env_of(container)["RLPIPE_BUS__SASL_PASSWORD"].pop("valueFrom")
    env_of(container)["RLPIPE_BUS__SASL_PASSWORD"]["value"] = "hunter2"
    config_map = one(resources, "ConfigMap")
    config_map["data"]["run.yaml"] = config_map["data"]["run.yaml"].replace(
        "bus:\n", "bus:\n  sasl_password: hunter2\n")
    problems = secret_problems(resources)
    assert any("RLPIPE_BUS__SASL_PASSWORD is not read from a Secret" in p for p in problems)
    assert any("holds bus.sasl_password" in p for p in problems)
    assert any("password literal" in p for p in problems)


# the run configuration the pods will resolve ------------------------------------------


def pod_environ(container: dict, pod_name: str = "rlpipe-producer-0") -> dict[str, str]:
    """The container's environment variables in pod ``pod_name`` (a Secret's value reads "from-the-secret")."""
    environ = {}
    for env in container.get("env", []):
        if "value" in env:
            environ[env["name"]] = env["value"]
        elif "secretKeyRef" in env["valueFrom"]:
            environ[env["name"]] = "from-the-secret"
        elif "fieldRef" in env["valueFrom"]:
            environ[env["name"]] = pod_name
    return environ


def resolved_config(resources: list[dict], container: dict, tmp_path: Path,
                    pod_name: str = "rlpipe-producer-0") -> RunConfig:
    """What ``rlpipe ... --config /etc/rlpipe/run.yaml`` resolves to inside this container of pod ``pod_name``."""
    (config_map,) = of_kind(resources, "ConfigMap")
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(config_map["data"]["run.yaml"])
    return resolve_config(config_file=run_yaml, environ=pod_environ(container, pod_name))


def command_line_bus(container: dict) -> BusConfig:
    """The bus a command run in the container sees (``kubectl exec ... rlpipe topics lag``, ``rlpipe report``,
    ``rlpipe serve``): ``RLPIPE_BUS__*`` variables only, as ``pipeline.cli.common.bus_config_from_cli`` reads them."""
    return BusConfig.model_validate(env_layer(pod_environ(container)).get("bus", {}))


def mounted_files(workload: dict, container: dict) -> dict[str, tuple[str, str]]:
    """Files projected into the container: path -> (ConfigMap or Secret name, key)."""
    (spec,) = pod_specs(workload)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    files = {}
    for mount in container["volumeMounts"]:
        volume = volumes.get(mount["name"], {})  # absent: a StatefulSet's volumeClaimTemplate
        for source in volume.get("projected", {}).get("sources", []):
            ref = source.get("configMap") or source.get("secret")
            for item in ref.get("items", []):
                files[f"{mount['mountPath']}/{item['path']}"] = (ref["name"], item["key"])
    return files


@pytest.mark.parametrize("name", OVERLAYS)
def test_pods_resolve_a_valid_run_config_that_matches_the_cluster(name, tmp_path):
    resources = rendered(name)
    kafka = one(resources, "Kafka")
    cluster = kafka["metadata"]["name"]
    tls_listener = next(x for x in kafka["spec"]["kafka"]["listeners"] if x["tls"])
    user = one(resources, "KafkaUser")
    configs = {}
    for component, workload, container in workloads(resources):
        config = resolved_config(resources, container, tmp_path)
        configs[component] = config
        bus = config.bus
        assert bus.bootstrap_servers == f"{cluster}-kafka-bootstrap:{tls_listener['port']}"
        assert bus.security_protocol == "SASL_SSL"
        assert bus.sasl_mechanism == "SCRAM-SHA-512" and user["spec"]["authentication"]["type"] == "scram-sha-512"
        assert bus.sasl_username == user["metadata"]["name"]
        assert bus.sasl_password.get_secret_value() == "from-the-secret"
        # Strimzi's User Operator names the password Secret after the KafkaUser.
        secret_ref = env_of(container)["RLPIPE_BUS__SASL_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert (secret_ref["name"], secret_ref["key"]) == (user["metadata"]["name"], "password")
        # The CA file the client trusts is Strimzi's cluster CA, mounted where the config says.
        files = mounted_files(workload, container)
        assert files[bus.ssl_cafile] == (f"{cluster}-cluster-ca-cert", "ca.crt")
        assert "/etc/rlpipe/run.yaml" in files
        assert getattr(config, component).health_port == health_port(container)
    producer = configs["producer"]
    assert producer.producer.producer_id == "rlpipe-producer-0"
    # Both pods serve the same run: everything but their own section (health port, id) is equal.
    sections = {"producer", "learner"}
    assert configs["learner"].model_dump(exclude=sections) == producer.model_dump(exclude=sections)


@pytest.mark.parametrize("name", WITH_PODS)
def test_commands_run_in_a_pod_see_the_bus_its_process_uses(name, tmp_path):
    # `kubectl exec POD -- rlpipe topics lag` (or report, or serve) takes no --config: the pod's environment alone
    # must name the cluster, the listener, the user and the CA, and agree with what run.yaml + environment resolve to.
    strimzi = rendered("kafka")
    cluster = one(strimzi, "Kafka")["metadata"]["name"]
    tls_listener = next(x for x in one(strimzi, "Kafka")["spec"]["kafka"]["listeners"] if x["tls"])
    user = one(strimzi, "KafkaUser")["metadata"]["name"]
    resources = rendered(name)
    for workload, spec in pods(resources):
        for container in spec["containers"]:
            bus = command_line_bus(container)
            assert bus.bootstrap_servers == f"{cluster}-kafka-bootstrap:{tls_listener['port']}"
            assert (bus.security_protocol, bus.sasl_mechanism, bus.sasl_username) == ("SASL_SSL", "SCRAM-SHA-512", user)
            assert bus.sasl_password.get_secret_value() == "from-the-secret"
            files = mounted_files(workload, container)
            assert files[bus.ssl_cafile] == (f"{cluster}-cluster-ca-cert", "ca.crt")
            if "/etc/rlpipe/run.yaml" in files:
                process_bus = resolved_config(resources, container, tmp_path).bus
                assert process_bus.model_dump(include=BUS_CONNECTION) == bus.model_dump(include=BUS_CONNECTION)


def test_dev_learner_builds_the_tiny_model_before_it_loads_it(tmp_path):
    # The producer builds it too (producers.tiny_model.resolve_model); two builders are safe: each builds into a
    # temporary folder and renames it into place, and the second finds the first one's model.
    resources = rendered("overlays/dev")
    (spec,) = pod_specs(one(resources, "StatefulSet", "rlpipe-learner"))
    (container,) = [c for c in spec["containers"] if c["name"] == "learner"]
    tiny_dir = resolved_config(resources, container, tmp_path).model.tiny_dir
    (init,) = spec["initContainers"]
    assert init["image"] == container["image"]
    assert [*init["command"], *init["args"]] == ["rlpipe", "model", "init-tiny", "--out", tiny_dir]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (volume,) = [v for v, path in mounts.items() if tiny_dir.startswith(path + "/")]
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]}[volume] == mounts[volume]


def test_gke_learner_keeps_its_tensorboard_files_on_its_persistent_volume(tmp_path):
    # With a gs:// store the default is $RLPIPE_HOME/tensorboard, under the home folder: an emptyDir.
    resources = rendered("overlays/gke")
    learner = one(resources, "StatefulSet", "rlpipe-learner")
    (container,) = [c for component, _, c in workloads(resources) if component == "learner"]
    folder = resolved_config(resources, container, tmp_path).learner.tensorboard_dir
    claims = {claim["metadata"]["name"] for claim in learner["spec"]["volumeClaimTemplates"]}
    persistent = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in claims]
    assert folder and any(folder.startswith(path + "/") for path in persistent)


@pytest.mark.parametrize("name", OVERLAYS)
def test_each_producer_replica_plays_its_own_training_seeds(name, tmp_path):
    resources = rendered(name)
    # A StatefulSet names its pods <name>-0, <name>-1, ...: the ordinal picks the seed range.
    producer = one(resources, "StatefulSet", "rlpipe-producer")
    assert producer["spec"]["serviceName"] == one(resources, "Service", "rlpipe-producer")["metadata"]["name"]
    (spec,) = pod_specs(producer)
    (container,) = [c for c in spec["containers"] if c["name"] == "producer"]
    assert env_of(container)["RLPIPE_PRODUCER__PRODUCER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    autoscalers = of_kind(resources, "HorizontalPodAutoscaler")
    replicas = autoscalers[0]["spec"]["maxReplicas"] if autoscalers else producer["spec"]["replicas"]
    seen: set[int] = set()
    for ordinal in range(replicas):
        config = resolved_config(resources, container, tmp_path, pod_name=f"{producer['metadata']['name']}-{ordinal}")
        seeds = config.training_seeds(config.producer.producer_id)
        assert len(seeds) >= 1000 and seeds.stop <= config.env.eval_seed_offset
        assert not seen & set(seeds), f"replica {ordinal} shares seeds with another replica"
        seen |= set(seeds)


def test_dev_runs_the_tiny_model_on_cpu_with_a_file_store(tmp_path):
    resources = rendered("overlays/dev")
    pvc = one(resources, "PersistentVolumeClaim", "rlpipe-data")
    for _, workload, container in workloads(resources):
        config = resolved_config(resources, container, tmp_path)
        assert config.sampler.backend == "transformers"
        assert config.model.base_model == "tiny"
        assert config.learner.device == "cpu"
        assert config.store.root == "file:///data/store"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        (spec,) = pod_specs(workload)
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
                  if "persistentVolumeClaim" in v}
        data_volume = next(v for v, claim in claims.items() if claim == pvc["metadata"]["name"])
        assert config.store.root.removeprefix("file://").startswith(mounts[data_volume])
        assert config.model.tiny_dir.startswith(mounts[data_volume])  # built once, shared by both pods


def test_gke_runs_a_real_model_with_vllm_on_gcs(tmp_path):
    resources = rendered("overlays/gke")
    for _, _, container in workloads(resources):
        config = resolved_config(resources, container, tmp_path)
        assert config.sampler.backend == "vllm"
        assert config.model.base_model == "Qwen/Qwen2.5-0.5B-Instruct"
        assert config.store.root.startswith("gs://")
        assert config.learner.device == "cuda"


# Strimzi ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kafka", *OVERLAYS])
def test_strimzi_cluster_is_kraft_with_node_pools(name):
    resources = rendered(name)
    kafka = one(resources, "Kafka")
    assert kafka["apiVersion"] == STRIMZI_API
    assert kafka["metadata"]["annotations"] == {"strimzi.io/kraft": "enabled", "strimzi.io/node-pools": "enabled"}
    assert "zookeeper" not in kafka["spec"]
    assert kafka["spec"]["kafka"]["config"]["auto.create.topics.enable"] is False
    assert {"topicOperator", "userOperator"} <= set(kafka["spec"]["entityOperator"])
    pool = one(resources, "KafkaNodePool")
    assert pool["apiVersion"] == STRIMZI_API
    assert pool["metadata"]["labels"]["strimzi.io/cluster"] == kafka["metadata"]["name"]
    assert set(pool["spec"]["roles"]) == {"controller", "broker"}
    # Durability: min.insync.replicas must leave one replica to lose.
    config = kafka["spec"]["kafka"]["config"]
    assert config["min.insync.replicas"] <= config["default.replication.factor"] <= pool["spec"]["replicas"]
    for listener in kafka["spec"]["kafka"]["listeners"]:
        assert listener["authentication"]["type"] == "scram-sha-512"  # no anonymous listener


@pytest.mark.parametrize("name", ["kafka", *OVERLAYS])
def test_topics_are_the_four_rlpipe_topics_with_sane_settings(name):
    resources = rendered(name)
    cluster = one(resources, "Kafka")["metadata"]["name"]
    brokers = one(resources, "KafkaNodePool")["spec"]["replicas"]
    topics = {t["spec"]["topicName"]: t for t in of_kind(resources, "KafkaTopic")}
    assert sorted(topics) == sorted(all_topics("rlpipe"))
    for topic in topics.values():
        spec = topic["spec"]
        assert topic["apiVersion"] == STRIMZI_API
        assert topic["metadata"]["labels"]["strimzi.io/cluster"] == cluster
        assert spec["partitions"] >= 1
        assert 1 <= spec["replicas"] <= brokers
        assert spec["config"]["min.insync.replicas"] <= spec["replicas"]
        assert spec["config"]["max.message.bytes"] == ONE_MIB
        assert spec["config"]["cleanup.policy"] == "delete"
    retention = {name.split(".")[1]: t["spec"]["config"]["retention.ms"] for name, t in topics.items()}
    assert retention["trajectories"] >= 30 * DAY_MS
    assert retention["dlq"] >= 30 * DAY_MS
    assert retention["control"] < retention["trajectories"]


def test_dev_kafka_is_one_ephemeral_node():
    resources = rendered("overlays/dev")
    pool = one(resources, "KafkaNodePool")
    assert pool["spec"]["replicas"] == 1 and pool["spec"]["storage"]["type"] == "ephemeral"
    assert all(t["spec"]["replicas"] == 1 for t in of_kind(resources, "KafkaTopic"))
    assert one(resources, "Kafka")["spec"]["kafka"]["config"]["offsets.topic.replication.factor"] == 1


def test_kafka_user_may_use_exactly_the_rlpipe_namespace_and_the_api_groups():
    user = one(rendered("kafka"), "KafkaUser")
    assert user["apiVersion"] == STRIMZI_API and user["metadata"]["labels"]["strimzi.io/cluster"] == "rlpipe"
    acls = {(a["resource"]["type"], a["resource"].get("name"), a["resource"].get("patternType")): a["operations"]
            for a in user["spec"]["authorization"]["acls"]}
    assert {"Read", "Write"} <= set(acls[("topic", "rlpipe.", "prefix")])
    assert "Read" in acls[("group", "rlpipe", "prefix")]
    # The API's engines read <ns>.requests in groups named after their namespace and base model's digest
    # (pipeline/api/engines.py engine_group), and read the un-namespaced groups of earlier releases at each start
    # until their own group has committed an offset.
    for group in ("api-trainer-rlpipe-0123456789abcdef", "api-sampler-rlpipe-0123456789abcdef",
                  "api-trainer-0123456789abcdef", "api-sampler-0123456789abcdef"):
        assert any(kind == "group" and pattern == "prefix" and group.startswith(prefix) and "Read" in operations
                   for (kind, prefix, pattern), operations in acls.items()), group
    # nothing broader than rlpipe's topics and groups and the API's two groups
    assert all(name in (None, "rlpipe", "rlpipe.", "api-trainer-", "api-sampler-") for _, name, _ in acls)


# autoscaling -------------------------------------------------------------------------


def test_gke_autoscales_producers_on_the_adapter_metric():
    resources = rendered("overlays/gke")
    hpa = one(resources, "HorizontalPodAutoscaler")
    producer = one(resources, "StatefulSet", "rlpipe-producer")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", producer["metadata"]["name"])
    assert "replicas" not in producer["spec"]  # the HPA owns the count; apply must not reset it
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["selector"]["matchLabels"]["topic"] == "rlpipe.trajectories"
    values = yaml.safe_load((K8S / "overlays/gke/prometheus-adapter-values.yaml").read_text())
    names = [rule["name"]["as"] for rule in values["rules"]["external"]]
    assert metric["external"]["metric"]["name"] in names
    # The lag series come from Strimzi's Kafka Exporter, which must be on.
    assert "kafkaExporter" in one(resources, "Kafka")["spec"]
    # The rule must select the learner's consumer group, which the KafkaUser's ACLs must allow.
    learner_group = "rlpipe-learner-cartpole-qwen05b"  # consumers.sources.learner_group_id (importing it pulls torch)
    (query,) = [rule["metricsQuery"] for rule in values["rules"]["external"]]
    assert re.fullmatch(re.search(r'consumergroup=~"([^"]+)"', query).group(1), learner_group)
    user = one(resources, "KafkaUser")
    group_prefixes = [a["resource"]["name"] for a in user["spec"]["authorization"]["acls"]
                      if a["resource"]["type"] == "group"]
    assert any(learner_group.startswith(prefix) for prefix in group_prefixes)


def test_dev_has_no_autoscaler():
    assert not of_kind(rendered("overlays/dev"), "HorizontalPodAutoscaler")
