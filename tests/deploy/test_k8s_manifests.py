"""Offline checks of the Kubernetes manifests (k8s/) and the container recipe (Dockerfile).

Every kustomization under k8s/ is rendered with tests/deploy/kustomize_render.py (a strict
renderer for the kustomize subset the manifests use) and every rendered object is validated
against the Kubernetes OpenAPI JSON schemas shipped inside the ``kubernetes-validate`` package
(strict mode: unknown fields are errors), for the oldest and the newest Kubernetes version we
support. On top of schema validity the tests pin down the properties that matter for running
kvtier safely: security contexts, probes, metrics, network policy, config/secret wiring, and
consistency between the manifests, the Dockerfile and pyproject.toml.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import tomllib
from pathlib import Path
from typing import Any

# Hard imports on purpose: a missing dev dependency must fail the suite, not skip it.
import kubernetes_validate
import pytest
import yaml

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


# --- rendering and schema validation -----------------------------------------------------------


def test_every_kustomization_is_covered():
    assert set(kustomization_dirs()) >= {BASE, SEAWEEDFS, EMBEDDED, EXTERNAL, FLEET}


@pytest.mark.parametrize("directory", kustomization_dirs(), ids=lambda p: str(p.relative_to(K8S)))
def test_renders_and_validates_against_kubernetes_schemas(directory):
    objects = render(directory)
    assert objects
    errors = [e for obj in objects for e in schema_errors(obj)]
    assert errors == []


def test_every_manifest_file_is_used():
    """No YAML under k8s/ is silently left out of every kustomization."""
    used: set[Path] = set()
    for directory in kustomization_dirs():
        spec = yaml.safe_load(kr._find_kustomization(directory).read_text())
        used.add(kr._find_kustomization(directory))
        for entry in spec.get("resources", []):
            used.add((directory / entry).resolve())
        for entry in spec.get("patches", []):
            used.add((directory / entry["path"]).resolve())
    files = {p.resolve() for p in K8S.rglob("*.y*ml")}
    assert files - used == set()


def test_validator_rejects_a_broken_manifest():
    """The schema check is not vacuous: a wrong type and an unknown field are both caught."""
    objects = render(EMBEDDED)
    ds = daemonset(objects)
    assert schema_errors(ds) == []

    bad_port = copy.deepcopy(ds)
    bad_port["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "abc"
    errors = schema_errors(bad_port)
    assert len(errors) == len(k8s_versions())
    assert all("containerPort" in e for e in errors)

    typo = copy.deepcopy(ds)
    sc = typo["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    sc["readOnlyRootFileSystem"] = sc.pop("readOnlyRootFilesystem")  # wrong capitalisation
    assert any("readOnlyRootFileSystem" in e for e in schema_errors(typo))

    missing = copy.deepcopy(one(objects, "Service", "kvtier"))
    del missing["spec"]["ports"][0]["port"]  # required field
    assert schema_errors(missing) != []

    unknown_kind = {"apiVersion": "example.com/v1", "kind": "Nonsense", "metadata": {"name": "x"}}
    assert schema_errors(unknown_kind) != []


def test_renderer_refuses_what_it_cannot_render_faithfully(tmp_path):
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: b}\n")
    header = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"

    def attempt(extra: str, patch: str | None = None, resources: str = "[cm.yaml]") -> None:
        (tmp_path / "kustomization.yaml").write_text(f"{header}resources: {resources}\n{extra}")
        if patch is not None:
            (tmp_path / "patch.yaml").write_text(patch)
        kr.render(tmp_path)

    attempt("")  # the minimal kustomization renders
    with pytest.raises(kr.RenderError, match="unsupported kustomization fields"):
        attempt("commonLabels: {a: b}\n")
    with pytest.raises(kr.RenderError, match="includeSelectors"):
        attempt("labels: [{pairs: {a: b}, includeSelectors: true}]\n")
    with pytest.raises(kr.RenderError, match="list"):
        attempt("patches: [{path: patch.yaml}]\n", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\nx: [1]\n")
    with pytest.raises(kr.RenderError, match="matches 0 objects"):
        attempt("patches: [{path: patch.yaml}]\n", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: nope}\n")
    with pytest.raises(kr.RenderError, match="duplicate"):
        attempt("", resources="[cm.yaml, cm.yaml]")
    with pytest.raises(kr.RenderError, match="does not exist"):
        attempt("", resources="[missing.yaml]")
    with pytest.raises(kr.RenderError, match="differs from namespace"):
        (tmp_path / "ns.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: other}\n")
        attempt("namespace: kvtier\n", resources="[cm.yaml, ns.yaml]")


def test_strategic_merge_and_images_subset():
    merged = kr.strategic_merge({"data": {"a": "1", "b": "2"}, "k": 1}, {"data": {"b": "3", "a": None}})
    assert merged == {"data": {"b": "3"}, "k": 1}
    assert kr.split_image("registry:5000/org/img:1.2@sha256:ab") == ("registry:5000/org/img", "1.2", "sha256:ab")
    assert kr.split_image("registry:5000/img") == ("registry:5000/img", None, None)


# --- what every rendering must contain --------------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_contents(name):
    objects = render(OVERLAYS[name])
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    expected = [
        ("ConfigMap", "kvtier-config"),
        ("DaemonSet", "kvtier"),
        ("Namespace", "kvtier"),
        ("NetworkPolicy", "kvtier-daemon"),
        ("Secret", "kvtier-s3-credentials"),
        ("Secret", "kvtier-secrets"),
        ("Service", "kvtier"),
        ("ServiceAccount", "kvtier"),
    ]
    if name == "embedded-s3":
        expected += [
            ("NetworkPolicy", "kvtier-seaweedfs"),
            ("Service", "kvtier-seaweedfs"),
            ("Service", "kvtier-seaweedfs-headless"),
            ("StatefulSet", "kvtier-seaweedfs"),
        ]
    assert kinds == sorted(expected)
    for obj in objects:
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvtier"
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("name", ALL_OVERLAYS)
def test_images_are_pinned(name):
    objects = render(ALL_OVERLAYS[name])
    images = {c["image"] for _, pod in pod_specs(objects) for c in pod.get("initContainers", []) + pod["containers"]}
    for image in images:
        _, tag, digest = kr.split_image(image)
        assert (tag and tag != "latest") or digest, image
    ds_pod = daemonset(objects)["spec"]["template"]["spec"]
    assert {c["image"] for c in ds_pod["initContainers"] + ds_pod["containers"]} == {DAEMON_IMAGE}
    if name == "embedded-s3":
        sts = one(objects, "StatefulSet", "kvtier-seaweedfs")
        image = sts["spec"]["template"]["spec"]["containers"][0]["image"]
        assert re.fullmatch(r"chrislusf/seaweedfs:\d+\.\d+", image), image


# --- security ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_OVERLAYS)
def test_pod_security(name):
    objects = render(ALL_OVERLAYS[name])
    specs = pod_specs(objects)
    assert {n for n, _ in specs} >= {"DaemonSet/kvtier"}
    for where, pod in specs:
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True, where
        assert isinstance(psc["runAsUser"], int) and psc["runAsUser"] > 0, where
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, where
        # Only the fleet's router holds an API token: its own account, which may list endpointslices.
        assert pod["automountServiceAccountToken"] is (where == "Deployment/kvtier-router"), where
        for host_ns in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(host_ns), where
        tmp_volumes = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in pod["containers"]:
            who = f"{where}/{container['name']}"
            sc = container["securityContext"]
            assert effective(pod, container, "runAsNonRoot") is True, who
            assert effective(pod, container, "runAsUser") > 0, who
            assert sc["readOnlyRootFilesystem"] is True, who
            assert sc["allowPrivilegeEscalation"] is False, who
            assert sc.get("privileged", False) is False, who
            assert sc["capabilities"] == {"drop": ["ALL"]}, who
            assert effective(pod, container, "seccompProfile") == {"type": "RuntimeDefault"}, who
            tmp_mounts = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert len(tmp_mounts) == 1 and tmp_mounts[0]["name"] in tmp_volumes, who
            for key in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][key]), who
        # The only container allowed to run as root: the daemon's one-shot disk-tier chown.
        for init in pod.get("initContainers", []):
            who = f"{where}/{init['name']}"
            assert where == "DaemonSet/kvtier" and init["name"] == "prepare-disk-tier", who
            sc = init["securityContext"]
            assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}, who
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, who
            assert sc.get("privileged", False) is False, who
            assert [m["mountPath"] for m in init["volumeMounts"]] == ["/var/lib/kvtier"], who
            assert init["command"][:2] == ["sh", "-c"]
            assert init["command"][2] == (
                f"chown {DAEMON_UID}:{DAEMON_UID} /var/lib/kvtier && chmod 0700 /var/lib/kvtier"
            )
    sa = one(objects, "ServiceAccount", "kvtier")
    assert sa["automountServiceAccountToken"] is False
    assert daemonset(objects)["spec"]["template"]["spec"]["serviceAccountName"] == "kvtier"


def test_secrets_are_templates_mounted_read_only():
    objects = render(EMBEDDED)
    secret = one(objects, "Secret", "kvtier-secrets")
    assert set(secret["stringData"]) == SECRET_KEYS and "data" not in secret
    s3 = one(objects, "Secret", "kvtier-s3-credentials")
    assert set(s3["stringData"]) == {"access-key-id", "secret-access-key"} and "data" not in s3
    for value in [*secret["stringData"].values(), *s3["stringData"].values()]:
        assert value.startswith("REPLACE-ME"), "committed Secrets must hold placeholders only"

    pod = daemonset(objects)["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == DAEMON_UID  # makes the 0400 files group-readable
    volume = next(v for v in pod["volumes"] if "secret" in v)
    assert volume["secret"] == {"secretName": "kvtier-secrets", "defaultMode": 0o400}
    mount = next(m for m in daemon_container(objects)["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": "/etc/kvtier/secrets", "readOnly": True}


@pytest.mark.parametrize("name", ALL_OVERLAYS)
def test_references_resolve(name):
    """Every Secret/ConfigMap/ServiceAccount a pod names exists in the same rendering."""
    objects = render(ALL_OVERLAYS[name])
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
    for workload in workloads(objects):
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        pod = workload["spec"]["template"]["spec"]
        if "serviceAccountName" in pod:
            assert pod["serviceAccountName"] in accounts, where
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets, where
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps, where
        volume_names = [v["name"] for v in pod.get("volumes", [])] + [
            t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])
        ]
        assert len(volume_names) == len(set(volume_names)), where
        for container in pod.get("initContainers", []) + pod["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], (where, env["name"])
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volume_names, (where, mount)


# --- the daemon ---------------------------------------------------------------------------------


def test_daemon_workload():
    objects = render(EMBEDDED)
    ds = daemonset(objects)
    pod_template = ds["spec"]["template"]
    assert selector_matches(ds["spec"]["selector"]["matchLabels"], pod_template["metadata"]["labels"])
    assert pod_template["metadata"]["labels"] | DAEMON_POD_LABELS == pod_template["metadata"]["labels"]
    pod = pod_template["spec"]

    # GPU nodes only, tolerating the GPU taint; the daemon takes no GPU itself.
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]

    c = daemon_container(objects)
    assert c["command"] == DAEMON_COMMAND
    assert "args" not in c
    assert {(p["name"], p["containerPort"], p["protocol"]) for p in c["ports"]} == {
        ("grpc", GRPC_PORT, "TCP"),
        ("metrics", METRICS_PORT, "TCP"),
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": GRPC_PORT}, probe
        assert c[probe]["periodSeconds"] > 0 and c[probe]["failureThreshold"] >= 1, probe
    assert "nvidia.com/gpu" not in c["resources"]["limits"]

    assert pod_template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert volumes[mounts["/var/lib/kvtier"]["name"]]["hostPath"] == {
        "path": "/var/lib/kvtier",
        "type": "DirectoryOrCreate",
    }
    assert not mounts["/var/lib/kvtier"].get("readOnly")
    assert volumes[mounts["/etc/kvtier/config"]["name"]]["configMap"]["name"] == "kvtier-config"
    assert mounts["/etc/kvtier/config"]["readOnly"] is True
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]

    env = {e["name"]: e for e in c["env"]}
    for var, key in (("AWS_ACCESS_KEY_ID", "access-key-id"), ("AWS_SECRET_ACCESS_KEY", "secret-access-key")):
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "kvtier-s3-credentials", "key": key}
    assert env["HOME"]["value"] == "/tmp"  # the root filesystem is read-only


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


@pytest.mark.parametrize("name", OVERLAYS)
def test_config_fits_the_pod(name):
    """The TOML and the DaemonSet agree: ports, mounted files, disk path, memory budget."""
    objects = render(OVERLAYS[name])
    config = config_of(objects)
    c = daemon_container(objects)
    ports = {p["containerPort"] for p in c["ports"]}
    assert int(config["server"]["listen"].rsplit(":", 1)[1]) == GRPC_PORT in ports
    assert int(config["server"]["metrics_listen"].rsplit(":", 1)[1]) == METRICS_PORT in ports

    secret_keys = set(one(objects, "Secret", "kvtier-secrets")["stringData"])
    key_files = [
        config["auth"]["token_key_file"],
        config["security"]["master_key_file"],
        config["security"]["server_secret_file"],
    ]
    assert {str(Path(f).parent) for f in key_files} == {"/etc/kvtier/secrets"}
    assert {Path(f).name for f in key_files} == secret_keys

    config_file = Path(c["command"][c["command"].index("--config") + 1])
    assert str(config_file.parent) == "/etc/kvtier/config" and config_file.name == "kvtier.toml"
    assert Path("/var/lib/kvtier") in Path(config["tiers"]["disk"]["path"]).parents

    memory_limit = _bytes(c["resources"]["limits"]["memory"])
    assert _bytes(c["resources"]["requests"]["memory"]) == memory_limit
    needed = config["tiers"]["memory"]["capacity_bytes"] + config["server"]["max_inflight_bytes"]
    assert memory_limit >= needed + 2**30  # + 1 GiB for the interpreter, torch and gRPC


# --- config -------------------------------------------------------------------------------------


def test_base_config_is_the_agreed_schema():
    assert config_of(render(BASE)) == BASE_CONFIG
    assert config_of(render(EMBEDDED)) == BASE_CONFIG


def test_external_config_differs_only_in_the_endpoint():
    expected = copy.deepcopy(BASE_CONFIG)
    expected["tiers"]["remote"]["endpoint"] = "https://s3.us-east-1.amazonaws.com"
    assert config_of(render(EXTERNAL)) == expected
    # The patch replaces the ConfigMap value only; the rest of the rendering equals the base's.
    external = {(o["kind"], o["metadata"]["name"]): o for o in render(EXTERNAL)}
    base = {(o["kind"], o["metadata"]["name"]): o for o in render(BASE)}
    assert external.keys() == base.keys()
    for key in base:
        if key != ("ConfigMap", "kvtier-config"):
            assert external[key] == base[key], key


# --- service and network policy ---------------------------------------------------------------


def test_daemon_service():
    objects = render(EMBEDDED)
    svc = one(objects, "Service", "kvtier")
    spec = svc["spec"]
    assert spec["type"] == "ClusterIP"
    assert spec["internalTrafficPolicy"] == "Local"
    assert spec["selector"] == DAEMON_POD_LABELS
    assert selector_matches(spec["selector"], daemonset(objects)["spec"]["template"]["metadata"]["labels"])
    container_ports = {p["name"]: p["containerPort"] for p in daemon_container(objects)["ports"]}
    assert {(p["name"], p["port"], container_ports[p["targetPort"]]) for p in spec["ports"]} == {
        ("grpc", GRPC_PORT, GRPC_PORT),
        ("metrics", METRICS_PORT, METRICS_PORT),
    }


def test_daemon_network_policy():
    objects = render(EMBEDDED)
    np = one(objects, "NetworkPolicy", "kvtier-daemon")["spec"]
    assert np["podSelector"] == {"matchLabels": DAEMON_POD_LABELS}
    assert selector_matches(
        np["podSelector"]["matchLabels"], daemonset(objects)["spec"]["template"]["metadata"]["labels"]
    )
    assert np["policyTypes"] == ["Ingress"]
    assert np["ingress"] == [
        {
            # one peer: engine-labelled pods in any namespace (both selectors must match)
            "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": ENGINE_LABELS}}],
            "ports": [{"protocol": "TCP", "port": GRPC_PORT}],
        },
        {
            "from": [{"namespaceSelector": MONITORING_NS_SELECTOR}],
            "ports": [{"protocol": "TCP", "port": METRICS_PORT}],
        },
    ]


# --- embedded SeaweedFS ---------------------------------------------------------------------------


def test_seaweedfs_statefulset_and_service():
    objects = render(EMBEDDED)
    sts = one(objects, "StatefulSet", "kvtier-seaweedfs")
    pod_template = sts["spec"]["template"]
    assert sts["spec"]["replicas"] == 1
    assert selector_matches(sts["spec"]["selector"]["matchLabels"], pod_template["metadata"]["labels"])
    c = pod_template["spec"]["containers"][0]
    argv = c["command"] + c["args"]
    assert argv[0].endswith("/weed") and "server" in argv and "-s3" in argv
    assert "-s3.port=8333" in argv and "-dir=/data" in argv
    assert "-ip.bind=127.0.0.1" in argv  # unauthenticated master/volume/filer stay on loopback
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["s3"] == S3_PORT
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "s3"}, probe
    metrics_port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
    assert f"-metricsPort={metrics_port}" in argv
    assert pod_template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(metrics_port),
        "prometheus.io/path": "/metrics",
    }

    claims = sts["spec"]["volumeClaimTemplates"]
    assert [t["metadata"]["name"] for t in claims] == ["data"]
    assert claims[0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert _bytes(claims[0]["spec"]["resources"]["requests"]["storage"]) > 0
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]

    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    daemon_env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in daemon_container(objects)["env"]
        if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
    }
    assert env == daemon_env  # daemon and object store share one set of S3 credentials

    headless = one(objects, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"

    # The configured endpoint resolves to this Service in the daemon's namespace.
    endpoint = config_of(objects)["tiers"]["remote"]["endpoint"]
    match = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", endpoint)
    assert match, endpoint
    svc = one(objects, "Service", match.group(1))
    assert svc["metadata"]["namespace"] == daemonset(objects)["metadata"]["namespace"]
    assert selector_matches(svc["spec"]["selector"], pod_template["metadata"]["labels"])
    ports = {p["port"]: p["targetPort"] for p in svc["spec"]["ports"]}
    assert ports[int(match.group(2))] == "s3"

    np = one(objects, "NetworkPolicy", "kvtier-seaweedfs")["spec"]
    assert selector_matches(np["podSelector"]["matchLabels"], pod_template["metadata"]["labels"])
    s3_rule = next(r for r in np["ingress"] if r["ports"] == [{"protocol": "TCP", "port": S3_PORT}])
    assert s3_rule["from"] == [
        {"podSelector": {"matchLabels": DAEMON_POD_LABELS}},
        {"namespaceSelector": {}, "podSelector": {"matchLabels": ENGINE_LABELS}},
    ]


def test_external_overlay_has_no_embedded_store():
    objects = render(EXTERNAL)
    assert not [o for o in objects if "seaweedfs" in o["metadata"]["name"]]
    assert config_of(objects)["tiers"]["remote"]["endpoint"].startswith("https://")


# --- Dockerfile and packaging consistency -------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, comments dropped and continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text()
    logical, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "Dockerfile ends inside a continuation"
    out = []
    for line in logical:
        instruction, _, args = line.partition(" ")
        out.append((instruction.upper(), args.strip()))
    return out


def _only(instructions: list[tuple[str, str]], name: str) -> str:
    values = [args for ins, args in instructions if ins == name]
    assert len(values) == 1, f"expected one {name}, found {values}"
    return values[0]


def test_dockerfile_matches_the_manifests():
    ins = dockerfile_instructions()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())

    entrypoint = json.loads(_only(ins, "ENTRYPOINT"))
    cmd = json.loads(_only(ins, "CMD"))
    assert entrypoint == ["kvtier"]
    assert entrypoint[0] in pyproject["project"]["scripts"]  # the console script pip installs
    assert entrypoint + cmd == DAEMON_COMMAND == daemon_container(render(EMBEDDED))["command"]

    user = _only(ins, "USER")
    assert user == f"{DAEMON_UID}:{DAEMON_UID}"
    pod = daemonset(render(EMBEDDED))["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == DAEMON_UID
    assert daemon_container(render(EMBEDDED))["securityContext"]["runAsUser"] == DAEMON_UID
    assert f"--uid {DAEMON_UID}" in " ".join(args for i, args in ins if i == "RUN")

    exposed = {int(p) for p in _only(ins, "EXPOSE").split()}
    assert exposed == {p["containerPort"] for p in daemon_container(render(EMBEDDED))["ports"]}

    # Multi-stage on python:3.11-slim.
    args = dict(a.split("=", 1) for i, a in ins if i == "ARG" and "=" in a)
    stages = [a for i, a in ins if i == "FROM"]
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert stages == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE} AS runtime"]
    assert ("COPY", "--from=build /opt/kvtier /opt/kvtier") in ins

    runs = [" ".join(a.split()) for i, a in ins if i == "RUN"]
    assert any("--index-url https://download.pytorch.org/whl/cpu" in r and '"torch==' in r for r in runs)
    assert any(re.search(r"(^|&& )pip install \.( |$)", r) for r in runs)

    # The image tag deployed is the version pip builds.
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    image = next(i for i in kustomization["images"] if i["name"] == "kvtier")
    assert f"{image['newName']}:{image['newTag']}" == DAEMON_IMAGE
    assert image["newTag"] == pyproject["project"]["version"]


def test_dockerignore_keeps_secrets_and_local_state_out():
    patterns = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "**/*.key", "**/*.pem"} <= patterns
    for needed in ("pyproject.toml", "README.md", "kvtier", "storage_backends", "connectors", "benchmarks"):
        assert needed not in patterns


# --- the fleet overlay (kvtier route) ---------------------------------------------------------------


def test_fleet_overlay_routes_to_every_engine_pod_and_its_daemon(tmp_path):
    objects = render(FLEET)
    sts = one(objects, "StatefulSet", "vllm")
    replicas = sts["spec"]["replicas"]
    assert replicas >= 2
    assert one(objects, "Service", "vllm")["spec"]["clusterIP"] == "None"
    pod = sts["spec"]["template"]["spec"]
    assert sts["spec"]["template"]["metadata"]["labels"]["kvtier.io/engine"] == "true"  # S3 admits them
    vllm, daemon = pod["containers"]
    assert (vllm["name"], daemon["name"]) == ("vllm", "kvtier")
    assert daemon["image"] == DAEMON_IMAGE and daemon["command"] == DAEMON_COMMAND
    assert vllm["image"] == "ghcr.io/kvtier/vllm-kvtier:0.1.0"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
    flag = next(a for a in vllm["command"] if a.startswith("--kv-transfer-config="))
    transfer = json.loads(flag.split("=", 1)[1])
    extra = transfer["kv_connector_extra_config"]
    assert extra["kvtier.daemon"] == "127.0.0.1:7070" and transfer["kv_connector"] == "KvtierConnector"

    # Each container holds only its own secret: the salts' key never reaches the engine.
    volumes = {v["name"]: v for v in pod["volumes"]}

    def secret_items(container):
        return {i["key"] for m in container["volumeMounts"] if "secret" in volumes[m["name"]]
                and volumes[m["name"]]["secret"]["secretName"] == "kvtier-fleet-secrets"
                for i in volumes[m["name"]]["secret"]["items"]}

    assert secret_items(vllm) == {"engine-token"}
    assert secret_items(daemon) == {"salt-key"}

    # The daemons' config loads with kvtier's own schema and describes the engine beside them.
    cm = one(objects, "ConfigMap", "kvtier-fleet-config")
    (tmp_path / "kvtier.toml").write_text(cm["data"]["kvtier.toml"])
    from kvtier.server.config import load_config

    config = load_config(tmp_path / "kvtier.toml", env={})
    block_size = int(next(a for a in vllm["command"] if a.startswith("--block-size=")).split("=")[1])
    assert config.locate is not None and config.locate.model_id == extra["kvtier.model_id"]
    assert config.locate.block_tokens == block_size
    assert config.tiers.disk.path.startswith("/var/lib/kvtier")
    assert config.auth.salt_key_file == "/etc/kvtier/fleet/salt-key"

    # The router: one --engine per pod, its node the pod's daemon in the membership file.
    router = one(objects, "Deployment", "kvtier-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["command"][:2] == ["kvtier", "route"] and router["image"] == DAEMON_IMAGE
    engines = [a.split("=", 1)[1] for a in router["command"] if a.startswith("--engine=")]
    names = [f"vllm-{i}" for i in range(replicas)]
    assert engines == [f"{n}=http://{n}.vllm.kvtier.svc:8000" for n in names]
    members = tomllib.loads(cm["data"]["members.toml"])
    assert members["nodes"] == {n: f"{n}.vllm.kvtier.svc:7070" for n in names}
    # ... the router reads them from the Service's endpoints: the port it names is the daemons'
    # gRPC port, and its own account may list endpointslices in the namespace, and nothing else.
    from kvtier.server.k8s_membership import K8sSource

    source = K8sSource.parse(next(a.split("=", 1)[1] for a in router["command"] if a.startswith("--members=")))
    service = one(objects, "Service", "vllm")
    assert (source.namespace, source.service) == ("kvtier", "vllm")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}[source.port] == 7070
    router_pod = one(objects, "Deployment", "kvtier-router")["spec"]["template"]["spec"]
    assert router_pod["serviceAccountName"] == "kvtier-router"
    role = one(objects, "Role", "kvtier-router-endpoints")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]}]
    binding = one(objects, "RoleBinding", "kvtier-router-endpoints")
    assert binding["roleRef"]["name"] == "kvtier-router-endpoints"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvtier-router", "namespace": "kvtier"}]
    # The base's node daemons are parked: every engine pod here has its own.
    assert daemonset(objects)["spec"]["template"]["spec"]["nodeSelector"]["kvtier.io/node-daemon"] == "true"
