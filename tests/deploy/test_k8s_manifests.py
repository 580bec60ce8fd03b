"""Offline checks of the Kubernetes manifests (k8s/): every kustomization renders and validates
against the Kubernetes schemas (tests/deploy/rendered.py), and the properties that matter for
running kvtier safely hold: security contexts, probes, metrics, network policy, config/secret
wiring and the embedded SeaweedFS. The fleet overlay's own wiring is test_k8s_fleet.py; the
container recipe's agreement with these manifests, test_dockerfile.py.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from .rendered import (
    ALL_OVERLAYS,
    BASE,
    BASE_CONFIG,
    DAEMON_COMMAND,
    DAEMON_IMAGE,
    DAEMON_POD_LABELS,
    DAEMON_UID,
    EMBEDDED,
    ENGINE_LABELS,
    EXTERNAL,
    FLEET,
    GRPC_PORT,
    K8S,
    METRICS_PORT,
    MONITORING_NS_SELECTOR,
    NAMESPACE,
    OVERLAYS,
    S3_PORT,
    SEAWEEDFS,
    SECRET_KEYS,
    config_of,
    daemon_container,
    daemonset,
    effective,
    k8s_versions,
    kr,
    kustomization_dirs,
    one,
    pod_specs,
    render,
    schema_errors,
    selector_matches,
    workloads,
)

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
