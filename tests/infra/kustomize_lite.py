"""A minimal kustomize renderer for the features infra/k8s uses, so the overlays can be rendered and checked on a
machine with no kustomize/kubectl binary.

Supported (and nothing else, on purpose: infra/k8s keeps to these so this stays small):
  resources   files and directories holding a kustomization.yaml
  components  directories holding a `kind: Component` kustomization (its resources and patches)
  namespace   set on every namespaced object
  images      name -> newName/newTag/digest on containers[].image anywhere in the object (as kustomize does)
  patches     JSON 6902 patches from `path:` or inline `patch:`, selected by `target` kind/name
  configMapGenerator  ConfigMaps from `files:` (`key=path` or `path`), with generatorOptions labels/annotations and
              disableNameSuffixHash: true only (kustomize's name hash is not reproduced here)
When a kubectl binary is present the tests also compare this renderer's output with `kubectl kustomize`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
}
SUPPORTED_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "namespace",
    "images",
    "patches",
    "configMapGenerator",
    "generatorOptions",
}


class UnsupportedKustomization(ValueError):
    pass


def render(directory: Path) -> list[dict[str, Any]]:
    return _build(Path(directory), component=False)


def _load_kustomization(directory: Path) -> dict[str, Any]:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        if (directory / name).exists():
            data = yaml.safe_load((directory / name).read_text()) or {}
            unknown = set(data) - SUPPORTED_KEYS
            if unknown:
                raise UnsupportedKustomization(f"{directory}: kustomize_lite does not support {sorted(unknown)}")
            return data
    raise FileNotFoundError(f"no kustomization in {directory}")


def _build(directory: Path, component: bool, objects: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    k = _load_kustomization(directory)
    if component != (k.get("kind") == "Component"):
        raise UnsupportedKustomization(f"{directory}: expected {'a Component' if component else 'a Kustomization'}")
    objects = [] if objects is None else objects
    for res in k.get("resources", []):
        path = directory / res
        if path.is_dir():
            objects.extend(_build(path, component=False))
        else:
            objects.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    objects.extend(_generated_config_maps(directory, k))
    for comp in k.get("components", []):
        objects = _build(directory / comp, component=True, objects=objects)
    for patch in k.get("patches", []):
        ops = (
            yaml.safe_load((directory / patch["path"]).read_text())
            if "path" in patch
            else yaml.safe_load(patch["patch"])
        )
        if not isinstance(ops, list):
            raise UnsupportedKustomization(f"{directory}: only JSON 6902 patches (a list of ops) are supported")
        target = patch.get("target", {})
        hits = [o for o in objects if _matches(o, target)]
        if not hits:
            raise UnsupportedKustomization(f"{directory}: patch {patch} matches no object")
        for obj in hits:
            apply_json6902(obj, ops)
    if "namespace" in k:
        for obj in objects:
            if obj.get("kind") not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = k["namespace"]
    for image in k.get("images", []):
        for obj in objects:
            _set_images(obj, image)
    return objects


def _generated_config_maps(directory: Path, k: dict[str, Any]) -> list[dict[str, Any]]:
    options = k.get("generatorOptions", {})
    if k.get("configMapGenerator") and options.get("disableNameSuffixHash") is not True:
        raise UnsupportedKustomization(f"{directory}: configMapGenerator needs generatorOptions.disableNameSuffixHash")
    out = []
    for gen in k.get("configMapGenerator", []):
        unknown = set(gen) - {"name", "files"}
        if unknown:
            raise UnsupportedKustomization(f"{directory}: configMapGenerator keys {sorted(unknown)}")
        data = {}
        for entry in gen.get("files", []):
            key, _, path = entry.rpartition("=")
            data[key or Path(path).name] = (directory / path).read_text()
        metadata: dict[str, Any] = {"name": gen["name"]}
        for field in ("labels", "annotations"):
            if options.get(field):
                metadata[field] = dict(options[field])
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    return out


def _matches(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    if "kind" in target and obj.get("kind") != target["kind"]:
        return False
    return not ("name" in target and obj.get("metadata", {}).get("name") != target["name"])


def _set_images(node: Any, image: dict[str, str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    if isinstance(c, dict) and "image" in c:
                        c["image"] = _retag(c["image"], image)
            else:
                _set_images(value, image)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, image)


def _retag(ref: str, image: dict[str, str]) -> str:
    name, tag = ref, None
    if "@" in name:
        name = name.split("@", 1)[0]
    elif ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    if name != image["name"]:
        return ref
    name = image.get("newName", name)
    if "digest" in image:
        return f"{name}@{image['digest']}"
    tag = image.get("newTag", tag)
    return f"{name}:{tag}" if tag else name


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise UnsupportedKustomization(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for p in parts:
        doc = doc[int(p)] if isinstance(doc, list) else doc[p]
    return doc


def apply_json6902(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """RFC 6902 add / remove / replace / test (the ops infra/k8s uses)."""
    for op in ops:
        parts = _pointer(op["path"])
        parent, last = _walk(doc, parts[:-1]), parts[-1]
        kind = op["op"]
        if kind == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last, object())
            if current != op["value"]:
                raise AssertionError(f"JSON patch test failed at {op['path']}: {current!r} != {op['value']!r}")
        elif kind == "add":
            value = copy.deepcopy(op["value"])
            if isinstance(parent, list):
                parent.append(value) if last == "-" else parent.insert(int(last), value)
            else:
                parent[last] = value
        elif kind == "replace":
            if isinstance(parent, list):
                parent[int(last)] = copy.deepcopy(op["value"])
            else:
                if last not in parent:
                    raise KeyError(f"replace of missing {op['path']}")
                parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise UnsupportedKustomization(f"JSON patch op {kind!r}")
