"""A tiny, offline stand-in for `kustomize build`, for exactly the features deploy/k8s uses.

Supported kustomization keys: ``resources`` (YAML files and directories holding a
kustomization), ``replicas``, ``images`` and ``patches`` whose patch is a JSON6902 operation
list (inline ``patch`` or ``path``) with a ``target`` of group/version/kind/name. Anything else
(strategic-merge patches, generators, namespace, labels...) raises `UnsupportedKustomization`
rather than being half-applied, so a render here means what kustomize would produce. Transformers
run in kustomize's order: patches, then replicas, then images.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "replicas", "images", "patches"}
SCALABLE_KINDS = {"Deployment", "StatefulSet", "ReplicaSet", "ReplicationController"}


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature this emulation does not implement."""


class PatchError(ValueError):
    """A JSON6902 operation failed (missing path, failed ``test``...)."""


def load_kustomization(directory: Path) -> dict[str, Any]:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            data = yaml.safe_load(path.read_text()) or {}
            unknown = sorted(set(data) - SUPPORTED_KEYS)
            if unknown:
                raise UnsupportedKustomization(f"{path}: unsupported key(s) {unknown}")
            return data
    raise FileNotFoundError(f"no kustomization file in {directory}")


def resource_id(obj: dict[str, Any]) -> tuple[str, str, str]:
    return (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build DIRECTORY`` would print, in resource order."""
    directory = Path(directory)
    kustomization = load_kustomization(directory)
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects.extend(render(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        if obj["metadata"].get("namespace"):
            raise UnsupportedKustomization(f"{resource_id(obj)} sets a namespace")
        key = resource_id(obj)
        if key in seen:
            raise UnsupportedKustomization(f"{key} is defined twice")
        seen.add(key)
    for patch in kustomization.get("patches", []):
        _apply_patch_entry(directory, patch, objects)
    for replicas in kustomization.get("replicas", []):
        _apply_replicas(replicas, objects)
    for image in kustomization.get("images", []):
        _apply_image(image, objects)
    return objects


# ---------------------------------------------------------------------- patches


def _apply_patch_entry(directory: Path, entry: dict[str, Any], objects: list[dict]) -> None:
    unknown = sorted(set(entry) - {"target", "patch", "path"})
    if unknown:
        raise UnsupportedKustomization(f"patch keys {unknown}")
    if ("patch" in entry) == ("path" in entry):
        raise UnsupportedKustomization("a patch needs exactly one of `patch` and `path`")
    text = entry["patch"] if "patch" in entry else (directory / entry["path"]).read_text()
    operations = yaml.safe_load(text)
    if not isinstance(operations, list):
        raise UnsupportedKustomization("only JSON6902 patches (a list of operations)")
    target = entry.get("target")
    if not target:
        raise UnsupportedKustomization("a JSON6902 patch needs a target")
    unknown = sorted(set(target) - {"group", "version", "kind", "name"})
    if unknown:
        raise UnsupportedKustomization(f"patch target keys {unknown}")
    matched = [obj for obj in objects if _matches(target, obj)]
    if not matched:
        raise PatchError(f"patch target {target} matches nothing")
    for obj in matched:
        patched = apply_json_patch(obj, operations)
        obj.clear()
        obj.update(patched)


def _matches(target: dict[str, str], obj: dict[str, Any]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    checks = {
        "group": group,
        "version": version,
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
    }
    for key, actual in checks.items():
        wanted = target.get(key)
        if wanted is None:
            continue
        # kustomize anchors the name (a regular expression); the rest compare exactly.
        if key == "name" and re.fullmatch(wanted, actual):
            continue
        if wanted != actual:
            return False
    return True


def apply_json_patch(document: Any, operations: list[dict[str, Any]]) -> Any:
    """RFC 6902 ``add``/``remove``/``replace``/``test`` (all this repository uses)."""
    document = copy.deepcopy(document)
    for op in operations:
        kind = op.get("op")
        tokens = _pointer(op["path"])
        if kind == "test":
            if _get(document, tokens) != op["value"]:
                raise PatchError(
                    f"test {op['path']}: {_get(document, tokens)!r} != {op['value']!r}"
                )
            continue
        if not tokens:
            raise PatchError("operations on the whole document are not supported")
        parent = _get(document, tokens[:-1])
        last = tokens[-1]
        if kind == "add":
            value = copy.deepcopy(op["value"])
            if isinstance(parent, list):
                index = len(parent) if last == "-" else _index(parent, last, allow_end=True)
                parent.insert(index, value)
            else:
                parent[last] = value
        elif kind in ("replace", "remove"):
            if isinstance(parent, list):
                index = _index(parent, last, allow_end=False)
            elif last in parent:
                index = last
            else:
                raise PatchError(f"{kind} {op['path']}: no such member")
            if kind == "replace":
                parent[index] = copy.deepcopy(op["value"])
            else:
                del parent[index]
        else:
            raise UnsupportedKustomization(f"JSON6902 op {kind!r}")
    return document


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"bad JSON pointer {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _get(document: Any, tokens: list[str]) -> Any:
    node = document
    for token in tokens:
        if isinstance(node, list):
            node = node[_index(node, token, allow_end=False)]
        elif isinstance(node, dict) and token in node:
            node = node[token]
        else:
            raise PatchError(f"path member {token!r} does not exist")
    return node


def _index(array: list[Any], token: str, *, allow_end: bool) -> int:
    if not re.fullmatch(r"0|[1-9][0-9]*", token):
        raise PatchError(f"bad array index {token!r}")
    index = int(token)
    limit = len(array) if allow_end else len(array) - 1
    if index > limit:
        raise PatchError(f"array index {index} out of range (length {len(array)})")
    return index


# ---------------------------------------------------------------------- replicas, images


def _apply_replicas(entry: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    matched = [
        obj
        for obj in objects
        if obj["kind"] in SCALABLE_KINDS and obj["metadata"]["name"] == entry["name"]
    ]
    if not matched:
        raise PatchError(f"replicas: no workload named {entry['name']!r}")
    for obj in matched:
        obj["spec"]["replicas"] = int(entry["count"])


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """``name[:tag][@digest]`` -> (name, tag, digest); a registry port is part of the name."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest or None


def _apply_image(entry: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    unknown = sorted(set(entry) - {"name", "newName", "newTag", "digest"})
    if unknown:
        raise UnsupportedKustomization(f"images keys {unknown}")
    for obj in objects:
        for container in pod_containers(obj):
            name, tag, digest = split_image(container["image"])
            if name != entry["name"]:
                continue
            name = entry.get("newName", name)
            if "digest" in entry:
                tag, digest = None, entry["digest"]
            elif "newTag" in entry:
                tag, digest = entry["newTag"], None
            image = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
            container["image"] = image


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] == "Pod":
        return obj["spec"]
    template = obj.get("spec", {}).get("template")
    return template.get("spec") if template else None


def pod_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(obj)
    if spec is None:
        return []
    return [*spec.get("initContainers", []), *spec.get("containers", [])]
