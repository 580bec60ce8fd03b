"""A small, strict renderer for the subset of kustomize that ``k8s/`` uses.

There is no kubectl/kustomize binary on the build machines, so the deploy tests render the
kustomizations with this module instead. It implements only the features the manifests use and
*refuses* everything else (unknown kustomization fields, list-valued strategic-merge patches,
patch directives, ID collisions, patches that match nothing), so a manifest cannot silently rely
on a feature whose behaviour this renderer would get wrong.

Supported ``kustomization.yaml`` fields (kustomize.config.k8s.io/v1beta1, kind Kustomization):

- ``resources``: YAML files (one or more documents each) and directories holding a
  kustomization. Each directory is rendered on its own first, exactly as kustomize does.
- ``namespace``: sets ``metadata.namespace`` on every namespaced object. A ``Namespace`` object
  in the same output must carry that same name (kustomize would rename it; we refuse instead).
- ``labels``: a list of ``{pairs: {...}}`` entries with ``includeSelectors`` and
  ``includeTemplates`` both false (absent): the pairs are added to ``metadata.labels`` only.
- ``images``: ``name`` matched against the image name without tag/digest in every
  ``containers``/``initContainers`` list; ``newName``, ``newTag`` and ``digest`` applied.
- ``patches``: entries with only ``path:``, a strategic merge patch naming its target by
  apiVersion, kind and metadata.name (and metadata.namespace if given). Maps merge recursively,
  a ``null`` value deletes the key. Lists are not supported in patches (kustomize merges some
  lists by key; reproducing that table is out of scope), so a patch holding a list is an error.

Transformers run in kustomize's order within one kustomization: patches, namespace, labels,
images. Output order is the order in which resources are listed (kustomize sorts by kind by
default; the tests do not depend on order).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches"}

# Kinds that are not namespaced, among those a kvtier deployment could plausibly contain.
CLUSTER_SCOPED_KINDS = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PriorityClass",
    "StorageClass",
    "PersistentVolume",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "RuntimeClass",
    "IngressClass",
}


class RenderError(Exception):
    """The kustomization uses something this renderer does not support, or is inconsistent."""


def _find_kustomization(directory: Path) -> Path:
    found = [directory / name for name in KUSTOMIZATION_FILES if (directory / name).is_file()]
    if len(found) != 1:
        raise RenderError(f"{directory}: expected exactly one kustomization file, found {len(found)}")
    return found[0]


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """All non-empty YAML documents of a file; each must be a Kubernetes object."""
    with path.open(encoding="utf-8") as fh:
        docs = [doc for doc in yaml.safe_load_all(fh) if doc is not None]
    for doc in docs:
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= doc.keys():
            raise RenderError(f"{path}: every document must be an object with apiVersion/kind/metadata")
        if not doc["metadata"].get("name"):
            raise RenderError(f"{path}: {doc['kind']} without metadata.name")
    return docs


def object_id(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    """(group, kind, namespace, name): the identity kustomize uses to detect collisions."""
    api_version = obj["apiVersion"]
    group = api_version.split("/")[0] if "/" in api_version else ""
    return group, obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def render(directory: str | Path) -> list[dict[str, Any]]:
    """Render the kustomization in ``directory`` into a list of Kubernetes objects."""
    return _render(Path(directory).resolve(), stack=())


def _render(directory: Path, stack: tuple[Path, ...]) -> list[dict[str, Any]]:
    if directory in stack:
        raise RenderError(f"cycle in kustomization resources: {[*stack, directory]}")
    kfile = _find_kustomization(directory)
    with kfile.open(encoding="utf-8") as fh:
        spec = yaml.safe_load(fh) or {}
    unknown = set(spec) - SUPPORTED_FIELDS
    if unknown:
        raise RenderError(f"{kfile}: unsupported kustomization fields {sorted(unknown)}")
    if spec.get("apiVersion") != "kustomize.config.k8s.io/v1beta1" or spec.get("kind") != "Kustomization":
        raise RenderError(f"{kfile}: must be apiVersion kustomize.config.k8s.io/v1beta1, kind Kustomization")

    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            objects.extend(_render(target, (*stack, directory)))
        elif target.is_file():
            objects.extend(copy.deepcopy(load_yaml_documents(target)))
        else:
            raise RenderError(f"{kfile}: resource {entry!r} does not exist")
    _check_unique(objects, kfile)

    for patch_entry in spec.get("patches", []):
        _apply_patch_entry(objects, patch_entry, directory, kfile)
    if "namespace" in spec:
        _set_namespace(objects, spec["namespace"], kfile)
    for label_entry in spec.get("labels", []):
        _add_labels(objects, label_entry, kfile)
    for image in spec.get("images", []):
        _set_image(objects, image, kfile)
    _check_unique(objects, kfile)
    return objects


def _check_unique(objects: Iterable[dict[str, Any]], kfile: Path) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        oid = object_id(obj)
        if oid in seen:
            raise RenderError(f"{kfile}: duplicate object {oid}")
        seen.add(oid)


# --- patches -------------------------------------------------------------------------------------


def _apply_patch_entry(objects: list[dict[str, Any]], entry: Any, directory: Path, kfile: Path) -> None:
    if not isinstance(entry, dict) or set(entry) != {"path"}:
        raise RenderError(f"{kfile}: only `patches: - path: FILE` entries are supported, got {entry!r}")
    path = (directory / entry["path"]).resolve()
    if directory.resolve() not in path.parents:
        raise RenderError(f"{kfile}: patch {entry['path']!r} lies outside the kustomization directory")
    for patch in load_yaml_documents(path):
        _reject_unsupported_patch_content(patch, path)
        p_meta = patch["metadata"]
        matches = [
            obj
            for obj in objects
            if obj["apiVersion"] == patch["apiVersion"]
            and obj["kind"] == patch["kind"]
            and obj["metadata"]["name"] == p_meta["name"]
            and ("namespace" not in p_meta or obj["metadata"].get("namespace") == p_meta["namespace"])
        ]
        if len(matches) != 1:
            raise RenderError(
                f"{path}: patch for {patch['kind']}/{p_meta['name']} matches {len(matches)} objects, need 1"
            )
        merged = strategic_merge(matches[0], patch)
        matches[0].clear()
        matches[0].update(merged)


def _reject_unsupported_patch_content(node: Any, path: Path, where: str = "") -> None:
    if isinstance(node, list):
        raise RenderError(f"{path}: list at {where or '/'} in a patch is not supported by this renderer")
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str) and key.startswith("$"):
                raise RenderError(f"{path}: patch directive {key!r} is not supported")
            _reject_unsupported_patch_content(value, path, f"{where}/{key}")


def strategic_merge(base: Any, patch: Any) -> Any:
    """Strategic merge for maps of scalars/maps: recursive merge, ``None`` deletes a key."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = strategic_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# --- namespace, labels, images ----------------------------------------------------------------


def _set_namespace(objects: list[dict[str, Any]], namespace: str, kfile: Path) -> None:
    for obj in objects:
        if obj["kind"] == "Namespace":
            if obj["metadata"]["name"] != namespace:
                raise RenderError(
                    f"{kfile}: Namespace {obj['metadata']['name']!r} differs from namespace: {namespace!r}"
                )
            continue
        if obj["kind"] in CLUSTER_SCOPED_KINDS:
            continue
        obj["metadata"]["namespace"] = namespace


def _add_labels(objects: list[dict[str, Any]], entry: Any, kfile: Path) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("pairs"), dict):
        raise RenderError(f"{kfile}: labels entries need a `pairs` map")
    extra = set(entry) - {"pairs", "includeSelectors", "includeTemplates"}
    if extra or entry.get("includeSelectors") or entry.get("includeTemplates"):
        raise RenderError(f"{kfile}: only labels with includeSelectors/includeTemplates false are supported")
    for key, value in entry["pairs"].items():
        if not isinstance(value, str):
            raise RenderError(f"{kfile}: label {key!r} must be a string")
    for obj in objects:
        labels = obj["metadata"].setdefault("labels", {})
        labels.update(entry["pairs"])


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """``registry/name:tag@digest`` -> (name, tag, digest). A ``:`` inside the registry host
    (a port) is not a tag separator."""
    digest = None
    if "@" in image:
        image, digest = image.split("@", 1)
    tag = None
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        image, tag = image[:colon], image[colon + 1 :]
    return image, tag, digest


def _containers(node: Any) -> Iterable[dict[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def _set_image(objects: list[dict[str, Any]], entry: Any, kfile: Path) -> None:
    if not isinstance(entry, dict) or "name" not in entry:
        raise RenderError(f"{kfile}: images entries need a `name`")
    extra = set(entry) - {"name", "newName", "newTag", "digest"}
    if extra:
        raise RenderError(f"{kfile}: unsupported images fields {sorted(extra)}")
    for field in ("newName", "newTag", "digest"):
        if field in entry and not isinstance(entry[field], str):
            raise RenderError(f"{kfile}: images.{field} must be a string (quote version numbers)")
    if "digest" in entry and "newTag" in entry:
        raise RenderError(f"{kfile}: images entry sets both newTag and digest; use one")
    for obj in objects:
        for container in _containers(obj.get("spec")):
            name, tag, digest = split_image(container.get("image", ""))
            if name != entry["name"]:
                continue
            name = entry.get("newName", name)
            if "digest" in entry:
                tag, digest = None, entry["digest"]
            elif "newTag" in entry:
                tag, digest = entry["newTag"], None
            container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
