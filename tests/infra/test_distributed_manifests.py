"""The learner as a torchrun group on Kubernetes (overlays/gke-distributed): valid, and its pods agree on the group."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from tests.infra.kustomize_render import is_builtin, render

OVERLAY = Path(__file__).resolve().parents[2] / "infra" / "k8s" / "overlays" / "gke-distributed"


@pytest.fixture(scope="module")
def resources() -> list[dict]:
    return list(render(OVERLAY))


def find(resources: list[dict], kind: str, name: str) -> dict:
    (found,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def test_renders_and_matches_the_kubernetes_schemas(resources):
    version = kubernetes_validate.latest_version()
    for resource in filter(is_builtin, resources):
        if not resource["apiVersion"].startswith("kafka.strimzi.io"):
            kubernetes_validate.validate(resource, version, strict=True)


def test_the_group_replaces_the_single_learner(resources):
    assert find(resources, "StatefulSet", "rlpipe-learner")["spec"]["replicas"] == 0


def test_indexed_job_and_headless_service_give_torchrun_its_rendezvous(resources):
    job = find(resources, "Job", "rlpipe-learner-group")
    service = find(resources, "Service", "rlpipe-learner-group")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    (container,) = pod["containers"]
    args = dict(a.split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)
    assert container["command"] == ["torchrun"] and int(args["--nnodes"]) == spec["completions"]
    host, port = args["--rdzv-endpoint"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) in {p["containerPort"] for p in container["ports"]}
    assert int(args["--max-restarts"]) >= 1


def test_one_gpu_per_pod_on_gpu_nodes_with_their_taint_tolerated(resources):
    pod = find(resources, "Job", "rlpipe-learner-group")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "cloud.google.com/gke-accelerator" in pod["nodeSelector"]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--nproc-per-node=1" in container["args"]


def test_torchrun_gives_the_ranks_the_pods_grace_period_to_checkpoint(resources):
    """On SIGTERM torchrun signals the ranks and kills them after its shutdown timeout (30 s unless set); rank 0
    finishes its step and checkpoints in the pod's grace period, so the timeout takes most of it, ending first."""
    from torch.distributed.run import get_args_parser

    pod = find(resources, "Job", "rlpipe-learner-group")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    timeout = get_args_parser().parse_args(container["args"]).shutdown_timeout or 30
    grace = pod["terminationGracePeriodSeconds"]
    assert grace - 30 <= timeout < grace, f"torchrun --shutdown-timeout={timeout} with a grace period of {grace} s"
