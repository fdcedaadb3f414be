"""The kustomize renderer the manifest tests stand on: strategic merges, JSON 6902 patches, generators."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.infra.kustomize_render import KustomizeError, one, render


def _kustomize_tree(tmp_path: Path, base: str, overlay: str, files: dict[str, str] | None = None) -> Path:
    (tmp_path / "base").mkdir()
    (tmp_path / "overlay").mkdir()
    (tmp_path / "base/kustomization.yaml").write_text(base)
    (tmp_path / "overlay/kustomization.yaml").write_text(overlay)
    for path, text in (files or {}).items():
        (tmp_path / path).write_text(text)
    return tmp_path / "overlay"


DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: app}
spec:
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec:
      nodeSelector: {gpu: l4}
      containers:
        - name: c
          image: img:1
          env: [{name: A, value: "1"}, {name: B, value: "2"}]
          resources: {limits: {memory: 1Gi, nvidia.com/gpu: 1}}
          volumeMounts: [{name: v, mountPath: /v}]
      volumes: [{name: v, emptyDir: {}}]
"""


def test_renderer_strategic_merge_semantics(tmp_path):
    overlay = _kustomize_tree(
        tmp_path,
        "resources: [app.yaml]\n",
        "resources: [../base]\npatches: [{path: p.yaml}]\nimages: [{name: img, newName: reg/img, newTag: '2'}]\n",
        {
            "base/app.yaml": DEPLOYMENT,
            "overlay/p.yaml": """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: app}
spec:
  template:
    spec:
      nodeSelector: null
      containers:
        - name: c
          env: [{name: B, value: "3"}, {name: A, $patch: delete}, {name: C, value: "4"}]
          resources: {limits: {nvidia.com/gpu: null}}
""",
        },
    )
    (deployment,) = render(overlay)
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert "nodeSelector" not in spec  # null deletes
    assert container["env"] == [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}]  # merged by name
    assert container["resources"]["limits"] == {"memory": "1Gi"}
    assert container["volumeMounts"] == [{"name": "v", "mountPath": "/v"}]  # untouched fields stay
    assert container["image"] == "reg/img:2"


def test_renderer_json6902_generator_hash_and_refusals(tmp_path):
    overlay = _kustomize_tree(
        tmp_path,
        "namespace: ns\nresources: [app.yaml]\nconfigMapGenerator: [{name: cfg, files: [run.yaml]}]\n",
        "resources: [../base]\nconfigMapGenerator: [{name: cfg, behavior: replace, files: [run.yaml]}]\n"
        "patches:\n  - target: {kind: Deployment, name: app}\n"
        "    patch: '[{op: replace, path: /spec/template/spec/volumes/0, value: {name: v, configMap: {name: cfg}}}]'\n",
        {"base/app.yaml": DEPLOYMENT, "base/run.yaml": "a: 1\n", "overlay/run.yaml": "a: 2\n"},
    )
    resources = render(overlay)
    config_map = one(resources, "ConfigMap")
    assert config_map["data"] == {"run.yaml": "a: 2\n"}
    assert re.fullmatch(r"cfg-[0-9a-f]{10}", config_map["metadata"]["name"])
    volume = one(resources, "Deployment")["spec"]["template"]["spec"]["volumes"][0]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]  # reference follows the hash
    assert {r["metadata"]["namespace"] for r in resources} == {"ns"}

    (tmp_path / "overlay/kustomization.yaml").write_text("resources: [../base]\ncommonLabels: {a: b}\n")
    with pytest.raises(KustomizeError, match="unsupported keys"):
        render(overlay)
    (tmp_path / "overlay/kustomization.yaml").write_text("resources: [../base]\npatches: [{path: p.yaml}]\n")
    (tmp_path / "overlay/p.yaml").write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: nope}\n")
    with pytest.raises(KustomizeError, match="matches no resource"):
        render(overlay)
