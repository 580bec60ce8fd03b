"""Fleet membership from Kubernetes: the endpoints of a Service, read from the API server.

A source is written ``k8s://NAMESPACE/SERVICE:PORT`` (``PORT``: the port's name in the Service,
e.g. ``grpc``, or the number the pods listen on: an EndpointSlice lists target ports). The
members are the ready endpoints of the Service's EndpointSlices (``discovery.k8s.io/v1``, listed
by the label ``kubernetes.io/service-name=SERVICE``), one per pod, named after it
(``targetRef.name``; else the endpoint's ``hostname``; else the address with its dots and colons
made dashes), at ``ADDRESS:PORT``. An endpoint whose ``conditions.ready`` is false is left out
(absent means ready, as the API says); a Service with ``publishNotReadyAddresses`` lists every
pod, and the router's own probes then decide who answers.

Credentials are the pod's own (in-cluster): the API server at ``https://$KUBERNETES_SERVICE_HOST:
$KUBERNETES_SERVICE_PORT``, the service account's token and CA bundle under
``/var/run/secrets/kubernetes.io/serviceaccount``. The token is read again for every request (the
kubelet rotates projected tokens). The service account needs ``list`` on ``endpointslices`` in the
namespace (k8s/overlays/fleet/router-rbac.yaml).

Every failure is named: ``ConfigError`` for what is wrong here (a malformed source, not in a pod,
no token or CA file); ``MembershipDenied`` when the API server refuses the token (401) or the
service account may not list endpointslices (403); ``MembershipUnavailable`` when it cannot be
reached, does not answer within the timeout, answers another error, or answers something that is
not an EndpointSliceList. A Service with no ready endpoint is an empty membership, not an error:
the caller decides what that means.

Protocol: ``K8sEndpoints.parse(source, api)`` -> ``await fetch()`` any number of times (each call
its own HTTP session: a refresh every few seconds needs no connection kept open).

Tested against a local aiohttp server that answers the API's JSON shapes over TLS
(tests/integration/test_k8s_membership.py): no Kubernetes cluster can run on the test machine.
"""

from __future__ import annotations

import json
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from kvtier.errors import AccessDenied, ConfigError, TierUnavailable
from kvtier.server.fleet_view import Member

SCHEME = "k8s://"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: Seconds one list request may take, connection included.
DEFAULT_TIMEOUT_S = 5.0
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")


class MembershipDenied(AccessDenied):
    """The Kubernetes API refused the service account's token (401) or the list (403)."""


class MembershipUnavailable(TierUnavailable):
    """The Kubernetes API could not be reached, timed out, failed, or answered an unexpected shape."""


@dataclass(slots=True, frozen=True)
class ApiAccess:
    """Where the API server is and the files that authenticate to it."""

    url: str
    token_file: Path
    ca_file: Path
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def in_cluster(cls, env: Mapping[str, str] | None = None, sa_dir: Path = SERVICE_ACCOUNT_DIR,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> ApiAccess:
        """The pod's own API access; ConfigError naming what is missing when not in a pod."""
        env = os.environ if env is None else env
        host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
        if not host or not port:
            raise ConfigError("k8s membership: KUBERNETES_SERVICE_HOST / KUBERNETES_SERVICE_PORT are not set "
                              "(not running in a Kubernetes pod); use --members FILE or --node outside a cluster")
        if not port.isdigit():
            raise ConfigError(f"k8s membership: KUBERNETES_SERVICE_PORT={port!r} is not a port number")
        shown = f"[{host}]" if ":" in host else host
        access = cls(f"https://{shown}:{port}", sa_dir / "token", sa_dir / "ca.crt", timeout_s)
        access.check_files()
        return access

    def check_files(self) -> None:
        for what, path in (("service-account token", self.token_file), ("CA bundle", self.ca_file)):
            if not path.is_file():
                raise ConfigError(f"k8s membership: no {what} at {path} (is automountServiceAccountToken false, "
                                  "or the projected volume missing?)")

    def token(self) -> str:
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"k8s membership: cannot read the service-account token {self.token_file} "
                              f"({exc.strerror})") from None
        if not token:
            raise ConfigError(f"k8s membership: the service-account token {self.token_file} is empty")
        return token

    def ssl_context(self) -> ssl.SSLContext:
        try:
            return ssl.create_default_context(cafile=str(self.ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"k8s membership: the CA bundle {self.ca_file} is not usable ({exc})") from None


@dataclass(slots=True, frozen=True)
class K8sSource:
    """``k8s://NAMESPACE/SERVICE:PORT``, parsed."""

    namespace: str
    service: str
    port: int | str  # a number, or the Service port's name

    @classmethod
    def parse(cls, text: str) -> K8sSource:
        shape = f"{SCHEME}NAMESPACE/SERVICE:PORT (PORT a number or the port's name), got {text!r}"
        if not text.startswith(SCHEME):
            raise ConfigError(f"membership source: expected {shape}")
        namespace, slash, rest = text[len(SCHEME):].partition("/")
        service, colon, port = rest.partition(":")
        if not slash or not colon or not namespace or not service or not port:
            raise ConfigError(f"membership source: expected {shape}")
        for what, value in (("namespace", namespace), ("service", service)):
            if not _DNS_LABEL.fullmatch(value):
                raise ConfigError(f"membership source {text!r}: the {what} {value!r} is not a DNS label "
                                  "(lower-case letters, digits and -, at most 63)")
        if port.isdigit():
            number = int(port)
            if not 0 < number < 65536:
                raise ConfigError(f"membership source {text!r}: port {number} is out of range")
            return cls(namespace, service, number)
        if not _PORT_NAME.fullmatch(port):
            raise ConfigError(f"membership source {text!r}: port {port!r} is neither a number nor a port name")
        return cls(namespace, service, port)

    def __str__(self) -> str:
        return f"{SCHEME}{self.namespace}/{self.service}:{self.port}"


def is_k8s_source(text: str) -> bool:
    return text.startswith(SCHEME)


class K8sEndpoints:
    """Reads a Service's members from the API server (module docstring). Holds no connection."""

    def __init__(self, source: K8sSource, api: ApiAccess) -> None:
        self.source = source
        self.api = api

    @classmethod
    def parse(cls, text: str, api: ApiAccess | None = None) -> K8sEndpoints:
        source = K8sSource.parse(text)
        return cls(source, api if api is not None else ApiAccess.in_cluster())

    def describe(self) -> str:
        return f"{self.source} (API {self.api.url})"

    async def fetch(self) -> list[Member]:
        """The ready members, sorted by name."""
        items: list[Any] = []
        cont = ""
        headers = {"Authorization": f"Bearer {self.api.token()}", "Accept": "application/json"}
        connector = aiohttp.TCPConnector(ssl=self.api.ssl_context())
        timeout = aiohttp.ClientTimeout(total=self.api.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            while True:  # the list may come in pages (metadata.continue)
                page = await self._get(session, headers, cont)
                items.extend(page["items"])
                cont = page.get("metadata", {}).get("continue") or ""
                if not cont:
                    break
        return self._members(items)

    async def _get(self, session: aiohttp.ClientSession, headers: dict[str, str], cont: str) -> dict[str, Any]:
        s = self.source
        url = (f"{self.api.url}/apis/discovery.k8s.io/v1/namespaces/{s.namespace}/endpointslices"
               f"?labelSelector={quote(f'kubernetes.io/service-name={s.service}')}")
        if cont:
            url += f"&continue={quote(cont)}"
        where = f"the Kubernetes API at {self.api.url}"
        try:
            async with session.get(url, headers=headers) as resp:
                status = resp.status
                body = await resp.read()
        except TimeoutError:
            raise MembershipUnavailable(f"{where}: no answer within {self.api.timeout_s:g} s listing the "
                                        f"endpointslices of {s}") from None
        except aiohttp.ClientError as exc:
            raise MembershipUnavailable(f"{where} is unreachable ({type(exc).__name__}: {exc})") from None
        if status == 401:
            raise MembershipDenied(f"{where} refused the service account's token (401)")
        if status == 403:
            raise MembershipDenied(f"{where} forbids listing endpointslices in namespace {s.namespace} (403): "
                                   "give the router's service account a Role with list on "
                                   "discovery.k8s.io/endpointslices (k8s/overlays/fleet/router-rbac.yaml)")
        if status != 200:
            raise MembershipUnavailable(f"{where} answered {status} listing the endpointslices of {s}: "
                                        f"{body[:200].decode(errors='replace')}")
        try:
            page = _json_object(body)
        except ValueError as exc:
            raise MembershipUnavailable(f"{where}: not an EndpointSliceList ({exc})") from None
        if page.get("kind", "EndpointSliceList") != "EndpointSliceList" or not isinstance(page.get("items"), list):
            raise MembershipUnavailable(f"{where}: not an EndpointSliceList (kind {page.get('kind')!r})")
        return page

    def _members(self, slices: list[Any]) -> list[Member]:
        by_name: dict[str, Member] = {}
        for sl in slices:
            if not isinstance(sl, dict):
                raise MembershipUnavailable("the Kubernetes API: an EndpointSlice that is not an object")
            port = self._port(sl)
            if port is None:
                continue  # this slice does not carry the port (a Service may split ports across slices)
            family = sl.get("addressType", "IPv4")
            if family not in ("IPv4", "IPv6"):
                continue  # FQDN slices are not addresses of pods
            for ep in sl.get("endpoints") or []:
                if (ep.get("conditions") or {}).get("ready") is False:
                    continue
                for address in (ep.get("addresses") or [])[:1]:  # the API: all addresses are one pod
                    name = ((ep.get("targetRef") or {}).get("name") or ep.get("hostname")
                            or re.sub(r"[.:]", "-", address).strip("-"))
                    host = f"[{address}]" if family == "IPv6" else address
                    by_name[name] = Member(name, f"{host}:{port}")
        return [by_name[n] for n in sorted(by_name)]

    def _port(self, sl: dict[str, Any]) -> int | None:
        want = self.source.port
        for p in sl.get("ports") or []:
            if not isinstance(p, dict) or not isinstance(p.get("port"), int):
                continue
            if (isinstance(want, int) and p["port"] == want) or p.get("name") == want:
                return int(p["port"])
        return None


def _json_object(body: bytes) -> dict[str, Any]:
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    return data
