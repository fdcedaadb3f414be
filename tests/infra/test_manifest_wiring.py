"""What the manifests name must exist: the command lines the containers run, the variables they set, the
ConfigMaps, Secrets, claims, service accounts, Services and ports they refer to, and the rendering itself
(compared with the real kustomize where ``kubectl`` is installed)."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from typing import Any

import click
import pytest
import typer
import yaml

from pipeline.config import PROCESS_ENV, config_env_names
from tests.infra.kustomize_render import of_kind, pod_specs, render
from tests.infra.test_dockerfiles import DOCKERFILES, instructions
from tests.infra.test_manifests import K8S, KUSTOMIZATIONS, ON_GKE, README, WITH_PODS, pods, rendered
from tests.pipeline.test_cli_tree import command_tree

# Applied next to another kustomization, whose resources it uses (infra/README.md, "The Tinker-compatible API").
COMPANION = {"api": "overlays/gke"}
# Variables the containers set for a library rather than for rlpipe: name -> who reads it.
LIBRARY_ENV = {"HF_HUB_OFFLINE": "huggingface_hub: load the model from the hub cache only"}


def containers(spec: dict) -> list[dict]:
    return spec["containers"] + spec.get("initContainers", [])


def in_scope(name: str) -> list[dict]:
    """The resources a pod of kustomization ``name`` can refer to: its own and its companion's."""
    return rendered(name) + (rendered(COMPANION[name]) if name in COMPANION else [])


# command lines ------------------------------------------------------------------------


def parse_rlpipe(words: list[str]) -> str:
    """Parse ``rlpipe WORDS`` with the real command tree; returns the command's path (``learner start``).

    A usage error (an unknown command or option, a missing value, a value of the wrong type) fails the test."""
    tree = command_tree()
    path = next((" ".join(words[:n]) for n in (3, 2, 1) if " ".join(words[:n]) in tree), None)
    if path is None:
        pytest.fail(f"rlpipe {' '.join(words)}: no such command")
    rest = words[len(path.split()):]
    if rest[-1:] == ["--help"]:  # an image's default CMD: the help of its command
        rest = rest[:-1]
    try:
        tree[path].make_context(f"rlpipe {path}", list(rest))
    except (typer.TyperException, click.UsageError) as exc:  # typer >= 0.26 carries its own click
        pytest.fail(f"rlpipe {' '.join(words)}: {exc}")
    return path


def parse_torchrun(args: list[str]) -> list[str]:
    """Parse ``torchrun ARGS`` with torchrun's own parser; returns the command line it starts on each rank."""
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    assert parsed.no_python, "torchrun must start the rlpipe command itself (--no-python)"
    return [parsed.training_script, *parsed.training_script_args]


def command_line(container: dict) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


@pytest.mark.parametrize("name", WITH_PODS)
def test_every_container_runs_a_real_command_line(name):
    checked = 0
    for workload, spec in pods(rendered(name)):
        for container in containers(spec):
            words = command_line(container)
            where = f"{workload['metadata']['name']}/{container['name']}"
            if words[0] == "torchrun":
                words = parse_torchrun(words[1:])
            if words[0] == "rlpipe":
                parse_rlpipe(words[1:])
            else:  # a download before the engine starts: valid Python
                assert words[:2] == ["python3", "-c"], where
                ast.parse(words[2])
            checked += 1
    assert checked


def test_the_command_line_check_catches_a_misspelt_option():
    parse_rlpipe(["serve", "--role", "sampler", "--health-port", "8080"])
    with pytest.raises(pytest.fail.Exception, match="--helth-port"):
        parse_rlpipe(["serve", "--role", "sampler", "--helth-port", "8080"])
    with pytest.raises(pytest.fail.Exception, match="8o80"):
        parse_rlpipe(["serve", "--health-port", "8o80"])
    with pytest.raises(pytest.fail.Exception, match="no such command"):
        parse_rlpipe(["lerner", "start"])


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_image_runs_a_real_command_by_default(path):
    steps = instructions(path)
    (entrypoint,) = [json.loads(a) for kind, a in steps if kind == "ENTRYPOINT"]
    (cmd,) = [json.loads(a) for kind, a in steps if kind == "CMD"]
    assert entrypoint == ["rlpipe"]
    assert parse_rlpipe(cmd) == f"{path.name.removesuffix('.Dockerfile')} start"


# environment ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", WITH_PODS)
def test_every_variable_a_container_sets_is_read(name):
    read = config_env_names() | set(PROCESS_ENV) | set(LIBRARY_ENV)
    for workload, spec in pods(rendered(name)):
        for container in containers(spec):
            unread = [e["name"] for e in container.get("env", []) if e["name"] not in read]
            assert not unread, f"{workload['metadata']['name']}/{container['name']} sets {unread}, read by nothing"


# references ----------------------------------------------------------------------------


def made_elsewhere(resources: list[dict]) -> set[str]:
    """Secrets made outside the manifests: Strimzi's (the KafkaUser's password, the cluster CA certificate) and
    those infra/README.md creates with ``kubectl create secret generic NAME``."""
    strimzi = {u["metadata"]["name"] for u in of_kind(resources, "KafkaUser")}
    strimzi |= {f"{k['metadata']['name']}-cluster-ca-cert" for k in of_kind(resources, "Kafka")}
    return strimzi | set(re.findall(r"create secret generic ([\w.-]+)", README.read_text()))


def references(spec: dict) -> dict[str, set[str]]:
    """kind -> names of the ConfigMaps, Secrets, claims and service account a pod spec refers to."""
    found: dict[str, set[str]] = {"ConfigMap": set(), "Secret": set(), "PersistentVolumeClaim": set(),
                                  "ServiceAccount": {spec.get("serviceAccountName", "default")}}
    for volume in spec.get("volumes", []):
        sources = volume.get("projected", {}).get("sources", []) + [volume]
        for source in sources:
            if "configMap" in source:
                found["ConfigMap"].add(source["configMap"]["name"])
            if "secret" in source:
                found["Secret"].add(source["secret"].get("name") or source["secret"].get("secretName"))
        if "persistentVolumeClaim" in volume:
            found["PersistentVolumeClaim"].add(volume["persistentVolumeClaim"]["claimName"])
    for container in containers(spec):
        for env in container.get("env", []):
            for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                if key in env.get("valueFrom", {}):
                    found[kind].add(env["valueFrom"][key]["name"])
        for source in container.get("envFrom", []):
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in source:
                    found[kind].add(source[key]["name"])
    return found


@pytest.mark.parametrize("name", WITH_PODS)
def test_every_config_map_secret_claim_and_service_account_a_pod_names_exists(name):
    scope = in_scope(name)
    existing = {kind: {r["metadata"]["name"] for r in of_kind(scope, kind)}
                for kind in ("ConfigMap", "Secret", "PersistentVolumeClaim", "ServiceAccount")}
    existing["Secret"] |= made_elsewhere(scope)
    for workload, spec in pods(rendered(name)):
        for kind, names in references(spec).items():
            missing = names - existing[kind]
            assert not missing, f"{name}: {workload['metadata']['name']} names {kind} {sorted(missing)}"


@pytest.mark.parametrize("name", WITH_PODS)
def test_every_mount_names_a_volume_and_every_probe_a_port(name):
    for workload, spec in pods(rendered(name)):
        volumes = {v["name"] for v in spec.get("volumes", [])}
        volumes |= {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
        for container in containers(spec):
            where = f"{name}: {workload['metadata']['name']}/{container['name']}"
            assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes, where
            ports = {p.get("name") for p in container.get("ports", [])} | {
                p["containerPort"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe in container:
                    assert container[probe]["httpGet"]["port"] in ports, f"{where} {probe}"
        annotated = workload["spec"]["template"].get("metadata", {}).get("annotations", {}).get("prometheus.io/port")
        if annotated:
            assert any(int(annotated) == p["containerPort"] for c in spec["containers"] for p in c.get("ports", []))


@pytest.mark.parametrize("name", WITH_PODS)
def test_selectors_services_and_scale_targets_reach_their_pods(name):
    resources = rendered(name)
    workloads = [r for r in resources if pod_specs(r)]
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selector = workload["spec"].get("selector", {}).get("matchLabels", {})
        assert selector.items() <= labels.items(), workload["metadata"]["name"]
        if workload["kind"] == "StatefulSet":
            service = [s for s in of_kind(resources, "Service") if s["metadata"]["name"] == workload["spec"]["serviceName"]]
            assert service and service[0]["spec"].get("clusterIP") == "None", workload["metadata"]["name"]
    for service in of_kind(resources, "Service"):
        selected = [w for w in workloads
                    if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            assert all(any(target in (p.get("name"), p["containerPort"]) for c in pod_specs(w)[0]["containers"]
                           for p in c.get("ports", [])) for w in selected), f"{service['metadata']['name']}: {target}"
    for hpa in of_kind(resources, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert any((w["kind"], w["metadata"]["name"]) == (ref["kind"], ref["name"]) for w in workloads)


@pytest.mark.parametrize("name", WITH_PODS)
def test_liveness_is_asked_only_once_the_process_first_answered(name):
    """A Python process answers its probes only after its imports (torch, transformers, peft; fastapi and the
    Kafka client for the gateway), which on a cold node can take past a liveness probe's minute: a startup probe
    of the same endpoint gives it minutes, and liveness is asked from its first answer on."""
    checked = 0
    for workload, spec in pods(rendered(name)):
        for container in spec["containers"]:
            if "livenessProbe" not in container:
                continue
            where = f"{name}: {workload['metadata']['name']}/{container['name']}"
            startup = container.get("startupProbe")
            assert startup, f"{where} has a liveness probe and no startup probe"
            assert startup["httpGet"] == container["livenessProbe"]["httpGet"], where
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, where
            checked += 1
    assert checked


# metrics and shared memory ---------------------------------------------------------------

# The variables that make a producer or a learner serve /metrics (pipeline/health.py) on their port.
METRICS_PORT_ENV = ("RLPIPE_PRODUCER__HEALTH_PORT", "RLPIPE_LEARNER__HEALTH_PORT")
# The kustomizations running producers or learners (k8s/api's engines answer probes only).
WITH_METRICS = [name for name in WITH_PODS if name != "api"]
QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti)?$")


def metrics_port(container: dict) -> int | None:
    """The port a container serves /metrics on, if it runs a producer or a learner with a health port."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    ports = [int(env[name]) for name in METRICS_PORT_ENV if env.get(name)]
    return ports[0] if ports else None


def quantity_bytes(value: str) -> int:
    match = QUANTITY.match(str(value))
    assert match, f"{value!r}: write memory quantities as a whole number of Ki, Mi, Gi or Ti"
    return int(match.group(1)) * 1024 ** (1 + ("Ki", "Mi", "Gi", "Ti").index(match.group(2)) if match.group(2) else 0)


def several_processes_on_gpus(container: dict) -> bool:
    """A torchrun group (nccl between its ranks) or a container holding more than one GPU."""
    gpus = int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
    return command_line(container)[:1] == ["torchrun"] or gpus > 1


@pytest.mark.parametrize("name", WITH_METRICS)
def test_every_workload_serving_metrics_is_scrapeable(name):
    """Prometheus' ``kubernetes-pods`` job (infra/README.md) scrapes the pods whose template says where."""
    checked = 0
    for workload, spec in pods(rendered(name)):
        served = {metrics_port(c) for c in spec["containers"]} - {None}
        if not served:
            continue
        where = f"{name}: {workload['kind']} {workload['metadata']['name']}"
        annotations = workload["spec"]["template"].get("metadata", {}).get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", \
            f"{where} serves /metrics on {sorted(served)} but its pods carry no prometheus.io/scrape annotation"
        assert int(annotations.get("prometheus.io/port", 0)) in served, f"{where}: prometheus.io/port"
        assert annotations.get("prometheus.io/path") == "/metrics", f"{where}: prometheus.io/path"
        checked += 1
    assert checked


@pytest.mark.parametrize("name", WITH_PODS)
def test_several_processes_on_gpus_get_a_bounded_shared_memory_from_memory(name):
    """nccl and torch's worker processes exchange data through /dev/shm, 64 MiB in a container unless a volume
    replaces it; a memory-backed emptyDir counts against the container's memory limit, so it is bounded below it."""
    for workload, spec in pods(rendered(name)):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in containers(spec):
            where = f"{name}: {workload['metadata']['name']}/{container['name']}"
            shm = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            if several_processes_on_gpus(container):
                assert shm, f"{where} runs several processes on GPUs with the container's 64 MiB /dev/shm; " \
                            "mount an emptyDir with medium: Memory and a sizeLimit at /dev/shm"
            for mount in shm:
                empty = volumes[mount["name"]].get("emptyDir", {})
                assert empty.get("medium") == "Memory" and empty.get("sizeLimit"), f"{where}: /dev/shm"
                limit = container.get("resources", {}).get("limits", {}).get("memory")
                assert limit and quantity_bytes(empty["sizeLimit"]) < quantity_bytes(limit), \
                    f"{where}: /dev/shm's sizeLimit must stay below the container's memory limit"


# the rendering ---------------------------------------------------------------------------


def keyed(value: Any) -> Any:
    """``value`` with lists of named items turned into maps by name (kustomize and the renderer merge them in a
    different order) and the ConfigMap's hash suffix (each computes its own) dropped."""
    if isinstance(value, dict):
        return {k: keyed(v) for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) and ("name" in v or "mountPath" in v)
                                                 for v in value):
        return {v.get("name", v.get("mountPath")) + "|" + v.get("mountPath", ""): keyed(v) for v in value}
    if isinstance(value, list):
        return [keyed(v) for v in value]
    if isinstance(value, str):
        return re.sub(r"^rlpipe-run-[0-9a-z]{10}$", "rlpipe-run-<hash>", value)
    return value


def by_identity(resources: list[dict]) -> dict[tuple[str, str], Any]:
    return {(r["kind"], keyed(r["metadata"]["name"])): keyed(r) for r in resources}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_renderer_agrees_with_kustomize(name):
    built = subprocess.run(["kubectl", "kustomize", str(K8S / name)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    assert by_identity(rendered(name)) == by_identity(list(yaml.safe_load_all(built.stdout)))


# infra/README.md's GKE steps -------------------------------------------------------------

SED = re.compile(r"""grep -rl (\S+) infra/k8s \| xargs sed -i "s/([^/]+)/([^/]+)/g\"""")
ASSIGNMENT = re.compile(r"^(?:export )?((?:\w+=\S+ ?)+)$")


def expand(text: str, variables: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` of ``text`` replaced as the shell would."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables[m.group(1)], text)


def readme_steps(project: str, region: str) -> tuple[dict[str, str], list[tuple[str, str]], set[str]]:
    """The GKE steps of infra/README.md for ``project`` in ``region``: their shell variables, the replacements
    they make in infra/k8s, and the images they push."""
    lines = README.read_text().split("## GKE, step by step", 1)[1].split("### 5.", 1)[0].splitlines()
    variables: dict[str, str] = {}
    for line in map(str.strip, lines):
        if match := ASSIGNMENT.match(line):
            for word in match.group(1).split():
                name, value = word.split("=", 1)
                variables[name] = expand(value, variables)
            variables |= {"PROJECT_ID": project, "REGION": region}  # what a user edits in the first line
    replacements = [(old, expand(new, variables)) for found, old, new in SED.findall("\n".join(lines))
                    if found == old]
    pushed = {expand(image, variables) for image in re.findall(r"docker push (\S+)", "\n".join(lines))}
    return variables, replacements, pushed


def test_the_readme_steps_point_every_gke_manifest_at_your_project_and_region(tmp_path):
    variables, replacements, pushed = readme_steps("proj-b", "europe-west4")
    assert replacements and pushed
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    for path in copy.rglob("*.yaml"):
        text = path.read_text()
        for old, new in replacements:
            text = text.replace(old, new)
        path.write_text(text)
    for name in ON_GKE:
        resources = render(copy / name)
        for workload, spec in pods(resources):
            for container in containers(spec):
                assert container["image"] in pushed, f"{name}: {workload['metadata']['name']} runs {container['image']}"
                store = {e["name"]: e.get("value") for e in container.get("env", [])}.get("RLPIPE_STORE__ROOT")
                assert store is None or store.startswith(f"gs://{variables['BUCKET']}/"), store
        for account in of_kind(resources, "ServiceAccount"):
            assert account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"] == variables["GSA"]
