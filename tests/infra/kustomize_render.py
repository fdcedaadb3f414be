"""A small kustomize renderer for the manifest tests: only what infra/k8s uses.

Why not the real binary: no pinned ``kustomize`` is installable from PyPI (the
``kustomize`` package there is an unrelated Python re-implementation), and the
tests must run offline. Why it is enough: infra/k8s keeps to a small subset, and
this renderer refuses anything outside it (an unknown kustomization key, a
strategic-merge patch on a custom resource, a JSON-patch op it does not know)
instead of rendering it wrongly, so a kustomization that outgrows it fails the
tests loudly.

Supported: ``resources`` (files and directories), ``namespace``, ``labels``
(``pairs`` with ``includeSelectors: false``, optional ``includeTemplates``),
``images``, ``configMapGenerator`` (``files``/``literals``; ``behavior`` create,
replace or merge; name-suffix hash and the rewrite of references in pod specs),
``generatorOptions.disableNameSuffixHash``, and ``patches`` (strategic merge on
built-in kinds, RFC 6902 JSON patches with a ``target`` on any kind).

Differences from kustomize that the tests do not depend on: the hash suffix is a
sha256 prefix (kustomize uses its own encoding), and output order is load order.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

SUPPORTED_KEYS = {
    "apiVersion", "kind", "resources", "namespace", "labels", "images",
    "configMapGenerator", "generatorOptions", "patches",
}
CLUSTER_SCOPED_KINDS = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
    "PersistentVolume", "StorageClass", "PriorityClass",
}
# Strategic-merge keys of the list fields our patches touch (from the Kubernetes API's
# patchMergeKey markers); any other list in a patch replaces the original list whole.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "imagePullSecrets": "name"}
_HASH_MARK = "kustomize-render.test/needs-hash"


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not support, or is inconsistent."""


def render(directory: str | Path) -> list[Resource]:
    """Every resource the kustomization in ``directory`` produces, as plain dicts."""
    resources = _build(Path(directory))
    _finish_generated(resources)
    _check_unique(resources)
    return resources


# building one level -------------------------------------------------------------


def _build(directory: Path) -> list[Resource]:
    kustomization = _load_kustomization(directory)
    resources: list[Resource] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        resources.extend(_build(path) if path.is_dir() else _load_documents(path))
    options = kustomization.get("generatorOptions", {})
    for generator in kustomization.get("configMapGenerator", []):
        _generate_config_map(directory, generator, options, resources)
    for patch in kustomization.get("patches", []):
        _apply_patch(directory, patch, resources)
    if "namespace" in kustomization:
        _set_namespace(resources, kustomization["namespace"])
    for label_set in kustomization.get("labels", []):
        _add_labels(resources, label_set)
    for image in kustomization.get("images", []):
        _set_image(resources, image)
    return resources


def _load_kustomization(directory: Path) -> dict[str, Any]:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{directory} has no kustomization.yaml")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = set(data) - SUPPORTED_KEYS
    if unknown:
        raise KustomizeError(f"{path}: unsupported keys {sorted(unknown)}; extend tests/infra/kustomize_render.py")
    return data


def _load_documents(path: Path) -> list[Resource]:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for document in documents:
        if not {"apiVersion", "kind", "metadata"} <= set(document):
            raise KustomizeError(f"{path}: a document lacks apiVersion, kind or metadata")
    return documents


# generators -----------------------------------------------------------------


def _generate_config_map(directory: Path, generator: dict, options: dict, resources: list[Resource]) -> None:
    data: dict[str, str] = {}
    for item in generator.get("files", []):
        key, _, file = item.rpartition("=") if "=" in item else (Path(item).name, "", item)
        data[key] = (directory / file).read_text()
    for item in generator.get("literals", []):
        key, _, value = item.partition("=")
        data[key] = value
    name, behavior = generator["name"], generator.get("behavior", "create")
    existing = [r for r in resources if r["kind"] == "ConfigMap" and r["metadata"]["name"] == name]
    if behavior == "create":
        if existing:
            raise KustomizeError(f"ConfigMap {name} is generated twice; use behavior: replace or merge")
        metadata: dict[str, Any] = {"name": name}
        if not options.get("disableNameSuffixHash", False):
            metadata["annotations"] = {_HASH_MARK: "true"}
        resources.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    elif behavior in ("replace", "merge"):
        if len(existing) != 1:
            raise KustomizeError(f"configMapGenerator {behavior} of {name}: no generated ConfigMap of that name")
        existing[0]["data"] = data if behavior == "replace" else {**existing[0].get("data", {}), **data}
    else:
        raise KustomizeError(f"configMapGenerator behavior {behavior!r} is not supported")


def _finish_generated(resources: list[Resource]) -> None:
    """Give generated ConfigMaps their content-hash suffix and point pod specs at the new names."""
    renames: dict[str, str] = {}
    for resource in resources:
        annotations = resource["metadata"].get("annotations", {})
        if annotations.pop(_HASH_MARK, None) is None:
            continue
        if not annotations:
            del resource["metadata"]["annotations"]
        content = json.dumps({"kind": "ConfigMap", "name": resource["metadata"]["name"],
                              "data": resource.get("data", {})}, sort_keys=True)
        suffix = hashlib.sha256(content.encode()).hexdigest()[:10]
        new_name = f"{resource['metadata']['name']}-{suffix}"
        renames[resource["metadata"]["name"]] = new_name
        resource["metadata"]["name"] = new_name
    for spec in (s for r in resources for s in pod_specs(r)):
        _rename_config_map_refs(spec, renames)


def _rename_config_map_refs(spec: dict[str, Any], renames: dict[str, str]) -> None:
    refs = []
    for volume in spec.get("volumes", []):
        refs.append(volume.get("configMap"))
        refs.extend(source.get("configMap") for source in volume.get("projected", {}).get("sources", []))
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        refs.extend(env.get("valueFrom", {}).get("configMapKeyRef") for env in container.get("env", []))
        refs.extend(source.get("configMapRef") for source in container.get("envFrom", []))
    for ref in refs:
        if ref and ref.get("name") in renames:
            ref["name"] = renames[ref["name"]]


# patches --------------------------------------------------------------------


def _apply_patch(directory: Path, entry: dict, resources: list[Resource]) -> None:
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    body = yaml.safe_load(text)
    target = entry.get("target")
    if isinstance(body, list):
        if target is None:
            raise KustomizeError("a JSON6902 patch needs a target")
        matched = [r for r in resources if _matches(r, target)]
        for resource in matched:
            for op in body:
                _json_patch_op(resource, op)
    else:
        target = target or {"kind": body["kind"], "name": body["metadata"]["name"]}
        matched = [r for r in resources if _matches(r, target)]
        for resource in matched:
            if not is_builtin(resource):
                raise KustomizeError(f"strategic merge on custom resource {resource['kind']}: use a JSON6902 patch")
            _strategic_merge(resource, body)
    if not matched:
        raise KustomizeError(f"patch {entry.get('path', '(inline)')} matches no resource (target {target})")


def _matches(resource: Resource, target: dict) -> bool:
    group, _, version = resource["apiVersion"].rpartition("/")
    checks = {
        "kind": resource["kind"], "name": resource["metadata"]["name"], "group": group, "version": version,
        "namespace": resource["metadata"].get("namespace", ""),
    }
    for key, wanted in target.items():
        if key not in checks:
            raise KustomizeError(f"patch target field {key!r} is not supported")
        if not re.fullmatch(str(wanted), checks[key]):
            return False
    return True


def _strategic_merge(original: dict[str, Any], patch: dict[str, Any]) -> None:
    """Kubernetes strategic merge, the subset we use: null deletes a key, maps merge, lists with a
    merge key merge by it (``$patch: delete`` removes an item), other lists and scalars replace."""
    for key, value in patch.items():
        if value is None:
            original.pop(key, None)
        elif isinstance(value, dict) and isinstance(original.get(key), dict):
            _strategic_merge(original[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(original.get(key), list):
            _merge_list(original[key], value, MERGE_KEYS[key])
        else:
            original[key] = _without_directives(value)


def _merge_list(original: list[dict], patch: list[dict], merge_key: str) -> None:
    for item in patch:
        index = next((i for i, old in enumerate(original) if old.get(merge_key) == item.get(merge_key)), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del original[index]
        elif index is None:
            original.append(_without_directives(item))
        else:
            _strategic_merge(original[index], item)


def _without_directives(value: Any) -> Any:
    """A patch value inserted whole: nulls and ``$patch`` keys stripped, as kustomize does."""
    if isinstance(value, dict):
        return {k: _without_directives(v) for k, v in value.items() if v is not None and not k.startswith("$")}
    if isinstance(value, list):
        return [_without_directives(v) for v in value]
    return copy.deepcopy(value)


def _json_patch_op(document: Resource, op: dict) -> None:
    """One RFC 6902 operation: add, remove or replace (the ones our overlays use)."""
    *parents, last = _pointer(op["path"])
    node: Any = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if kind not in ("add", "remove", "replace"):
        raise KustomizeError(f"JSON patch op {kind!r} is not supported")
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if kind == "add":
            node.insert(index, copy.deepcopy(op["value"]))
        elif kind == "remove":
            del node[index]
        else:
            node[index] = copy.deepcopy(op["value"])
        return
    if kind in ("remove", "replace") and last not in node:
        raise KustomizeError(f"JSON patch {kind} {op['path']}: no such field")
    if kind == "remove":
        del node[last]
    else:
        node[last] = copy.deepcopy(op["value"])


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


# transformers ---------------------------------------------------------------


def _set_namespace(resources: list[Resource], namespace: str) -> None:
    for resource in resources:
        if resource["kind"] not in CLUSTER_SCOPED_KINDS:
            resource["metadata"]["namespace"] = namespace


def _add_labels(resources: list[Resource], label_set: dict) -> None:
    if label_set.get("includeSelectors", False):
        raise KustomizeError("labels.includeSelectors is not supported (selectors are immutable; keep them explicit)")
    pairs = label_set["pairs"]
    for resource in resources:
        resource["metadata"].setdefault("labels", {}).update(pairs)
        if label_set.get("includeTemplates", False) and "template" in resource.get("spec", {}):
            resource["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)


def _set_image(resources: list[Resource], image: dict) -> None:
    for spec in (s for r in resources for s in pod_specs(r)):
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            name, tag = _split_image(container["image"])
            if name != image["name"]:
                continue
            new_name = image.get("newName", name)
            if "digest" in image:
                container["image"] = f"{new_name}@{image['digest']}"
            else:
                new_tag = image.get("newTag", tag)
                container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name


def _split_image(reference: str) -> tuple[str, str]:
    """``registry:5000/name:tag`` -> (``registry:5000/name``, ``tag``); a digest counts as no tag."""
    reference = reference.split("@", 1)[0]
    name, sep, tag = reference.rpartition(":")
    if not sep or "/" in tag:
        return reference, ""
    return name, tag


# helpers the tests use --------------------------------------------------------


def is_builtin(resource: Resource) -> bool:
    """Core Kubernetes API groups (no dot, or ``*.k8s.io``), as opposed to custom resources."""
    group = resource["apiVersion"].rpartition("/")[0]
    return "." not in group or group.endswith(".k8s.io")


def pod_specs(resource: Resource) -> list[dict[str, Any]]:
    """The pod spec(s) inside a workload (empty for anything else)."""
    spec = resource.get("spec", {})
    if resource["kind"] == "CronJob":
        spec = spec.get("jobTemplate", {}).get("spec", {})
    template = spec.get("template", {})
    return [template["spec"]] if resource["kind"] in WORKLOAD_KINDS and "spec" in template else []


def of_kind(resources: list[dict], kind: str) -> list[dict]:
    """The rendered resources of one kind."""
    return [r for r in resources if r["kind"] == kind]


def one(resources: list[dict], kind: str, name: str | None = None) -> dict:
    """The one rendered resource of ``kind`` (and ``name``); the test fails unless there is exactly one."""
    matches = [r for r in of_kind(resources, kind) if name is None or r["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"}


def _check_unique(resources: list[Resource]) -> None:
    seen = set()
    for resource in resources:
        key = (resource["apiVersion"], resource["kind"], resource["metadata"].get("namespace"),
               resource["metadata"]["name"])
        if key in seen:
            raise KustomizeError(f"duplicate resource {key}")
        seen.add(key)
