"""The k8s/ kustomizations rendered, and the facts about them every deploy test pins down.

Every kustomization under k8s/ is rendered with tests/deploy/kustomize_render.py (a strict
renderer for the kustomize subset the manifests use); ``schema_errors`` validates an object
against the Kubernetes OpenAPI JSON schemas shipped inside the ``kubernetes-validate`` package
(strict mode: unknown fields are errors), for the oldest and the newest Kubernetes version we
support. Shared by test_k8s_manifests.py, test_k8s_fleet.py and test_dockerfile.py.
"""

from __future__ import annotations

import functools
import json
import tomllib
from pathlib import Path
from typing import Any

# Hard imports on purpose: a missing dev dependency must fail the suite, not skip it.
import kubernetes_validate

from . import kustomize_render as kr

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
BASE = K8S / "base"
SEAWEEDFS = BASE / "seaweedfs"
EMBEDDED = K8S / "overlays" / "embedded-s3"
EXTERNAL = K8S / "overlays" / "external-s3"
OVERLAYS = {"embedded-s3": EMBEDDED, "external-s3": EXTERNAL}
#: `kvtier route` with engine pods sharing the S3 tier (checked by the pod rules, and its own test).
FLEET = K8S / "overlays" / "fleet"
ALL_OVERLAYS = {**OVERLAYS, "fleet": FLEET}

NAMESPACE = "kvtier"
DAEMON_UID = 10001
DAEMON_IMAGE = "ghcr.io/kvtier/kvtier:0.1.0"
DAEMON_COMMAND = ["kvtier", "serve", "--config", "/etc/kvtier/config/kvtier.toml"]
DAEMON_POD_LABELS = {"app.kubernetes.io/name": "kvtier", "app.kubernetes.io/component": "cache-daemon"}
ENGINE_LABELS = {"kvtier.io/engine": "true"}
MONITORING_NS_SELECTOR = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
SECRET_KEYS = {"master-key", "token-key", "server-secret"}
GRPC_PORT, METRICS_PORT, S3_PORT = 7070, 9400, 8333
OLDEST_SUPPORTED_K8S = "1.27"  # grpc probes are GA from 1.27, internalTrafficPolicy from 1.26

BASE_CONFIG: dict[str, Any] = {
    "server": {
        "listen": "0.0.0.0:7070",
        "metrics_listen": "0.0.0.0:9400",
        "max_message_bytes": 67108864,
        "max_inflight_bytes": 2147483648,
        "max_inflight_bytes_per_client": 536870912,
        "max_concurrent_rpcs": 256,
        "reflection": False,
    },
    "auth": {"token_key_file": "/etc/kvtier/secrets/token-key"},
    "security": {
        "master_key_file": "/etc/kvtier/secrets/master-key",
        "server_secret_file": "/etc/kvtier/secrets/server-secret",
        "encrypt_disk": True,
        "encrypt_remote": True,
        "public_publishers": "",  # operators only, spelled out for whoever edits the map
    },
    "tiers": {
        "memory": {"capacity_bytes": 17179869184, "policy": "prefix-aware"},
        "disk": {"path": "/var/lib/kvtier/lmdb", "capacity_bytes": 274877906944, "policy": "prefix-aware"},
        "remote": {
            "endpoint": "http://kvtier-seaweedfs:8333",
            "bucket": "kvtier",
            "prefix": "kv",
            "region": "us-east-1",
            "write_policy": "write-through",
        },
    },
}


# --- helpers -------------------------------------------------------------------------------------


@functools.cache
def _render_cached(directory: Path) -> str:
    return json.dumps(kr.render(directory))


def render(directory: Path) -> list[dict[str, Any]]:
    """Rendered objects of a kustomization (a fresh copy each call, so tests can mutate it)."""
    return json.loads(_render_cached(directory))


def kustomization_dirs() -> list[Path]:
    return sorted({p.parent for name in kr.KUSTOMIZATION_FILES for p in K8S.rglob(name)})


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def daemonset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "DaemonSet", "kvtier")


def daemon_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers = daemonset(objects)["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["kvtier"]
    return containers[0]


def config_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    cm = one(objects, "ConfigMap", "kvtier-config")
    assert set(cm["data"]) == {"kvtier.toml"}
    return tomllib.loads(cm["data"]["kvtier.toml"])


def k8s_versions() -> list[str]:
    shipped = sorted(set(kubernetes_validate.utils.all_versions()), key=lambda v: tuple(int(x) for x in v.split(".")))
    floor = tuple(int(x) for x in OLDEST_SUPPORTED_K8S.split("."))
    usable = [v for v in shipped if tuple(int(x) for x in v.split("."))[:2] >= floor]
    assert usable, f"kubernetes-validate ships no schema >= {OLDEST_SUPPORTED_K8S}: {shipped}"
    return sorted({usable[0], usable[-1]})


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """Validation errors of one object against every version in k8s_versions() (strict)."""
    errors = []
    for version in k8s_versions():
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')} @ {version}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:  # unknown kind = not validated = error
            errors.append(f"{where}: {exc.message}")
    return errors


WORKLOAD_KINDS = ("DaemonSet", "StatefulSet", "Deployment", "Job")


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"]) for o in workloads(objects)]


def effective(pod: dict[str, Any], container: dict[str, Any], field: str) -> Any:
    """A securityContext field as the kubelet sees it: container value, else the pod's."""
    csc, psc = container.get("securityContext", {}), pod.get("securityContext", {})
    return csc[field] if field in csc else psc.get(field)


def selector_matches(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(match_labels) and all(labels.get(k) == v for k, v in match_labels.items())
