"""The container recipe (Dockerfile, .dockerignore) agrees with the manifests and pyproject.toml:
the command, user, ports and image tag the pods run are the ones the image is built with.
"""

from __future__ import annotations

import json
import re
import tomllib

import yaml

from .rendered import (
    BASE,
    DAEMON_COMMAND,
    DAEMON_IMAGE,
    DAEMON_UID,
    EMBEDDED,
    ROOT,
    daemon_container,
    daemonset,
    render,
)


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
