"""The fleet overlay (k8s/overlays/fleet): `kvtier route` in front of engine pods that each have
their own daemon, all sharing the S3 tier; what the router, the engines and the daemons are
given, and what each may read.
"""

from __future__ import annotations

import json
import tomllib

from .rendered import (
    DAEMON_COMMAND,
    DAEMON_IMAGE,
    FLEET,
    daemonset,
    one,
    render,
)


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
